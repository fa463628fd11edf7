import pytest
import torch

from streamdiloco.worker.model import build_gpt


@pytest.fixture
def nano_model():
    torch.manual_seed(0)
    return build_gpt("nano")
