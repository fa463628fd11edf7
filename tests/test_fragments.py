"""Fragment layout: every parameter in exactly one fragment, strided/sequential assignment, flat views."""

import pytest
import torch
import torch.nn as nn

from streamdiloco.common.fragments import (
    assign_blocks,
    build_layout,
    find_block_list,
    flatten,
    fragment_params,
    slice_ranges,
    unflatten_into,
)
from streamdiloco.worker.model import build_gpt


@pytest.mark.parametrize("pattern", ["strided", "sequential"])
@pytest.mark.parametrize("P", [1, 2, 3, 4, 5])
def test_every_parameter_in_exactly_one_fragment(nano_model, pattern, P):
    layout = build_layout(nano_model, P, pattern)
    assert layout.num_fragments == P
    names = [n for f in layout.fragments for n in f.names]
    assert sorted(names) == sorted(n for n, _ in nano_model.named_parameters())
    assert len(names) == len(set(names))
    assert layout.numel == sum(p.numel() for p in nano_model.parameters())
    # the tied embedding/head weight is one parameter, counted once, in the last (non-block) fragment
    assert "transformer.wte.weight" in layout.fragments[P - 1].names
    assert "lm_head.weight" not in names


def test_strided_and_sequential_assignment():
    assert assign_blocks(8, 4, "strided") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert assign_blocks(8, 4, "sequential") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert assign_blocks(5, 2, "sequential") == [[0, 1, 2], [3, 4]]
    assert assign_blocks(5, 2, "strided") == [[0, 2, 4], [1, 3]]
    with pytest.raises(ValueError, match="5 block fragments need at least as many blocks, the model has 4"):
        assign_blocks(4, 5, "strided")


def test_one_fragment_is_the_whole_model(nano_model):
    layout = build_layout(nano_model, 1)
    assert layout.num_fragments == 1
    assert list(layout.fragments[0].names) == [n for n, _ in nano_model.named_parameters()]


def test_block_parameters_land_in_their_fragment():
    model = build_gpt("nano", n_layer=6)
    layout = build_layout(model, 4, "strided")
    assert find_block_list(model) == "transformer.h"
    for frag in layout.fragments[:3]:
        blocks = {int(n.split(".")[2]) for n in frag.names}
        assert blocks == set(frag.blocks) == {b for b in range(6) if b % 3 == frag.index}


def test_offsets_are_contiguous(nano_model):
    layout = build_layout(nano_model, 2)
    for frag in layout.fragments:
        off = 0
        for e in frag.entries:
            assert e.offset == off
            off += e.numel
        assert off == frag.numel


def test_flatten_unflatten_roundtrip(nano_model):
    layout = build_layout(nano_model, 2)
    frag = layout.fragments[0]
    params = fragment_params(nano_model, frag)
    flat = flatten(params)
    assert flat.dtype == torch.float32 and flat.numel() == frag.numel
    unflatten_into(flat * 2, params)
    assert torch.equal(flatten(params), flat * 2)
    with pytest.raises(ValueError):
        unflatten_into(torch.zeros(frag.numel + 1), params)


def test_slice_ranges_cover_exactly():
    for n in (0, 1, 7, 100, 1001):
        for s in (1, 2, 3, 8):
            r = slice_ranges(n, s)
            assert r[0][0] == 0 and r[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(r, r[1:]))
            sizes = [b - a for a, b in r]
            assert max(sizes) - min(sizes) <= 1


def test_model_without_module_list_is_refused():
    with pytest.raises(ValueError, match="no nn.ModuleList"):
        build_layout(nn.Linear(3, 3), 2)
