"""Built-in text, validation split, per-worker streams, and the model presets."""

import pytest
import torch

from streamdiloco.worker.data import BatchStream, ByteDataset, eval_batches, load_text
from streamdiloco.worker.model import PRESETS, build_gpt


def test_builtin_text_is_shakespeare():
    text = load_text(None)
    assert len(text) > 4_000_000
    assert b"HAMLET" in text and b"To be, or not to be" in text
    assert b"**" not in text  # markdown bold markers are cleaned away


def test_validation_split_is_held_out():
    data = ByteDataset.from_bytes(bytes(range(256)) * 100, block_size=16, val_fraction=0.1)
    assert len(data.train) + len(data.val) == 25600
    assert len(data.val) == 2560


def test_streams_differ_per_worker_and_are_reproducible():
    data = ByteDataset.load(None, 32)
    a0 = BatchStream(data.train, 4, 32, seed=1, rank=0)
    a1 = BatchStream(data.train, 4, 32, seed=1, rank=1)
    again = BatchStream(data.train, 4, 32, seed=1, rank=0)
    x0, y0 = a0.next()
    assert torch.equal(x0, again.next()[0])
    assert not torch.equal(x0, a1.next()[0])
    assert torch.equal(x0[:, 1:], y0[:, :-1])  # targets are the inputs shifted by one byte
    assert x0.shape == (4, 32) and x0.max() < 256


def test_stream_position_resumes():
    data = ByteDataset.load(None, 32)
    s = BatchStream(data.train, 4, 32, seed=0, rank=0)
    s.next()
    state = s.state_dict()
    want = s.next()[0]
    t = BatchStream(data.train, 4, 32, seed=0, rank=0)
    t.load_state_dict(state)
    assert t.position == 1 and torch.equal(t.next()[0], want)


def test_eval_batches_are_fixed():
    data = ByteDataset.load(None, 32)
    a, b = eval_batches(data.val, 4, 32, 3), eval_batches(data.val, 4, 32, 3)
    assert len(a) == 3 and all(torch.equal(x[0], y[0]) for x, y in zip(a, b))


def test_user_file(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("hello world " * 50)
    data = ByteDataset.load(str(f), 16)
    assert bytes(data.train[:5].tolist()) == b"hello"


@pytest.mark.parametrize("content, message", [(None, "does not exist"), ("  \n", "is empty")])
def test_bad_data_file(tmp_path, content, message):
    f = tmp_path / "t.txt"
    if content is not None:
        f.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_text(str(f))


def test_too_short_text():
    with pytest.raises(ValueError, match="too few for block_size"):
        ByteDataset.from_bytes(b"abc" * 10, block_size=32)


def test_presets_span_1M_to_100M():
    sizes = {name: build_gpt(name).num_params() for name in ("tiny", "small")}
    assert 0.5e6 < sizes["tiny"] < 1.5e6 and 3e6 < sizes["small"] < 10e6
    # the large preset, counted without building it
    c = PRESETS["large"]
    approx = c.n_layer * 12 * c.n_embd**2 + (256 + c.block_size) * c.n_embd
    assert 90e6 < approx < 130e6
    with pytest.raises(ValueError, match="unknown model preset"):
        build_gpt("huge")
