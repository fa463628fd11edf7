"""engine.global_state_dict(): the global model (the mirror) as a state_dict of the user's model."""

from __future__ import annotations

import torch
import torch.nn as nn

from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fragments import build_layout
from streamdiloco.worker.engine import SyncEngine
from tests.support.nowire import NoWire


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(7, 4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.emb.weight  # tied: one parameter under two names
        self.register_buffer("mask", torch.tril(torch.ones(3, 3)))


def test_the_global_state_dict_holds_the_mirror_not_the_local_parameters():
    model = Tied()
    engine = SyncEngine(model, build_layout(model, 3, "strided"), SyncConfig(num_fragments=3), NoWire())
    try:
        for f, mirror in enumerate(engine.mirrors):  # a global model unlike the local one
            mirror.copy_(torch.arange(mirror.numel(), dtype=torch.float32) + 100 * f)
        local = {k: v.clone() for k, v in model.state_dict().items()}
        sd = engine.global_state_dict()
        assert set(sd) == set(model.state_dict())  # loads into the user's model as it is
        assert all(torch.equal(v, local[k]) for k, v in model.state_dict().items())  # local untouched
        fresh = Tied()
        fresh.load_state_dict(sd)
        for f, fragment in enumerate(engine.layout.fragments):
            for e in fragment.entries:
                want = engine.mirrors[f][e.offset : e.offset + e.numel].view(e.shape)
                assert torch.equal(dict(fresh.named_parameters())[e.name], want)
        assert torch.equal(sd["head.weight"], sd["emb.weight"])  # both names of the tied weight
        assert torch.equal(sd["mask"], local["mask"])  # buffers as the model holds them
        mirrors = [m.clone() for m in engine.mirrors]
        for v in sd.values():  # copies: changing them changes neither the mirror nor the model
            v.add_(1.0)
        assert all(torch.equal(a, b) for a, b in zip(mirrors, engine.mirrors, strict=True))
        assert all(torch.equal(v, local[k]) for k, v in model.state_dict().items())
    finally:
        engine.close()


def test_low_precision_parameters_come_back_in_their_own_dtype():
    model = Tied().to(torch.bfloat16)
    engine = SyncEngine(model, build_layout(model, 3, "strided"), SyncConfig(num_fragments=3), NoWire())
    try:
        sd = engine.global_state_dict()
        assert all(v.dtype == torch.bfloat16 for k, v in sd.items() if k != "mask")
        torch.testing.assert_close(sd["blocks.0.weight"], model.blocks[0].weight.detach())  # mirror = init
    finally:
        engine.close()
