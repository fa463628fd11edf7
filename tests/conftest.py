import pytest
import torch

from streamdiloco.worker.model import build_gpt


@pytest.fixture
def nano_model():
    torch.manual_seed(0)
    return build_gpt("nano")


# The files whose tests start real processes, the longest first (measured with --durations=0). With
# `-n 2 --dist loadfile`, xdist hands out files in collection order: these go first, so that the run does
# not end with one process on a long file while the other has nothing left.
LONG_FIRST = (
    "test_quickstart.py",
    "test_slow_link.py",  # a minute, mostly waiting on a 1 Mbit/s link: beside the CPU-bound ones
    "test_hf_trainer.py",
    "test_cli.py",
    "test_export.py",
    "test_edges.py",
    "test_e2e.py",
    "test_faults.py",
    "test_noinit.py",
    "test_settings.py",
    "test_monitoring.py",
    "test_tls.py",
    "test_fuzz.py",
    "test_dashboard.py",
    "test_packaging.py",
    "test_hf_model.py",
    "test_logs.py",
    "test_data_prepare.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
