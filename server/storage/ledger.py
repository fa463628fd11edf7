"""The run's data ledger, kept by shard 0: the train split of the run's dataset cut into numbered pieces,
which worker holds which piece, which pieces are done in this epoch, and the epoch counter. It is how a
dataset is trained once per epoch, in order, by whoever is present: a worker asks for pieces (the Pieces
RPC), trains each to its end, reports it done; a worker that leaves gives its unfinished pieces back.

The rules, each checked by tests/test_ledger.py:
- a piece is held by at most one worker, and a piece done in this epoch is never leased again in it;
- a piece that is neither done nor held is free, and the lowest free piece is leased first (in order);
- when every piece is done the epoch ends: the counter goes up and every piece is free again;
- an ask is idempotent: a worker that asks again with the same report (a retried call) gets the same pieces,
  because what it holds is what it claims (`held`) and the lowest free pieces after that; an ask that
  changes nothing counts no change (`changes`: the shard writes the ledger only when it moved);
- a worker's pieces go back to the pool when it stops being a member (`release`, from the roster), when it
  does not claim them in an ask, and after a restart when it is not back within the grace (`expire`).

What a worker says is checked against what the shard knows of it (its `Standing`: accepted pushes, the
tokens they stand for, a piece's time at its own speed), the trust rules of tests/test_trust_ledger.py:
- binding: the operator may pin the dataset (`pinned`: its sha256, its size or both); else the first ask
  binds it only provisionally, and until a worker with an accepted push confirms a dataset by asking for it,
  a later ask that names another takes the binding over (the provisional leases are dropped): an ask without
  a push never binds the data for good, and never locks the honest workers out before their first push. A
  confirmed dataset is the run's, and data that does not fit a pin is refused;
- a done report is counted only while the worker's counted tokens stay within COVER times the tokens its
  accepted pushes stand for (the credits'); a report beyond that is deferred: the piece stays the worker's,
  trained, and is counted when its pushes cover it (at its next ask or the next tick), or goes back to the
  pool when its lease lapses. A report sooner after the lease than 1/FAST of a piece's time at the worker's
  own speed is refused (the piece goes back, barred to that worker for a piece's time);
- a lease lapses `lease_of(worker)` seconds after it was given (or reported, for a deferred piece); the
  piece goes back and is barred to that worker for as long (so that an idle holder cannot take it again);
- a worker without an accepted push owns at most `max_held` pieces (held and deferred); one with pushes at
  most MAX_DEFERRED more.

The done set of an epoch is a bitmap (server/storage/pieceset.py); who did how many pieces is counted per
worker. Pure: no gRPC, no I/O, no torch; the clock is passed in. `snapshot` is what the shard's checkpoint
keeps (server/storage/ledgerstate.py writes and reads it, and checks every field). What it must not do: know
about sessions, tokens or files.
"""

from __future__ import annotations

import heapq
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from streamdiloco.server.storage.pieceset import PieceSet

MAX_HELD = 8  # pieces a worker may hold at once (the one it trains and those it asked for ahead)
MAX_REPORT = 64  # ids in one ask's `done` or `held` list
MAX_DEFERRED = MAX_REPORT  # trained pieces a worker with pushes may own beyond MAX_HELD, awaiting its pushes
MAX_PIECES = 1 << 24  # pieces of one dataset (the done set is a bitmap of 2 MiB at this bound)
ORPHAN_SECONDS = 300.0  # after a restart: how long a worker's pieces wait for it to come back and claim them
COVER = 2.0  # done tokens per credited token: a piece's tokens exceed what trains in it by up to a window
FAST = 8.0  # a report sooner than 1/FAST of a piece's expected time after its lease is refused
RECENT = MAX_REPORT  # the pieces counted for a worker that a retried report is acknowledged for
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

    def named(self) -> str:
        return f"{self.sha256[:12]}... ({self.train_tokens:,} train tokens)"


@dataclass(frozen=True)
class Pin:
    """The run's data as the operator pinned it on shard 0 (--data-sha256, --data-tokens), either or both
    ("" and 0: that part is not pinned); an ask naming data that does not fit is refused."""

    sha256: str = ""
    train_tokens: int = 0

    def fits(self, ds: Dataset) -> bool:
        return (not self.sha256 or ds.sha256 == self.sha256) and (
            not self.train_tokens or ds.train_tokens == self.train_tokens
        )

    def whole(self, piece_tokens: int) -> Dataset | None:
        """The dataset, when both parts are pinned (ValueError, one line, if it is not one)."""
        if not (self.sha256 and self.train_tokens):
            return None
        return Dataset(self.train_tokens, piece_tokens, self.sha256)

    def named(self) -> str:
        sha = f"{self.sha256[:12]}..." if self.sha256 else "any sha256"
        tokens = f"{self.train_tokens:,} train tokens" if self.train_tokens else "any size"
        return f"{sha} ({tokens})"


@dataclass(frozen=True)
class Standing:
    """What the shard knows of a worker that asks (server/edge/pieces.py makes it from the credits and its
    reports): its accepted pushes, the tokens they stand for (what its done pieces may add up to, over
    COVER), and a piece's time at its own speed (0: not known yet)."""

    pushes: int = 0
    credited: float = 0.0
    piece_seconds: float = 0.0


TRUSTED = Standing(pushes=1, credited=math.inf)  # no trust rule holds it back (pure tests, benchmarks)


@dataclass
class Grant:
    """An ask's answer: the pieces the worker holds now, in the order to train them ((id, start, end)),
    the epoch, pieces done in it of the total, the done reports refused (pieces it did not hold, or reported
    faster than they train) and those counted before (a report sent again: after a lost reply, or by a
    worker resumed from its checkpoint); `binding`: what the ask did to the binding ("bound", "confirmed",
    "moved": it took a provisional binding over; None: nothing)."""

    held: list[tuple[int, int, int]]
    epoch: int
    done: int
    total: int
    refused: list[int] = field(default_factory=list)
    repeated: list[int] = field(default_factory=list)
    binding: str | None = None


@dataclass
class Epoch:
    """One pass over the data: its number, its done pieces, and how many each worker did."""

    number: int
    done: PieceSet
    by: dict[str, int] = field(default_factory=dict)


@dataclass
class Tick:
    """What a tick did: workers a restart waited for in vain, lapsed leases by worker, pieces counted."""

    gone: list[str]
    lapsed: dict[str, list[int]]
    counted: int


class Leases:
    """Who owns which piece: the pieces each worker holds to train (`held`, in order) and those it reported
    trained that wait for its pushes (`deferred`), and since when each lease runs."""

    def __init__(self) -> None:
        self.held: dict[str, list[int]] = {}
        self.deferred: dict[str, list[int]] = {}
        self.owner: dict[int, str] = {}
        self.since: dict[int, float] = {}  # when the lease began (or the report came, for a deferred one)

    def owned(self, worker: str) -> int:
        return len(self.held.get(worker, ())) + len(self.deferred.get(worker, ()))

    def give(self, worker: str, piece: int, now: float) -> None:
        self.owner[piece] = worker
        self.since[piece] = now
        self.held.setdefault(worker, []).append(piece)

    def defer(self, worker: str, piece: int, now: float) -> None:
        self._remove(self.held, worker, piece)
        self.deferred.setdefault(worker, []).append(piece)
        self.since[piece] = now

    def drop(self, piece: int) -> str:
        """The piece is nobody's any more; returns whose it was."""
        worker = self.owner.pop(piece)
        del self.since[piece]
        table = self.deferred if piece in self.deferred.get(worker, ()) else self.held
        self._remove(table, worker, piece)
        return worker

    @staticmethod
    def _remove(table: dict[str, list[int]], worker: str, piece: int) -> None:
        pieces = table[worker]
        pieces.remove(piece)
        if not pieces:
            del table[worker]


class Ledger:
    """Pieces, their holders and the epoch's done set (see the module's docstring). `pinned`: the data the
    operator pinned (--data-sha256, --data-tokens; a Dataset: both): data that does not fit is refused, and
    a whole pin is the run's from the start."""

    def __init__(
        self,
        piece_tokens: int,
        max_held: int = MAX_HELD,
        orphan_seconds: float = ORPHAN_SECONDS,
        pinned: Pin | Dataset | None = None,
    ):
        if not 0 < piece_tokens <= 1 << 40:
            raise ValueError(f"--piece-tokens must be positive, got {piece_tokens}")
        if not 1 <= max_held <= MAX_HELD:
            raise ValueError(f"max_held must be in [1, {MAX_HELD}], got {max_held}")
        self.piece_tokens, self.max_held, self.orphan_seconds = piece_tokens, max_held, orphan_seconds
        self.dataset: Dataset | None = None
        self.confirmed = False  # by a worker with an accepted push, or pinned: the run's data for good
        self.pin = Pin(pinned.sha256, pinned.train_tokens) if isinstance(pinned, Dataset) else pinned
        self.current = Epoch(0, PieceSet(0))
        self.previous_by: dict[str, int] = {}  # pieces each worker did in the epoch before
        self.leases = Leases()
        self.counted: dict[str, int] = {}  # worker -> tokens of its done pieces counted, over the run
        self.recent: dict[str, tuple[tuple[int, int], ...]] = {}  # worker -> its last (epoch, piece) counted
        self.orphans: dict[str, float] = {}  # after a restart: workers not back yet, and until when
        self.barred: dict[str, dict[int, float]] = {}  # worker -> pieces it let lapse, until when
        self.loaded_at = -math.inf  # leases restored from a checkpoint run from here
        self._cursor = 0  # pieces below it that are free are in _returned
        self._returned: list[int] = []  # heap: pieces below _cursor given back, free again (some stale)
        self.changes = 0  # counts changes of what the checkpoint keeps: the shard writes it when it moved
        if self.pin is not None and (whole := self.pin.whole(piece_tokens)) is not None:
            self.bind(whole)
            self.confirmed = True

    @property
    def pinned(self) -> bool:
        return self.pin is not None

    # --- views ---------------------------------------------------------------------------------------------
    epoch = property(lambda self: self.current.number)
    done = property(lambda self: self.current.done)
    held = property(lambda self: self.leases.held)
    owner = property(lambda self: self.leases.owner)

    # --- the binding ---------------------------------------------------------------------------------------
    def bind(self, dataset: Dataset, standing: Standing = TRUSTED) -> str | None:
        """Take `dataset` as the run's, or check it against the run's (see the module's docstring); returns
        what changed ("bound", "confirmed", "moved", None); LedgerError "mismatch", nothing changed, when the
        run's data is confirmed (or pinned) and is another."""
        if dataset.piece_tokens != self.piece_tokens:
            raise LedgerError(
                "mismatch",
                f"the run's pieces are of {self.piece_tokens:,} tokens, not {dataset.piece_tokens:,}",
            )
        if self.pin is not None and not self.pin.fits(dataset):
            raise LedgerError(
                "mismatch",
                f"this run's data is pinned by the operator to {self.pin.named()}; the worker has "
                f"{dataset.named()}: give every worker the same data",
            )
        pushed, ds = standing.pushes > 0, self.dataset
        if ds is not None and (dataset.sha256, dataset.train_tokens) == (ds.sha256, ds.train_tokens):
            if self.confirmed or not pushed:
                return None
            self.confirmed = True
            self.changes += 1
            return "confirmed"
        if ds is not None and self.confirmed:
            raise LedgerError(
                "mismatch",
                f"this run trains data {ds.named()}, confirmed by a worker's accepted push; the worker has "
                f"{dataset.named()}: give every worker the same data",
            )
        moved = ds is not None
        self.dataset, self.confirmed = dataset, pushed
        self.current, self.previous_by = Epoch(0, PieceSet(dataset.pieces)), {}
        self.leases, self.orphans, self.barred = Leases(), {}, {}
        self._cursor, self._returned = 0, []
        self.changes += 1
        return "moved" if moved else "bound"

    # --- asks ----------------------------------------------------------------------------------------------
    def ask(
        self,
        worker: str,
        done: list[int],
        held: list[int],
        want: int,
        now: float,
        standing: Standing = TRUSTED,
        dataset: Dataset | None = None,
    ) -> Grant:
        """`worker` (named `dataset`, if given: bound or checked first) reports the pieces it trained to the
        end (`done`), claims those it still holds (`held`) and asks to hold up to `want` pieces after the
        call. Its pieces that it neither claims nor reports go back to the pool; a done report of a piece it
        does not hold is refused (Grant.refused), not applied. LedgerError, nothing changed, when the ask is
        malformed, names another dataset than the run's confirmed one, or no dataset is bound.
        `standing`: what the shard knows of the worker (TRUSTED: for a caller that checks nothing)."""
        ds = self._checked(dataset or self.dataset, done, held, want)
        binding = self.bind(ds, standing) if dataset is not None else None
        self.orphans.pop(worker, None)  # it is back: what it does not claim is given back now
        refused, repeated = self._reports(worker, done, now, standing)
        claimed = set(held)
        for p in [p for p in self.leases.held.get(worker, []) if p not in claimed]:
            self._free(p)
        self._count_covered(worker, standing)
        cap = self.max_held + (MAX_DEFERRED if standing.pushes > 0 else 0)
        mine = self.leases.held.get(worker, [])
        while len(mine) < want and self.leases.owned(worker) < cap:
            if (new := self._take(worker)) is None:
                break
            self.leases.give(worker, new, now)
            self.changes += 1
            mine = self.leases.held[worker]
        leased = [(q, *ds.bounds(q)) for q in mine]
        cur = self.current
        return Grant(leased, cur.number, len(cur.done), ds.pieces, refused, repeated, binding)

    def _reports(self, worker: str, done: list[int], now: float, standing: Standing) -> tuple[list, list]:
        """Apply the done reports: deferred until counted (`_count_covered`), or refused, or acknowledged
        as counted before."""
        refused, repeated = [], []
        recent = {p for e, p in self.recent.get(worker, ()) if e >= self.current.number - 1}
        leases = self.leases
        for p in done:
            if leases.owner.get(p) == worker:
                if p in leases.deferred.get(worker, ()):
                    continue  # reported before: it waits for the worker's pushes
                started = max(leases.since[p], self.loaded_at)
                if standing.piece_seconds > 0 and now - started < standing.piece_seconds / FAST:
                    self._free(p)  # faster than it trains: not counted, and not the worker's any more
                    self.barred.setdefault(worker, {})[p] = now + standing.piece_seconds
                    refused.append(p)
                    continue
                leases.defer(worker, p, now)
                self.changes += 1
            elif p in recent:
                repeated.append(p)  # counted already
            else:
                refused.append(p)  # not its piece (a lease it lost): not counted
        return refused, repeated

    def _count_covered(self, worker: str, standing: Standing) -> int:
        """Count the worker's deferred pieces, oldest first, while its pushes cover them."""
        ds, waiting, n = self.dataset, self.leases.deferred.get(worker), 0
        assert ds is not None
        while waiting:
            p = waiting[0]
            start, end = ds.bounds(p)
            if self.counted.get(worker, 0) + (end - start) > COVER * standing.credited:
                break
            self.leases.drop(p)
            self.current.done.add(p)
            self.current.by[worker] = self.current.by.get(worker, 0) + 1
            self.counted[worker] = self.counted.get(worker, 0) + end - start
            self.recent[worker] = (*self.recent.get(worker, ())[-(RECENT - 1) :], (self.current.number, p))
            self.changes += 1
            n += 1
            waiting = self.leases.deferred.get(worker)
        if n and len(self.current.done) == ds.pieces:  # every piece is done: the next epoch
            self.previous_by = self.current.by
            self.current = Epoch(self.current.number + 1, PieceSet(ds.pieces))
            self._cursor, self._returned, self.barred = 0, [], {}
        return n

    def _checked(self, ds: Dataset | None, done: list[int], held: list[int], want: int) -> Dataset:
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

    def _take(self, worker: str) -> int | None:
        """The lowest free piece that is not barred to `worker`, or None."""
        bars, skipped, found = self.barred.get(worker, {}), [], None
        owner, done = self.leases.owner, self.current.done
        while self._returned and found is None:
            p = heapq.heappop(self._returned)
            if p in owner or p in done:
                continue  # stale
            if p in bars:
                skipped.append(p)
            else:
                found = p
        while found is None and (q := done.first_missing(self._cursor)) is not None:
            self._cursor = q + 1
            if q in bars:
                skipped.append(q)
            elif q not in owner:
                found = q
        for p in skipped:
            heapq.heappush(self._returned, p)
        return found

    def _free(self, piece: int) -> None:
        self.leases.drop(piece)
        heapq.heappush(self._returned, piece)
        self.changes += 1

    # --- members that go, leases that lapse ----------------------------------------------------------------
    def release(self, worker: str) -> list[int]:
        """The worker stopped being a member: the pieces it holds go back to the pool (returned, lowest
        first); those it reported trained stay its own until its pushes count them or they lapse."""
        pieces = list(self.leases.held.get(worker, []))
        for p in pieces:
            self._free(p)
        self.orphans.pop(worker, None)
        return pieces

    def expire(self, now: float) -> list[str]:
        """Release the pieces of the workers that a restart found holding pieces and that did not come back
        to claim them in time; returns their names."""
        gone = sorted(w for w, until in self.orphans.items() if until <= now)
        for w in gone:
            self.release(w)
        return gone

    def tick(
        self, now: float, standing_of: Callable[[str], Standing], lease_of: Callable[[str], float]
    ) -> Tick:
        """Each second: workers a restart waited for in vain give their pieces back (`expire`), leases older
        than `lease_of(worker)` seconds lapse (the piece is barred to that worker as long), and deferred
        pieces that the workers' pushes now cover are counted."""
        gone = self.expire(now)
        lapsed: dict[str, list[int]] = {}
        for worker in sorted(set(self.leases.owner.values())):
            lease = lease_of(worker)
            mine = self.leases.held.get(worker, []) + self.leases.deferred.get(worker, [])
            for p in [p for p in mine if now - max(self.leases.since[p], self.loaded_at) > lease]:
                self._free(p)
                self.barred.setdefault(worker, {})[p] = now + lease
                lapsed.setdefault(worker, []).append(p)
        for worker, bars in list(self.barred.items()):
            for p in [p for p, until in bars.items() if until <= now]:
                del bars[p]
            if not bars:
                del self.barred[worker]
        counted = sum(self._count_covered(w, standing_of(w)) for w in list(self.leases.deferred))
        return Tick(gone, lapsed, counted)

    # --- what it says --------------------------------------------------------------------------------------
    def status(self) -> dict:
        """/api/status's "data": progress through the dataset."""
        ds = self.dataset
        return {
            "bound": ds is not None,
            "confirmed": self.confirmed,
            "pinned": self.pinned,
            "piece_tokens": self.piece_tokens,
            "train_tokens": ds.train_tokens if ds else 0,
            "sha256": ds.sha256 if ds else "",
            "pieces_total": ds.pieces if ds else 0,
            "pieces_done": len(self.current.done),
            "pieces_held": sum(len(ps) for ps in self.leases.held.values()),
            "pieces_deferred": sum(len(ps) for ps in self.leases.deferred.values()),
            "epoch": self.current.number,
            "held": {w: list(ps) for w, ps in sorted(self.leases.held.items())},
            "done_by": dict(sorted(self.current.by.items())),
            "previous_by": dict(sorted(self.previous_by.items())),
            "waiting_for": sorted(self.orphans),
        }
