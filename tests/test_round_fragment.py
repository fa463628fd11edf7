"""server/rounds/fragment.py in closed form: one fragment as a shard keeps it (FragmentSlice). A fragment of
eight values over two shards, shard 1's slice [4, 8); fp32 both ways, outer lr 1 without momentum, so that a
close moves the master by minus the round's mean exactly.

Pushes: a = [1, 2, 3, 4] with weight 1, b = [3, 2, 1, 0] with weight 3: their weighted sum is [10, 8, 6, 4],
their mean [2.5, 2, 1.5, 1]; the slice's master [5, 6, 7, 8] becomes [2.5, 4, 5.5, 7].
"""

from __future__ import annotations

import pytest
import torch

from streamdiloco.common.chunks import Assembly
from streamdiloco.common.codecs import encode
from streamdiloco.common.config import SyncConfig
from streamdiloco.server.rounds.defenses import Defenses
from streamdiloco.server.rounds.fragment import FragmentSlice
from streamdiloco.server.rounds.jobs import CloseJob, Push
from streamdiloco.server.rounds.robust import RobustConfig

CFG = SyncConfig(
    sync_every=4,
    num_fragments=1,
    uplink_codec="fp32",
    downlink_codec="fp32",
    outer_lr=1.0,
    outer_momentum=0.0,
)
INITIAL = torch.arange(1.0, 9.0)  # [1, ..., 8]
A, B = [1.0, 2.0, 3.0, 4.0], [3.0, 2.0, 1.0, 0.0]
SUM = [10.0, 8.0, 6.0, 4.0]
NEW_MASTER = [5.0 - 2.5, 6.0 - 2.0, 7.0 - 1.5, 8.0 - 1.0]


def fragment() -> FragmentSlice:
    recent = Defenses(RobustConfig(), CFG).recent()
    return FragmentSlice.start(0, (1, 2), INITIAL, 8, CFG, seed=0, recent=recent)


def push(worker: str, values: list[float], weight: float) -> Push:
    asm = Assembly(len(values), "fp32", 128)
    asm.add(0, 0, len(values), encode(torch.tensor(values), "fp32", 128), True)
    return Push(worker, weight, asm)


def test_a_fragment_starts_with_its_slice_of_the_initial_vector_and_round_0_open():
    fr = fragment()
    assert (fr.index, fr.slice, fr.numel, fr.open.number, fr.busy) == (0, (4, 8), 4, 0, False)
    assert fr.master.tolist() == [5.0, 6.0, 7.0, 8.0] and fr.master is fr.outer.master
    assert fr.fold_bytes == 8 * 4  # an fp64 sum of the slice
    with pytest.raises(ValueError, match="fragment 0: initial vector has 8 values, layout says 9"):
        FragmentSlice.start(0, (1, 2), INITIAL, 9, CFG, 0, fr.recent)


def test_its_sum_folds_the_groups_and_the_kept_pushes_from_the_partial_sum():
    fr = fragment()
    fr.open.add(push("b", B, 3.0), 16)
    fr.open.group()
    fr.open.add(push("a", A, 1.0), 16)
    assert fr.sum().tolist() == SUM


def test_a_fold_job_takes_the_groups_and_gives_back_the_partial_sum():
    fr = fragment()
    fr.open.add(push("a", A, 1.0), 16)
    fr.open.add(push("b", B, 3.0), 16)
    fr.open.group()
    job = fr.begin_fold()
    assert fr.busy and fr.open.groups == [] and fr.open.partial is None
    with pytest.raises(RuntimeError, match="fragment 0 already has a job out"):
        fr.begin_fold()
    fr.end_fold(job.run())
    assert not fr.busy and fr.open.partial is not None and fr.open.partial.tolist() == SUM
    assert fr.sum().tolist() == SUM


def test_a_close_opens_the_next_round_and_publishes_the_new_master_when_taken_back():
    fr = fragment()
    fr.open.add(push("a", A, 1.0), 16)
    fr.open.add(push("b", B, 3.0), 16)
    fr.open.settled = 4.0  # both settled at their reported weights
    fr.take_out()
    before = fr.master
    rnd = fr.next_round(opened_at=7.0)
    assert (rnd.number, fr.open.number, fr.open.opened_at) == (0, 1, 7.0)
    job = CloseJob(0, fr.outer, {}, rnd.closing("all", ("mean", 0.0, 1), {"weights": [], "norms": []}))
    with pytest.raises(RuntimeError, match="being closed"):
        fr.outer_state()
    job.run()
    assert fr.master is before  # readers see the old master until the job is back
    fr.end_close(job)
    assert not fr.busy and fr.master.tolist() == NEW_MASTER
    assert fr.outer_state()["master"].tolist() == NEW_MASTER


def test_loading_a_checkpoints_state_sets_the_optimizer_the_open_round_and_the_recent_rounds():
    fr, other = fragment(), fragment()
    state = other.outer.state_dict()
    state["master"] = torch.tensor(NEW_MASTER)
    recent = Defenses(RobustConfig(), CFG).recent({"weights": [[3.0]], "norms": [[1.0]]})
    fr.load(state, 5, recent)
    assert fr.master.tolist() == NEW_MASTER and fr.open.number == 5 and fr.recent is recent
    assert list(fr.recent.weights) == [[3.0]] and fr.recent.saved() == {"weights": [[3.0]], "norms": [[1.0]]}
    fr.take_out()
    with pytest.raises(RuntimeError, match="cannot load its state now"):
        fr.load(state, 6, recent)
    fr.release()
    assert not fr.busy
