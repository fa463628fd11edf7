"""server/rounds/staging.py: a shard's pushes while their chunks arrive. Shard 0 of a run of two fragments
whose slices here hold four values each, in fp32 (16 bytes a push): which first chunks may start a push
(one push at a time per worker, a budget of bytes over all of them), the header's and the chunks' checks,
a refused push's later chunks dropped without a word, and what is reserved and let go.

The open rounds are the fragments' (`.slice`, `.open`: what Staging reads of server/rounds/fragment.py's
FragmentSlice), stood in for here by plain records so that the tests hold the rounds' numbers by hand.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from streamdiloco.common.codecs import encode
from streamdiloco.common.config import SyncConfig
from streamdiloco.server.rounds.defenses import Defenses
from streamdiloco.server.rounds.jobs import OpenRound
from streamdiloco.server.rounds.robust import RobustConfig
from streamdiloco.server.rounds.staging import Chunk, PushRejected, Staging

CFG = SyncConfig(sync_every=4, num_fragments=2, uplink_codec="fp32", downlink_codec="fp32")
VALUES = [1.0, 2.0, 3.0, 4.0]
PUSH_BYTES = 16  # four fp32 values


@dataclass
class Slot:
    """What Staging reads of a fragment: this shard's slice of it and its open round."""

    slice: tuple[int, int]
    open: OpenRound = field(default_factory=lambda: OpenRound(0))


def staging(limit: int | None = None) -> Staging:
    return Staging(0, [Slot((0, 4)), Slot((4, 8))], CFG, limit)


def chunks(
    worker: str, fragment: int = 0, round: int = 0, weight=10.0, loss=2.5, per: int = 2
) -> list[Chunk]:
    """A push of VALUES in chunks of `per` values (the header on the first)."""
    out = []
    for seq, lo in enumerate(range(0, 4, per)):
        part = encode(torch.tensor(VALUES[lo : lo + per]), "fp32", 128)
        header = dict(weight=weight, loss=loss) if seq == 0 else {}
        out.append(Chunk(worker, fragment, round, seq, lo, 4, part, lo + per >= 4, **header))
    return out


def refusal(st: Staging, c: Chunk, defenses: Defenses | None = None) -> PushRejected:
    with pytest.raises(PushRejected) as e:
        st.chunk(defenses or Defenses(RobustConfig(), CFG), c)
    return e.value


# --- a push, chunk by chunk --------------------------------------------------------------------------------
def test_a_push_is_staged_until_its_last_chunk_and_its_whole_size_is_reserved_meanwhile():
    st, d = staging(), Defenses(RobustConfig(), CFG)
    first, last = chunks("a")
    assert st.push_bytes(0) == PUSH_BYTES
    assert st.chunk(d, first) is None
    assert st.arriving(0) and not st.arriving(1) and st.staged_bytes == PUSH_BYTES
    staged = st.chunk(d, last)
    assert staged is not None and staged.asm.done and staged.asm.encoded().numel == 4
    assert (staged.round, staged.weight, staged.loss) == (0, 10.0, 2.5)
    assert staged.sumsq == sum(v * v for v in VALUES)  # measured as it arrived (clipping is on)
    assert st.staged_bytes == 0 and not st.arriving(0)


def test_a_push_in_one_chunk_is_never_staged_and_its_weight_is_cut_to_max_weight():
    st, d = staging(), Defenses(RobustConfig(max_weight=4.0, clip_norm=0.0), CFG)
    (whole,) = chunks("a", per=4)
    staged = st.chunk(d, whole)
    assert staged is not None and staged.weight == 4.0 and staged.sumsq == 0.0  # no clipping: not measured
    assert st.staged_bytes == 0 and st.staged == {}


# --- which first chunks may start a push ---------------------------------------------------------------
def test_a_worker_stages_one_push_at_a_time():
    st, d = staging(), Defenses(RobustConfig(), CFG)
    st.chunk(d, chunks("a", fragment=0)[0])
    assert st.check_start("a", 0, 0, 1) is None  # its push's next chunk
    why = st.check_start("a", 1, 0, 0)
    assert why == "fragment 1: a has a push to fragment 0 still arriving; a worker sends one push at a time"
    assert st.check_start("b", 1, 0, 0) is None


def test_the_budget_of_bytes_arriving_turns_away_a_push_that_does_not_fit():
    st, d = staging(limit=PUSH_BYTES + 8), Defenses(RobustConfig(), CFG)
    st.chunk(d, chunks("a")[0])
    why = st.check_start("b", 1, 0, 0)
    assert why == (
        "fragment 1: the shard's budget of 24 bytes for pushes arriving (--max-staged-bytes) holds 16, "
        "and this push needs 16"
    )
    st.forget_worker("a")  # its half-sent push goes, and its bytes with it
    assert st.staged_bytes == 0 and st.check_start("b", 1, 0, 0) is None


def test_what_the_round_will_refuse_is_not_turned_away_here():
    st = staging(limit=0)
    st.fragments[0].open.contributors.add("a")
    for worker, fragment, round in (("a", 0, 0), ("b", 0, 1), ("b", 0, -1), ("b", 7, 0)):
        assert st.check_start(worker, fragment, round, 0) is None  # duplicate, ahead, late, no such fragment


# --- refusals ---------------------------------------------------------------------------------------------
def test_the_header_and_the_round_are_checked_and_each_refusal_is_counted():
    st = staging()
    st.fragments[0].open = OpenRound(2, contributors={"dup"})
    cases = {
        "bad_fragment": chunks("a", fragment=5)[0],
        "late": chunks("a", round=1)[0],
        "bad_round": chunks("a", round=3)[0],
        "duplicate": chunks("dup", round=2)[0],
        "bad_weight": chunks("a", round=2, weight=0.5)[0],
        "bad_loss": chunks("a", round=2, loss=math.nan)[0],
    }
    for reason, c in cases.items():
        e = refusal(st, c)
        assert e.reason == reason, (reason, str(e))
    assert str(refusal(st, chunks("a", round=2, weight=None)[0])).endswith(
        "push weight must be a number of tokens, at least 1 and at most 2^53, got None"
    )
    assert "in [0, 10000], got -1.0" in str(refusal(st, chunks("a", round=2, loss=-1.0)[0]))
    assert st.pushes_refused == {
        "bad_fragment": 1,
        "late": 1,
        "bad_round": 1,
        "duplicate": 1,
        "bad_weight": 2,
        "bad_loss": 2,
    }
    assert st.staged == {} and st.staged_bytes == 0  # a refused push changes nothing else


def test_a_bad_chunk_drops_its_push_and_the_pushs_later_chunks_are_swallowed():
    st, d = staging(), Defenses(RobustConfig(), CFG)
    first, last = chunks("a")
    st.chunk(d, first)
    e = refusal(st, Chunk("a", 0, 0, 1, 3, 4, last.part, True))  # at offset 3, expected 2
    assert e.reason == "bad_offset" and str(e).startswith("fragment 0 round 0 chunk 1: ")
    assert st.staged_bytes == 0 and not st.arriving(0)
    assert st.swallow("a", 0, 0, 1, False) is False  # that was its last chunk: nothing more to swallow

    st.chunk(d, chunks("a", per=1)[0])  # sent again from the start, a value a chunk
    bad = Chunk("a", 0, 0, 1, 1, 4, encode(torch.tensor([1e31]), "fp32", 128), False)
    assert refusal(st, bad).reason == "bad_value"  # above MAX_ABS_VALUE
    assert st.swallow("a", 0, 0, 2, False)  # a later chunk of the refused push: dropped without a word
    assert st.refuse("a", 0, 0, 3, True, "whatever") is False  # its last: swallowed, and forgotten
    assert st.swallow("a", 0, 0, 4, True) is False
    assert st.pushes_refused == {"bad_offset": 1, "bad_value": 1}


def test_a_chunk_refused_before_staging_saw_it_drops_its_push():
    st, d = staging(), Defenses(RobustConfig(), CFG)
    st.chunk(d, chunks("a")[0])
    assert st.refuse("a", 0, 0, 1, False, "too_big") is True
    assert st.pushes_refused == {"too_big": 1} and st.staged_bytes == 0
    assert st.swallow("a", 0, 0, 2, True)  # the rest of that push


def test_chunks_for_fragments_that_do_not_exist_share_one_entry_per_worker():
    st = staging()
    for fragment in (5, 6, -3):
        refusal(st, Chunk("a", fragment, 0, 0, 0, 4, encode(torch.tensor(VALUES[:2]), "fp32", 128), False))
    assert list(st.discarding) == [("a", -1)]


# --- letting go --------------------------------------------------------------------------------------------
def test_a_closing_round_and_a_leaving_worker_drop_what_they_had_arriving():
    st, d = staging(), Defenses(RobustConfig(), CFG)
    st.chunk(d, chunks("a", fragment=0)[0])
    st.chunk(d, chunks("b", fragment=1)[0])
    assert st.staged_bytes == 2 * PUSH_BYTES
    st.forget_fragment(0)
    assert list(st.staged) == [("b", 1)] and st.staged_bytes == PUSH_BYTES
    st.refuse("b", 1, 0, 1, False, "bad_chunk")
    st.forget_worker("b")
    assert st.staged == {} and st.discarding == {} and st.staged_bytes == 0
