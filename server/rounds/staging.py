"""A shard's pushes while their chunks arrive: each push's own checks (fragment, round, worker, header), one
`common.chunks.Assembly` per push that validates its chunks the moment they arrive, and the pushes refused
before their last chunk (whose later chunks are dropped without a word). A refused push changes nothing.

Split from server/rounds/state.py (ShardState, which takes a push into its round once its last chunk is in) by
job. Pure: no networking, no clocks; what it must not do: touch a round (it only reads the open one).

What staging holds is bounded (`check_start`, asked before a push's first chunk is even decoded): a worker
stages one push at a time (a worker sends its pushes one after the other, so only a client that is not a
worker has two under way), and every staged push reserves its whole size (this shard's slice of its
fragment, in the uplink codec) from one budget over all sessions (`limit`, --max-staged-bytes): a push that
does not fit is refused before its first chunk is copied, and one that fits can always finish.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from streamdiloco.common.chunks import Assembly, ChunkError
from streamdiloco.common.codecs import Encoded, get_codec, sumsq
from streamdiloco.common.config import SyncConfig
from streamdiloco.server.rounds.defenses import Defenses
from streamdiloco.server.rounds.jobs import OpenRound, Staged
from streamdiloco.server.rounds.robust import MAX_LOSS, MIN_WEIGHT

# Bounds on what a push may carry, so that no accepted push can make the sum, the mean or the outer step
# overflow: values are bounded by the chunk assembler (MAX_ABS_VALUE); weights are token counts.
MAX_WEIGHT = float(2**53)


class PushRejected(ValueError):
    """A push that the shard refuses; nothing in the shard's state changed."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason  # short machine-readable cause: bad_fragment, late, duplicate, ...


class Fragment(Protocol):
    """What staging reads of a fragment (server/rounds/fragment.py's FragmentSlice): this shard's slice of it,
    and its open round."""

    @property
    def slice(self) -> tuple[int, int]: ...

    @property
    def open(self) -> OpenRound: ...


@dataclass(frozen=True)
class Chunk:
    """One chunk of a push, as ShardState.push_chunk takes it (`weight`, `loss`: the push's header, which
    its first chunk carries)."""

    worker: str
    fragment: int
    round: int
    seq: int
    offset: int
    total: int
    part: Encoded
    last: bool
    weight: float | None = None
    loss: float | None = None
    step_seconds: float | None = None  # the worker's reported seconds per inner step (header)
    stretch: float = 1.0  # how far its weight's bound stretches (server/rounds/defenses.py)


class Staging:
    """The pushes of one shard whose chunks are arriving, keyed by (worker, fragment); `fragments`: the
    shard's, whose open rounds it reads."""

    def __init__(self, shard: int, fragments: Sequence[Fragment], cfg: SyncConfig, limit: int | None = None):
        self.shard, self.fragments, self.cfg = shard, fragments, cfg
        self.ranges = [fr.slice for fr in fragments]  # this shard's slice of each fragment
        self.limit = limit  # bytes the staged pushes may reserve in all (None: no bound)
        self.staged: dict[tuple[str, int], Staged] = {}
        self.staged_bytes = 0  # reserved by the staged pushes: each its whole size (push_bytes)
        # (worker, fragment or -1) -> (fragment, round) of a push refused before its last chunk
        self.discarding: dict[tuple[str, int], tuple[int, int]] = {}
        self.pushes_refused: dict[str, int] = {}  # reason -> count

    def assembly(self, fragment: int) -> Assembly:
        """An empty assembly of a push to this shard's slice of the fragment."""
        lo, hi = self.ranges[fragment]
        return Assembly(
            hi - lo, self.cfg.uplink_codec, self.cfg.codec_block_size, where=f"slice {self.shard}"
        )

    def push_bytes(self, fragment: int) -> int:
        """Codec bytes (payload and scales) of a whole push to this shard's slice of the fragment."""
        lo, hi = self.ranges[fragment]
        return get_codec(self.cfg.uplink_codec).encoded_nbytes(hi - lo, self.cfg.codec_block_size)

    def check_start(self, worker: str, fragment: int, round: int, seq: int) -> str | None:
        """Why a chunk may not start a push here (None: it may be staged): asked before its bytes are copied.
        Only a push's first chunk can be turned away: a worker's second push while its first is arriving, or
        a push whose whole size does not fit in the budget; a push once staged can always finish."""
        if seq != 0 or not 0 <= fragment < len(self.ranges) or (worker, fragment) in self.staged:
            return None  # not a new push (or one that _check refuses for what it says)
        rnd = self.fragments[fragment].open
        if round != rnd.number or worker in rnd.contributors:
            return None  # late, ahead or a duplicate: _check says so, and stages nothing
        other = next((f for w, f in self.staged if w == worker), None)
        if other is not None:
            return (
                f"fragment {fragment}: {worker} has a push to fragment {other} still arriving; a worker "
                "sends one push at a time"
            )
        need = self.push_bytes(fragment)
        if self.limit is not None and self.staged_bytes + need > self.limit:
            return (
                f"fragment {fragment}: the shard's budget of {self.limit:,} bytes for pushes arriving "
                f"(--max-staged-bytes) holds {self.staged_bytes:,}, and this push needs {need:,}"
            )
        return None

    def chunk(self, defenses: Defenses, c: Chunk) -> Staged | None:
        """Take one chunk of a push. The push, once its last chunk is in (no longer
        staged); None: kept, waiting for more. Raises PushRejected, without changing anything but the
        refusal's count, when the chunk is bad; the push is then dropped."""
        key = (c.worker, c.fragment)
        st = self.staged.get(key)
        try:
            asm = self._check(c, st)
            asm.add(c.seq, c.offset, c.total, c.part, c.last)
        except ChunkError as e:
            self.drop(key, c.round, c.last, e.reason)
            raise PushRejected(
                e.reason, f"fragment {c.fragment} round {c.round} chunk {c.seq}: {e}"
            ) from None
        except PushRejected as e:
            self.drop(key, c.round, c.last, e.reason)
            raise
        self.discarding.pop(key, None)
        if st is None:
            assert c.weight is not None
            st = Staged(
                c.round, defenses.reported(c.weight, c.stretch), c.loss, asm, step_seconds=c.step_seconds
            )
            if not c.last:
                self.staged[key] = st
                self.staged_bytes += self.push_bytes(c.fragment)
        if defenses.measures_norms:
            st.sumsq += sumsq(
                c.part
            )  # the push's size, as it arrives (the chunk was checked: values bounded)
        if not c.last:
            return None
        self._unstage(key)
        return st

    def refuse(self, worker: str, fragment: int, round: int, seq: int, last: bool, reason: str) -> bool:
        """A chunk refused before `chunk` could see it: its push is dropped. False: the chunk belonged to a
        push that was already refused, so nothing more needs saying."""
        if self.swallow(worker, fragment, round, seq, last):
            return False
        self.drop((worker, fragment), round, last, reason)
        return True

    def forget_worker(self, worker: str) -> None:
        """The worker left: any push it had half-sent is dropped."""
        for key in [k for k in self.staged if k[0] == worker]:
            self._unstage(key)
        for key in [k for k in self.discarding if k[0] == worker]:
            del self.discarding[key]

    def forget_fragment(self, fragment: int) -> None:
        """The fragment's round closed: the pushes still arriving for it are dropped (they are `late`)."""
        for key in [k for k in self.staged if k[1] == fragment]:
            self._unstage(key)

    def _unstage(self, key: tuple[str, int]) -> None:
        if self.staged.pop(key, None) is not None:
            self.staged_bytes -= self.push_bytes(key[1])

    def arriving(self, fragment: int) -> bool:
        """Whether a push to the fragment has chunks in but not its last."""
        return any(k[1] == fragment for k in self.staged)

    def _discard_key(self, worker: str, fragment: int) -> tuple[str, int]:
        # every fragment id that does not exist shares one entry: at most P + 1 entries per worker
        return (worker, fragment if 0 <= fragment < len(self.ranges) else -1)

    def swallow(self, worker: str, fragment: int, round: int, seq: int, last: bool) -> bool:
        """True for a later chunk of a push already refused: it is dropped without a word."""
        dkey = self._discard_key(worker, fragment)
        if seq > 0 and self.discarding.get(dkey) == (fragment, round):
            if last:
                del self.discarding[dkey]
            return True
        return False

    def drop(self, key: tuple[str, int], round: int, last: bool, reason: str) -> None:
        self._unstage(key)
        if not last:  # the push's later chunks are dropped without a word
            self.discarding[self._discard_key(*key)] = (key[1], round)
        self.pushes_refused[reason] = self.pushes_refused.get(reason, 0) + 1

    def _check(self, c: Chunk, st: Staged | None) -> Assembly:
        """The push's own checks (fragment, round, worker, header); the assembly that checks the chunk."""

        def refuse(reason: str, message: str) -> PushRejected:
            return PushRejected(reason, f"fragment {c.fragment} round {c.round} chunk {c.seq}: {message}")

        if not 0 <= c.fragment < len(self.ranges):
            raise PushRejected(
                "bad_fragment",
                f"fragment {c.fragment} does not exist: this run has fragments 0..{len(self.ranges) - 1}",
            )
        rnd = self.fragments[c.fragment].open
        if c.round < rnd.number:
            raise refuse("late", f"the round is closed (open round is {rnd.number}): apply its update, go on")
        if c.round > rnd.number:
            raise refuse("bad_round", f"the round is ahead of the open round {rnd.number}")
        if c.worker in rnd.contributors:
            raise refuse("duplicate", f"{c.worker} already pushed this round")
        if st is not None:  # st.round == c.round: closing a round drops the pushes still arriving for it
            return st.asm
        if (
            c.seq == 0 and c.offset == 0
        ):  # a push's first chunk carries its header (else: refused as bad_chunk)
            if c.weight is None or not (MIN_WEIGHT <= c.weight <= MAX_WEIGHT):
                # below one token a push would count toward --min-workers while adding nothing
                raise refuse(
                    "bad_weight",
                    f"push weight must be a number of tokens, at least 1 and at most 2^53, got {c.weight}",
                )
            if c.loss is not None and not (0 <= c.loss <= MAX_LOSS):  # NaN fails both comparisons
                # a cross-entropy: never negative, and beyond 1e4 not a measurement (it is shown and averaged)
                raise refuse(
                    "bad_loss",
                    f"the reported training loss must be a cross-entropy in [0, {MAX_LOSS:g}], got {c.loss}",
                )
        return self.assembly(c.fragment)
