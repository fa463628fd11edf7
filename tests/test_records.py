"""server/rounds/records.py: what a shard's checkpoint keeps of a fragment and of the rounds logged after it,
and the checks of what it reads back. A fragment's record (with its outer optimizer's state) and a round's
log (CloseJob.record) come back as they went in; every way a damaged or foreign one can be wrong is a
ValueError that names the fragment and what is wrong; a log written before the defenses (no shares, scales,
aggregator or history) still reads. The slice: four values in fp32, shard 0's [0, 4).

Writing and reading the files is server/storage/checkpoint.py's (tests/test_elastic_units.py,
tests/test_checkpoint_checks.py).
"""

from __future__ import annotations

import pytest
import torch

from streamdiloco.common.chunks import Assembly
from streamdiloco.common.codecs import encode
from streamdiloco.common.outer import OuterOptimizer
from streamdiloco.server.rounds.jobs import CloseJob, ClosingRound, Push
from streamdiloco.server.rounds.records import checked_fragment, checked_round, fragment_record

SLICE = (0, 4)
HISTORY = {"weights": [[1.0, 2.0]], "norms": [[0.5]]}


def optimizer(momentum: float = 0.9) -> OuterOptimizer:
    opt = OuterOptimizer(torch.tensor([1.0, 2.0, 3.0, 4.0]), lr=1.0, momentum=momentum, downlink_codec="fp32")
    opt.step(torch.tensor([0.5, 0.5, 0.5, 0.5]))  # momentum: sgd's state holds a buffer
    return opt


def saved(**changes) -> dict:
    record = fragment_record(2, SLICE, 7, ["a", "b"], HISTORY)
    return {**record, "outer": optimizer().state_dict(), **changes}


def assembly() -> Assembly:
    return Assembly(4, "fp32", 128)


def push(worker: str, values: list[float], weight: float) -> Push:
    asm = assembly()
    asm.add(0, 0, 4, encode(torch.tensor(values[:2]), "fp32", 128), False)
    asm.add(1, 2, 4, encode(torch.tensor(values[2:]), "fp32", 128), True)
    return Push(worker, weight, asm)


def close_job(number: int = 3) -> CloseJob:
    """Round `number`'s close: a and b, weights 1 and 3, each in two chunks, on a master of
    [0.5, 1.5, 2.5, 3.5] with lr 1 and no momentum."""
    pushes = [push("a", [1.0, 2.0, 3.0, 4.0], 1.0), push("b", [3.0, 2.0, 1.0, 0.0], 3.0)]
    closing = ClosingRound(
        number, "all", pushes, None, 4.0, ("a", "b"), 2.0, history={"weights": [1.0], "norms": []}
    )
    return CloseJob(2, optimizer(0.0), {}, closing)


def logged() -> dict:
    """The close's log, as CloseJob.record writes it."""
    return close_job().record()


# --- a fragment's state ------------------------------------------------------------------------------------
def test_a_fragments_record_reads_back_as_it_was_written():
    outer, rnd, members, history = checked_fragment(2, saved(), SLICE)
    assert (rnd, members, history) == (7, ["a", "b"], HISTORY)
    assert torch.equal(outer["master"], optimizer().master)
    fresh = OuterOptimizer(torch.zeros(4), lr=1.0, momentum=0.9, downlink_codec="fp32")
    fresh.load_state_dict(outer)
    assert torch.equal(fresh.master, optimizer().master)


def test_a_record_without_members_or_history_reads_as_none_of_either():
    old = saved()
    del old["members"], old["history"]
    _, _, members, history = checked_fragment(2, old, SLICE)
    assert (members, history) == ([], {"weights": [], "norms": []})


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda s: [s], "checkpoint of fragment 2 is not a fragment's state"),
        (lambda s: {**s, "outer": None}, "is not a fragment's state"),
        (
            lambda s: {**s, "fragment": 1},
            "checkpoint of fragment 1 slice [0, 4] does not fit fragment 2 slice",
        ),
        (lambda s: {**s, "slice": [0, 5]}, "slice [0, 5] does not fit fragment 2 slice [0, 4]"),
        (lambda s: {k: v for k, v in s.items() if k != "round"}, "is incomplete (KeyError: 'round')"),
        (lambda s: {**s, "outer": {"master": s["outer"]["master"]}}, "is incomplete (KeyError: 'residual')"),
        (
            lambda s: {**s, "outer": {**s["outer"], "master": torch.zeros(3)}},
            "holds a master of (3,), want (4,)",
        ),
        (
            lambda s: {**s, "outer": {**s["outer"], "residual": torch.zeros(4, dtype=torch.float64)}},
            "holds a residual of (4,)",
        ),
        (lambda s: {**s, "outer": {**s["outer"], "master": [1.0] * 4}}, "holds a master of list"),
        (lambda s: {**s, "round": -1}, "has round -1"),
        (lambda s: {**s, "members": ["a", 3]}, "has a malformed member list"),
        (
            lambda s: {**s, "history": {"weights": [[-1.0]], "norms": []}},
            "malformed history of weights, norms",
        ),
    ],
)
def test_a_damaged_or_foreign_fragment_record_is_refused_with_what_is_wrong(damage, message):
    with pytest.raises(ValueError, match="^checkpoint of fragment") as e:
        checked_fragment(2, damage(saved()), SLICE)
    assert message in str(e.value)


def test_a_momentum_buffer_of_another_length_is_refused():
    bad = saved()
    state = bad["outer"]["sgd"]["state"]
    state[next(iter(state))]["momentum_buffer"] = torch.zeros(5)
    with pytest.raises(ValueError, match=r"holds a momentum of \(5,\), want \(4,\)"):
        checked_fragment(2, bad, SLICE)


# --- a round's log ---------------------------------------------------------------------------------------
def test_a_rounds_log_reads_back_into_the_round_it_closed_and_replays_to_the_same_step():
    record = logged()
    closing = checked_round(record, 2, 3, 4, assembly)
    assert (closing.number, closing.why, closing.weight, closing.contributors) == (3, "all", 4.0, ("a", "b"))
    assert (closing.mean_loss, closing.aggregator, closing.history) == (
        2.0,
        ("mean", 0.0, 1),
        {"weights": [1.0], "norms": []},
    )
    assert [(p.worker, p.weight, p.share, p.scale, p.mult) for p in closing.pushes] == [
        ("a", 1.0, 1.0, 1.0, 1.0),
        ("b", 3.0, 3.0, 1.0, 3.0),
    ]
    assert [len(p.asm.parts) for p in closing.pushes] == [2, 2]  # assembled again chunk by chunk
    replay = CloseJob(2, optimizer(0.0), {}, closing).run()
    first = close_job().run()
    assert torch.equal(replay.opt.master, first.opt.master)
    assert torch.equal(replay.closed().update.payload, first.closed().update.payload)
    assert replay.opt.master.tolist() == [0.5 - 2.5, 1.5 - 2.0, 2.5 - 1.5, 3.5 - 1.0]  # minus the mean


def test_a_log_written_before_the_defenses_counts_each_push_as_reported():
    record = logged()
    for p in record["pushes"]:
        del p["share"], p["scale"], p["mult"]
    del record["aggregator"], record["history"]
    closing = checked_round(record, 2, 3, 4, assembly)
    assert [(p.share, p.scale, p.mult) for p in closing.pushes] == [(1.0, 1.0, 1.0), (3.0, 1.0, 3.0)]
    assert (closing.aggregator, closing.history) == (("mean", 0.0, 1), {"weights": [], "norms": []})


def _first_push(record: dict, **changes) -> dict:
    record["pushes"][0].update(changes)
    return record


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda r: {**r, "round": 2}, "it is of round 2, the open round is 3"),
        (lambda r: _first_push(r, parts=[]), "the push of a is incomplete"),
        (lambda r: _first_push(r, weight=0.0), "a push's weight is 0.0"),
        (lambda r: _first_push(r, share=2.0), "a push's share 2.0, scale 1.0 or mult 1.0 is out of range"),
        (lambda r: _first_push(r, scale=1.5), "scale 1.5"),
        (lambda r: {**r, "partial": torch.zeros(4)}, "its partial sum is not an fp64 tensor"),
        (lambda r: {**r, "history": {"weights": [-1.0], "norms": []}}, "its weights and norms are malformed"),
        (lambda r: {**r, "aggregator": ["median", 0.0, 1]}, "unknown --aggregator 'median'"),
        (lambda r: {k: v for k, v in r.items() if k != "weight"}, "KeyError: 'weight'"),
        (lambda r: _first_push(r, parts=[{**r["pushes"][0]["parts"][0], "codec": "int8"}]), "ChunkError"),
    ],
)
def test_a_damaged_rounds_log_is_refused_with_what_is_wrong(damage, message):
    with pytest.raises(ValueError, match=r"^the log of fragment 2 round 3 is damaged \(") as e:
        checked_round(damage(logged()), 2, 3, 4, assembly)
    assert message in str(e.value)


def test_a_record_that_is_not_a_dict_says_what_it_is():
    with pytest.raises(ValueError, match="^it is a list, not a round's record$"):
        checked_round([], 2, 3, 4, assembly)
