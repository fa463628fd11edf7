"""server/rounds/jobs.py in closed form: a round's records (OpenRound, its groups and its closing), the fp64
fold of pushes, the fold job ahead of the close and the close job (the weighted mean or the trimmed mean,
the outer step, the encoded update), on a slice of four values in fp32 (exact) with an outer step of
lr 1 and no momentum, so that the new master is the old one minus the round's mean.

Pushes: a = [1, 2, 3, 4] with weight 1, b = [3, 2, 1, 0] with weight 3: their weighted sum is
[10, 8, 6, 4], their mean [2.5, 2, 1.5, 1]; the master [1, 2, 3, 4] becomes [-1.5, 0, 1.5, 3].
"""

from __future__ import annotations

import math

import pytest
import torch

from streamdiloco.common.chunks import Assembly
from streamdiloco.common.codecs import decode, encode
from streamdiloco.common.outer import OuterOptimizer
from streamdiloco.server.rounds.jobs import (
    CloseJob,
    ClosingRound,
    FoldJob,
    OpenRound,
    Push,
    checked_history,
    fold,
    ordered,
)

MASTER = [1.0, 2.0, 3.0, 4.0]
A, B = [1.0, 2.0, 3.0, 4.0], [3.0, 2.0, 1.0, 0.0]
SUM = [10.0, 8.0, 6.0, 4.0]  # 1 * A + 3 * B
MEAN = [2.5, 2.0, 1.5, 1.0]
NEW_MASTER = [m - g for m, g in zip(MASTER, MEAN)]  # [-1.5, 0, 1.5, 3]


def push(worker: str, values: list[float], weight: float, loss: float | None = None) -> Push:
    asm = Assembly(len(values), "fp32", 128)
    asm.add(0, 0, len(values), encode(torch.tensor(values), "fp32", 128), True)
    return Push(worker, weight, asm, loss=loss)


def optimizer() -> OuterOptimizer:
    return OuterOptimizer(torch.tensor(MASTER), lr=1.0, momentum=0.0, downlink_codec="fp32", block_size=128)


def closing(pushes: list[Push], weight: float, partial=None, aggregator=("mean", 0.0, 1)) -> ClosingRound:
    names = tuple(sorted(p.worker for p in pushes))
    return ClosingRound(0, "all", pushes, partial, weight, names, 2.0, aggregator)


# --- the open round: pushes kept, grouped, closed ----------------------------------------------------------
def test_an_open_round_keeps_its_pushes_and_groups_them_in_the_order_of_the_workers_names():
    rnd = OpenRound(3)
    b, a = push("b", B, 3.0), push("a", A, 1.0)
    rnd.add(b, 16)
    rnd.add(a, 16)
    assert (rnd.contributors, rnd.weights, rnd.weight, rnd.kept_bytes) == ({"a", "b"}, [3.0, 1.0], 4.0, 32)
    assert [p.worker for p in rnd.group()] == ["a", "b"]
    assert (rnd.kept, rnd.kept_bytes) == ([], 0)
    c = push("c", A, 2.0)
    rnd.add(c, 16)
    rnd.settled, rnd.loss_sum, rnd.loss_weight = 6.0, 12.0, 6.0
    closing = rnd.closing("quorum", ("mean", 0.0, 1), {"weights": [1.0], "norms": []})
    assert [p.worker for p in closing.pushes] == ["a", "b", "c"]  # the groups first, then what was kept
    assert (closing.number, closing.why, closing.weight, closing.mean_loss) == (3, "quorum", 6.0, 2.0)
    assert closing.contributors == ("a", "b", "c")


def test_a_round_starts_with_its_first_whole_push_and_fixes_whom_it_expects():
    rnd = OpenRound(0)
    rnd.start(5.0, frozenset({"a", "b"}))
    assert (rnd.started_at, rnd.opened_at, rnd.expected) == (5.0, 5.0, frozenset({"a", "b"}))
    later = OpenRound(1, opened_at=2.0)
    later.start(7.0, frozenset({"a"}))
    assert (later.started_at, later.opened_at) == (7.0, 2.0)  # its deadlines count from its opening


def test_a_push_not_settled_counts_with_its_reported_weight():
    p = push("a", A, 3.0)
    assert (p.share, p.scale, p.mult) == (3.0, 1.0, 3.0)
    assert [q.worker for q in ordered([push("b", B, 1.0), p])] == ["a", "b"]


# --- the fold: an fp64 weighted sum ------------------------------------------------------------------------
def test_fold_is_the_weighted_sum_from_a_start_divided_once():
    pushes = [push("a", A, 1.0), push("b", B, 3.0)]
    out = torch.empty(4, dtype=torch.float64)
    fold(4, pushes, out, None)
    assert out.tolist() == SUM
    start = torch.ones(4, dtype=torch.float64)
    fold(4, pushes, out, start, divisor=2.0)
    assert out.tolist() == [(1 + s) / 2 for s in SUM]
    out32 = torch.empty(4)
    fold(4, pushes, out32, None, divisor=4.0)
    assert out32.tolist() == MEAN


def test_a_fold_job_adds_its_groups_into_the_rounds_partial_sum():
    job = FoldJob(0, 0, 4, [[push("a", A, 1.0)]], None).run()
    assert job.partial is not None and job.partial.dtype == torch.float64 and job.partial.tolist() == A
    again = FoldJob(0, 0, 4, [[push("b", B, 3.0)]], job.partial).run()
    assert again.partial is not None and again.partial.tolist() == SUM


# --- the close: the mean, the outer step, the update ------------------------------------------------------
def test_the_close_job_steps_the_master_by_the_weighted_mean_and_encodes_the_update():
    pushes = [push("a", A, 1.0), push("b", B, 3.0)]
    job = CloseJob(0, optimizer(), {"fragment": 0}, closing(pushes, 4.0))
    record = job.record()  # before run, which lets the pushes go
    assert [(p["worker"], p["weight"], p["mult"]) for p in record["pushes"]] == [
        ("a", 1.0, 1.0),
        ("b", 3.0, 3.0),
    ]
    assert (record["round"], record["weight"], record["contributors"]) == (0, 4.0, ["a", "b"])
    job.run()
    assert job.opt.master.tolist() == NEW_MASTER
    closed = job.closed()
    assert decode(closed.update).tolist() == [-g for g in MEAN]
    assert (closed.fragment, closed.round, closed.why, closed.weight, closed.mean_loss) == (
        0,
        0,
        "all",
        4.0,
        2.0,
    )
    assert closed.contributors == ("a", "b")
    state = job.fragment_state()
    assert state["fragment"] == 0 and state["outer"]["master"].tolist() == NEW_MASTER
    assert job.pushes == []  # their bytes are let go


def test_pushes_folded_ahead_of_the_close_give_the_same_step():
    ahead = torch.tensor(A, dtype=torch.float64)  # a's share, folded into the partial sum
    job = CloseJob(0, optimizer(), {}, closing([push("b", B, 3.0)], 4.0, partial=ahead)).run()
    assert job.opt.master.tolist() == NEW_MASTER


def test_the_trimmed_mean_takes_each_values_median_of_three():
    pushes = [push("a", A, 1.0), push("b", B, 1.0), push("c", [2.0, 9.0, -5.0, 1.0], 1.0)]
    job = CloseJob(0, optimizer(), {}, closing(pushes, 3.0, aggregator=("trimmed", 0.34, 1))).run()
    median = [2.0, 2.0, 1.0, 1.0]
    assert job.opt.master.tolist() == [m - g for m, g in zip(MASTER, median)]


def test_a_round_nobody_pushed_to_gives_a_zero_update_and_keeps_the_master():
    job = CloseJob(0, optimizer(), {}, closing([], 0.0)).run()
    closed = job.closed()
    assert decode(closed.update).tolist() == [0.0] * 4 and closed.mean_loss is None
    assert job.opt.master.tolist() == MASTER


def test_a_non_finite_sum_is_not_stepped_and_gives_a_zero_update():
    partial = torch.tensor([1.0, math.inf, 0.0, 0.0], dtype=torch.float64)
    job = CloseJob(0, optimizer(), {}, closing([], 1.0, partial=partial)).run()
    closed = job.closed()
    assert closed.why == "nonfinite" and decode(closed.update).tolist() == [0.0] * 4
    assert job.opt.master.tolist() == MASTER


def test_closed_before_run_is_a_mistake():
    job = CloseJob(0, optimizer(), {}, closing([], 0.0))
    with pytest.raises(AssertionError, match="has not run"):
        job.closed()


# --- checked_history: what a checkpoint keeps of the recent rounds -----------------------------------------
def test_checked_history_takes_finite_non_negative_numbers_and_refuses_the_rest():
    assert checked_history({"weights": [[1, 2.5]], "norms": [[]]}) == {"weights": [[1.0, 2.5]], "norms": [[]]}
    assert checked_history({"weights": [3], "norms": [0.5]}, rounds=False) == {
        "weights": [3.0],
        "norms": [0.5],
    }
    for bad in (
        None,
        {"weights": [[1.0]]},  # a key missing
        {"weights": [[1.0]], "norms": [[1.0]], "extra": []},
        {"weights": [[-1.0]], "norms": [[]]},
        {"weights": [[math.inf]], "norms": [[]]},
        {"weights": [[math.nan]], "norms": [[]]},
        {"weights": [[True]], "norms": [[]]},
        {"weights": [["1"]], "norms": [[]]},
        {"weights": [1.0], "norms": [[]]},  # a round's list where a list of rounds belongs
    ):
        assert checked_history(bad) is None, bad
