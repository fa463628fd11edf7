"""The run's data ledger, kept by shard 0: the train split of the run's dataset cut into numbered pieces,
which worker holds which piece, which pieces are done in this epoch, and the epoch counter. It is how a
dataset is trained once per epoch, in order, by whoever is present: a worker asks for pieces (the Pieces
RPC), trains each to its end, reports it done; a worker that leaves gives its unfinished pieces back.

The rules, each checked by tests/test_ledger.py:
- a piece is held by at most one worker, and a piece done in this epoch is never leased again in it;
- a piece that is neither done nor held is free, and the lowest free piece is leased first (in order);
- when every piece is done the epoch ends: the counter goes up and every piece is free again;
- an ask is idempotent: a worker that asks again with the same report (a retried call) gets the same pieces,
  because what it holds is what it claims (`held`) and the lowest free pieces after that;
- a worker's pieces go back to the pool when it stops being a member (`release`, from the roster), when it
  does not claim them in an ask, and after a restart when it is not back within the grace (`expire`).

Pure: no gRPC, no I/O, no torch; the clock is passed in. `to_state`/`from_state` are what the shard's
checkpoint keeps (JSON data); `from_state` checks every field and the rules above, and refuses a state that
breaks one (ValueError, one line). What it must not do: know about sessions, tokens or files.
"""

from __future__ import annotations

import heapq
import math
import re
from dataclasses import dataclass, field

FORMAT = 1
MAX_HELD = 8  # pieces a worker may hold at once (the one it trains and those it asked for ahead)
MAX_REPORT = 64  # ids in one ask's `done` or `held` list
MAX_PIECES = 1 << 24  # pieces of one dataset (a ledger of 16M pieces is ~200 MB of JSON: not sensible)
ORPHAN_SECONDS = 300.0  # after a restart: how long a worker's pieces wait for it to come back and claim them
_SHA256 = re.compile(r"[0-9a-f]{64}")


class LedgerError(ValueError):
    """An ask the ledger refuses, nothing changed; `kind` says which status the servicer answers:
    "invalid" (a malformed request) or "mismatch" (another dataset than the run's)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Dataset:
    """The data a ledger cuts into pieces: its train tokens, tokens per piece, the sha256 that names it."""

    train_tokens: int
    piece_tokens: int
    sha256: str

    def __post_init__(self) -> None:
        if not 0 < self.piece_tokens <= 1 << 40:
            raise ValueError(f"piece_tokens must be positive, got {self.piece_tokens}")
        if not 0 < self.train_tokens <= 1 << 53:
            raise ValueError(f"the dataset's train split must have tokens, got {self.train_tokens}")
        if not _SHA256.fullmatch(self.sha256):
            raise ValueError(f"a dataset's sha256 is 64 lowercase hex digits, got {self.sha256[:80]!r}")
        if self.pieces > MAX_PIECES:
            raise ValueError(
                f"{self.train_tokens:,} tokens in pieces of {self.piece_tokens:,} make {self.pieces:,} "
                f"pieces, more than {MAX_PIECES:,}: raise --piece-tokens"
            )

    @property
    def pieces(self) -> int:
        return math.ceil(self.train_tokens / self.piece_tokens)

    def bounds(self, piece: int) -> tuple[int, int]:
        """(start, end) of the piece in the train split's tokens (the last piece may be shorter)."""
        start = piece * self.piece_tokens
        return start, min(self.train_tokens, start + self.piece_tokens)


@dataclass
class Grant:
    """An ask's answer: the pieces the worker holds now, in the order to train them ((id, start, end)),
    the epoch, pieces done in it of the total, the done reports refused (pieces it did not hold) and those
    counted before (a report sent again: after a lost reply, or by a worker resumed from its checkpoint)."""

    held: list[tuple[int, int, int]]
    epoch: int
    done: int
    total: int
    refused: list[int] = field(default_factory=list)
    repeated: list[int] = field(default_factory=list)


class Ledger:
    """Pieces, their holders and the epoch's done set (see the module's docstring)."""

    def __init__(self, piece_tokens: int, max_held: int = MAX_HELD, orphan_seconds: float = ORPHAN_SECONDS):
        if not 0 < piece_tokens <= 1 << 40:
            raise ValueError(f"--piece-tokens must be positive, got {piece_tokens}")
        if not 1 <= max_held <= MAX_HELD:
            raise ValueError(f"max_held must be in [1, {MAX_HELD}], got {max_held}")
        self.piece_tokens, self.max_held, self.orphan_seconds = piece_tokens, max_held, orphan_seconds
        self.dataset: Dataset | None = None  # bound by the first ask: the run's data from then on
        self.epoch = 0
        self.done: dict[int, str] = {}  # piece -> the worker that trained it, this epoch
        self.previous: dict[int, str] = {}  # the same for the epoch before (a retried report is acknowledged)
        self.held: dict[str, list[int]] = {}  # worker -> its pieces, in the order it trains them
        self.owner: dict[int, str] = {}  # piece -> the worker that holds it
        self.orphans: dict[str, float] = {}  # after a restart: workers not back yet, and until when
        self._next = 0  # pieces from here on have never been leased in this epoch
        self._returned: list[int] = []  # heap: pieces below _next given back, free again
        self.changes = 0  # counts changes: the shard saves the ledger when it moved

    # --- asks ----------------------------------------------------------------------------------------------
    def bind(self, dataset: Dataset) -> None:
        """Take `dataset` as the run's (the first ask), or check that it is the run's; LedgerError if not."""
        if dataset.piece_tokens != self.piece_tokens:
            raise LedgerError(
                "mismatch",
                f"the run's pieces are of {self.piece_tokens:,} tokens, not {dataset.piece_tokens:,}",
            )
        if self.dataset is None:
            self.dataset = dataset
            self.changes += 1
        elif (dataset.sha256, dataset.train_tokens) != (self.dataset.sha256, self.dataset.train_tokens):
            d = self.dataset
            raise LedgerError(
                "mismatch",
                f"this run trains data {d.sha256[:12]}... ({d.train_tokens:,} train tokens); the worker "
                f"has {dataset.sha256[:12]}... ({dataset.train_tokens:,}): give every worker the same data",
            )

    def ask(self, worker: str, done: list[int], held: list[int], want: int, now: float) -> Grant:
        """`worker` reports the pieces it trained to the end (`done`), claims those it still holds (`held`)
        and asks to hold up to `want` pieces after the call. Its pieces that it neither claims nor reports
        go back to the pool; a done report of a piece it does not hold is refused (Grant.refused), not
        applied. LedgerError, nothing changed, when the ask is malformed or no dataset is bound."""
        ds = self._checked(done, held, want)
        self.orphans.pop(worker, None)  # it is back: what it does not claim is given back now
        refused, repeated = [], []
        mine = self.held.get(worker, [])
        for p in done:
            if self.owner.get(p) == worker:
                self.done[p] = worker
                del self.owner[p]
                mine.remove(p)
            elif self.done.get(p) == worker or self.previous.get(p) == worker:
                repeated.append(p)  # counted already
            else:
                refused.append(p)  # not its piece (a lease it lost): not counted
        claimed = set(held)
        for p in [p for p in mine if p not in claimed]:
            self._free(p)
            mine.remove(p)
        if len(self.done) == ds.pieces:  # every piece is done: the next epoch
            self.epoch += 1
            self.previous, self.done = self.done, {}
            self._next, self._returned = 0, []
        while len(mine) < want and (new := self._take()) is not None:
            self.owner[new] = worker
            mine.append(new)
        if mine:
            self.held[worker] = mine
        else:
            self.held.pop(worker, None)
        self.changes += 1
        leased = [(q, *ds.bounds(q)) for q in mine]
        return Grant(leased, self.epoch, len(self.done), ds.pieces, refused, repeated)

    def _checked(self, done: list[int], held: list[int], want: int) -> Dataset:
        ds = self.dataset
        if ds is None:
            raise LedgerError("invalid", "no dataset is bound: the first ask names it")
        if not 0 <= want <= self.max_held:
            raise LedgerError("invalid", f"want must be in [0, {self.max_held}], got {want}")
        for name, ids in (("done", done), ("held", held)):
            if len(ids) > MAX_REPORT:
                raise LedgerError("invalid", f"{name} lists {len(ids)} pieces, at most {MAX_REPORT}")
            if len(set(ids)) != len(ids):
                raise LedgerError("invalid", f"{name} lists a piece twice")
            if (bad := next((p for p in ids if not 0 <= p < ds.pieces), None)) is not None:
                raise LedgerError(
                    "invalid", f"{name} lists piece {bad}, the data has pieces 0..{ds.pieces - 1}"
                )
        if set(done) & set(held):
            raise LedgerError("invalid", "a piece is listed both done and held")
        return ds

    def _take(self) -> int | None:
        """The lowest free piece, taken; None when every piece is done or held."""
        assert self.dataset is not None
        if self._returned:
            return heapq.heappop(self._returned)
        if self._next < self.dataset.pieces:
            self._next += 1
            return self._next - 1
        return None

    def _free(self, piece: int) -> None:
        del self.owner[piece]
        heapq.heappush(self._returned, piece)

    # --- members that go -----------------------------------------------------------------------------------
    def release(self, worker: str) -> list[int]:
        """The worker stopped being a member: its pieces go back to the pool (returned, lowest first)."""
        pieces = self.held.pop(worker, [])
        for p in pieces:
            self._free(p)
        self.orphans.pop(worker, None)
        if pieces:
            self.changes += 1
        return pieces

    def expire(self, now: float) -> list[str]:
        """Release the pieces of the workers that a restart found holding pieces and that did not come back
        to claim them in time; returns their names."""
        gone = sorted(w for w, until in self.orphans.items() if until <= now)
        for w in gone:
            self.release(w)
        return gone

    # --- what it says --------------------------------------------------------------------------------------
    def status(self) -> dict:
        """/api/status's "data": progress through the dataset."""
        ds = self.dataset
        return {
            "bound": ds is not None,
            "piece_tokens": self.piece_tokens,
            "train_tokens": ds.train_tokens if ds else 0,
            "sha256": ds.sha256 if ds else "",
            "pieces_total": ds.pieces if ds else 0,
            "pieces_done": len(self.done),
            "pieces_held": len(self.owner),
            "epoch": self.epoch,
            "held": {w: list(ps) for w, ps in sorted(self.held.items())},
            "waiting_for": sorted(self.orphans),
        }

    # --- checkpoint ----------------------------------------------------------------------------------------
    def to_state(self) -> dict:
        """What the shard's checkpoint keeps (JSON data)."""
        ds = self.dataset
        return {
            "format": FORMAT,
            "dataset": None
            if ds is None
            else {"train_tokens": ds.train_tokens, "piece_tokens": ds.piece_tokens, "sha256": ds.sha256},
            "epoch": self.epoch,
            "done": {str(p): w for p, w in sorted(self.done.items())},
            "previous": {str(p): w for p, w in sorted(self.previous.items())},
            "held": {w: list(ps) for w, ps in sorted(self.held.items())},
        }

    @classmethod
    def from_state(
        cls,
        state: object,
        piece_tokens: int,
        now: float,
        max_held: int = MAX_HELD,
        orphan_seconds: float = ORPHAN_SECONDS,
    ) -> Ledger:
        """A ledger as `to_state` saved it, each field checked; the workers that hold pieces get
        `orphan_seconds` from `now` to come back and claim them. ValueError (one line) when the state is
        malformed, of other pieces than `piece_tokens`, or breaks a rule (a piece held twice, or held and
        done)."""
        led = cls(piece_tokens, max_held, orphan_seconds)
        try:
            led._load(state)
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"the data ledger is malformed ({type(e).__name__}: {e})") from None
        led.orphans = dict.fromkeys(led.held, now + orphan_seconds)
        led.changes = 0
        return led

    def _load(self, state: object) -> None:
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise ValueError(f"the data ledger is not of format {FORMAT}")
        d = state["dataset"]
        if d is None:
            if state["done"] or state["held"] or state["previous"] or state["epoch"]:
                raise ValueError("the data ledger has pieces but no dataset")
            return
        if not isinstance(d, dict) or not all(
            isinstance(d[k], int) for k in ("train_tokens", "piece_tokens")
        ):
            raise ValueError("the data ledger's dataset is malformed")
        if d["piece_tokens"] != self.piece_tokens:
            raise ValueError(
                f"the data ledger cuts pieces of {d['piece_tokens']:,} tokens, this shard "
                f"{self.piece_tokens:,}: start it with the same --piece-tokens, or --fresh"
            )
        ds = self.dataset = Dataset(d["train_tokens"], d["piece_tokens"], str(d["sha256"]))
        epoch = state["epoch"]
        if not isinstance(epoch, int) or isinstance(epoch, bool) or not 0 <= epoch < 1 << 53:
            raise ValueError(f"the data ledger's epoch is {epoch!r}")
        self.epoch = epoch
        self.done, self.previous = (
            self._pieces_by_worker(state[k], ds.pieces, k) for k in ("done", "previous")
        )
        held = state["held"]
        if not isinstance(held, dict):
            raise ValueError("the data ledger's held is not a table")
        for w, ps in held.items():
            if (
                not isinstance(w, str)
                or not w
                or not isinstance(ps, list)
                or not 0 < len(ps) <= self.max_held
            ):
                raise ValueError(f"the data ledger's held pieces of {str(w)[:80]!r} are malformed")
            for p in ps:
                if not isinstance(p, int) or isinstance(p, bool) or not 0 <= p < ds.pieces:
                    raise ValueError(f"the data ledger's held pieces of {w!r} name piece {p!r}")
                if p in self.owner:
                    raise ValueError(
                        f"the data ledger has piece {p} held by both {self.owner[p]!r} and {w!r}"
                    )
                if p in self.done:
                    raise ValueError(f"the data ledger has piece {p} held by {w!r} and done")
                self.owner[p] = w
            self.held[w] = list(ps)
        if len(self.done) >= ds.pieces:
            raise ValueError("the data ledger has every piece done and its epoch not ended")
        taken = set(self.done) | set(self.owner)
        self._next = max(taken) + 1 if taken else 0
        self._returned = [p for p in range(self._next) if p not in taken]
        heapq.heapify(self._returned)

    @staticmethod
    def _pieces_by_worker(table: object, pieces: int, what: str) -> dict[int, str]:
        if not isinstance(table, dict):
            raise ValueError(f"the data ledger's {what} is not a table")
        out = {}
        for k, w in table.items():
            if (
                not (isinstance(k, str) and k.isdigit() and int(k) < pieces)
                or not isinstance(w, str)
                or not w
            ):
                raise ValueError(f"the data ledger's {what} has a malformed entry {str(k)[:20]!r}")
            out[int(k)] = w
        return out
