"""The tests' standard in-process shard and what they push to it: the nano GPT in 3 fragments (sync every 6
steps), shard 0 of 2, chunks of 256 bytes so that a slice spans many chunks; the fingerprint a worker of
that run sends at Join, and seeded deltas of a fragment's slice; and the same run's ShardState without any
network (`nano_state`), for the tests of the pure round logic.

Used by tests/conftest.py's `shard` and `make_shard` fixtures and by every test file that talks to this
shard (test_service, test_elastic_units, test_credit, test_tls, ...). It must not grow tests of its own nor
import a test file.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from streamdiloco.common.codecs import Encoded, encode
from streamdiloco.common.config import SyncConfig
from streamdiloco.common.fingerprint import model_fingerprint
from streamdiloco.common.fragments import build_layout, flatten, fragment_params
from streamdiloco.server.rounds.robust import RobustConfig
from streamdiloco.server.rounds.state import ShardState
from streamdiloco.server.shard import Shard
from streamdiloco.worker.model import build_gpt
from tests.support.inthread import InThreadShard
from tests.support.shards import shard_of

CFG = SyncConfig(sync_every=6, num_fragments=3)  # first sends: fragment 1 at 2, 2 at 4, 0 at 6
CHUNK_BYTES = 256  # e3m0: 512 values a chunk, so shard 0's 12352-value slice of fragment 0 is 25 chunks


def fingerprint(cfg: SyncConfig = CFG, **model_kw) -> dict:
    """The model fingerprint of a worker with the nano model (seed 0, `model_kw` changed) and `cfg`."""
    torch.manual_seed(0)
    return model_fingerprint(build_layout(build_gpt("nano", **model_kw), cfg.num_fragments), cfg)


GOOD_FP = json.dumps(fingerprint())  # what an honest worker of this run sends at Join


def build(
    token: str = "", min_workers: int = 2, round_timeout: float = 30.0, checkpoint_dir: str | None = None
) -> Shard:
    """Shard 0 of 2 of the nano run, not yet serving."""
    service = shard_of(
        CFG,
        "nano",
        shard=0,
        num_shards=2,
        min_workers=min_workers,
        round_timeout=round_timeout,
        token=token,
        chunk_bytes=CHUNK_BYTES,
        checkpoint_dir=checkpoint_dir,
    )
    assert isinstance(service, Shard)  # a model is given: never the shard waiting for an upload
    return service


class NanoShard(InThreadShard):
    """build()'s shard serving in a thread of its own on 127.0.0.1 (port 0 unless given)."""

    def __init__(
        self,
        tmp_path: Path,
        token: str = "",
        min_workers: int = 2,
        round_timeout: float = 30.0,
        checkpoint_dir: Path | str | None = None,
        port: int = 0,
    ):
        ckdir = None if checkpoint_dir is None else str(checkpoint_dir)
        service = build(token, min_workers, round_timeout, ckdir)
        super().__init__(service, tmp_path, GOOD_FP, token=token, port=port)


def delta(seed: int, n: int) -> torch.Tensor:
    """n values of a worker's delta, about 1e-2 each, the same for the same seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * 1e-2


SLICE_LEN = [hi - lo for lo, hi in build().state.ranges]  # shard 0's slice of each fragment
ENC_A = encode(delta(1, SLICE_LEN[0]), "e3m0", 128)  # two workers' pushes of fragment 0
ENC_B = encode(delta(2, SLICE_LEN[0]), "e3m0", 128)


def nano_state(
    shard: int = 0, num_shards: int = 2, robust: RobustConfig | None = None, **cfg_kw
) -> tuple[ShardState, SyncConfig]:
    """Shard `shard` of `num_shards`' rounds of the nano run (seed 0, 3 fragments, sync every 6, `cfg_kw`
    changed), without any network; ShardState's own defaults otherwise. Seeds torch's generator with 0."""
    torch.manual_seed(0)
    model = build_gpt("nano")
    cfg = SyncConfig(sync_every=6, num_fragments=3, **cfg_kw)
    layout = build_layout(model, 3)
    initial = [flatten(fragment_params(model, f)) for f in layout.fragments]
    return ShardState(shard, num_shards, layout, cfg, initial, robust=robust), cfg


def slice_delta(state: ShardState, fragment: int, seed: int) -> torch.Tensor:
    """A worker's delta for the state's slice of the fragment: delta(seed, the slice's length)."""
    lo, hi = state.ranges[fragment]
    return delta(seed, hi - lo)


def slice_push(state: ShardState, fragment: int, seed: int) -> Encoded:
    """slice_delta in the run's uplink codec: a whole push's values."""
    return encode(slice_delta(state, fragment, seed), state.cfg.uplink_codec, state.cfg.codec_block_size)
