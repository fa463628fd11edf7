"""The data ledger (server/storage/ledger.py) as shard 0's checkpoint keeps it: ledger.json, format 2.

    {"format": 2,
     "dataset": null | {"train_tokens", "piece_tokens", "sha256", "confirmed"},
     "epoch": n, "done": "z1:..." (the epoch's done set, a bitmap: server/storage/pieceset.py),
     "done_by": {worker: pieces}, "previous_by": {worker: pieces} (who did how many, this epoch and the last),
     "held": {worker: [piece, ...]} (in the order it trains them), "deferred": {worker: [piece, ...]}
     (trained, awaiting its pushes), "counted": {worker: tokens} (of its pieces counted, over the run),
     "recent": {worker: [[epoch, piece], ...]} (its last pieces counted: a retried report is acknowledged)}

A ledger of 2^20 pieces is a few hundred KB at most (the bitmap, compressed), where format 1 listed every done
piece with its worker's name (42 MB of JSON). Format 1 still loads: its done table becomes the bitmap and the
counts, its binding is confirmed when a piece was done under it, else provisional.

`snapshot` copies what a write needs on the caller's thread (the shard's event loop: microseconds, the bitmap
is one bytearray copy); `LedgerSnapshot.to_state` encodes it, on a thread of the shard's pool. `from_state`
checks every field and the ledger's rules (a piece held twice, held and done, counts that disagree with the
done set) and refuses a state that breaks one (ValueError, one line). What this module must not do: decide
anything about pieces (the ledger does), or write files (the checkpoint does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from streamdiloco.server.storage.ledger import (
    MAX_DEFERRED,
    MAX_HELD,
    ORPHAN_SECONDS,
    RECENT,
    Dataset,
    Epoch,
    Ledger,
    Pin,
)
from streamdiloco.server.storage.pieceset import PieceSet

FORMAT = 2
LEGACY_FORMAT = 1  # every done piece listed with its worker's name
MAX_NAME = 256  # a worker's name in the file (the shard admits names of at most 128 characters)
_COUNT = 1 << 53


@dataclass(frozen=True)
class LedgerSnapshot:
    """What a ledger.json write needs, copied off the live ledger (see the module's docstring)."""

    dataset: Dataset | None
    confirmed: bool
    epoch: int
    done: bytes
    done_by: dict[str, int]
    previous_by: dict[str, int]
    held: dict[str, list[int]]
    deferred: dict[str, list[int]]
    counted: dict[str, int]
    recent: dict[str, tuple[tuple[int, int], ...]]

    def to_state(self) -> dict:
        """The JSON data of ledger.json."""
        ds = self.dataset
        return {
            "format": FORMAT,
            "dataset": None
            if ds is None
            else {
                "train_tokens": ds.train_tokens,
                "piece_tokens": ds.piece_tokens,
                "sha256": ds.sha256,
                "confirmed": self.confirmed,
            },
            "epoch": self.epoch,
            "done": PieceSet(ds.pieces if ds else 0, bytearray(self.done)).encode(),
            "done_by": dict(sorted(self.done_by.items())),
            "previous_by": dict(sorted(self.previous_by.items())),
            "held": dict(sorted(self.held.items())),
            "deferred": dict(sorted(self.deferred.items())),
            "counted": dict(sorted(self.counted.items())),
            "recent": {w: [list(e) for e in r] for w, r in sorted(self.recent.items())},
        }


def snapshot(led: Ledger) -> LedgerSnapshot:
    """The ledger's persistent state now, copied (cheap: call it on the ledger's own thread)."""
    return LedgerSnapshot(
        led.dataset,
        led.confirmed,
        led.current.number,
        bytes(led.current.done.bits),
        dict(led.current.by),
        dict(led.previous_by),
        {w: list(ps) for w, ps in led.leases.held.items()},
        {w: list(ps) for w, ps in led.leases.deferred.items()},
        dict(led.counted),
        dict(led.recent),
    )


def to_state(led: Ledger) -> dict:
    """ledger.json's JSON data for the ledger as it is."""
    return snapshot(led).to_state()


def from_state(
    state: object,
    piece_tokens: int,
    now: float,
    max_held: int = MAX_HELD,
    orphan_seconds: float = ORPHAN_SECONDS,
    pinned: Pin | Dataset | None = None,
) -> Ledger:
    """A ledger as ledger.json saved it (format 2, or 1), each field checked; the workers that own pieces get
    `orphan_seconds` from `now` to come back and claim them, and every lease restarts at `now`. With `pinned`
    (the operator's pin): a saved provisional binding of data that does not fit is dropped; a confirmed one
    is refused. ValueError (one line) when the state is malformed, of other pieces than `piece_tokens`, or
    breaks a rule."""
    led = Ledger(piece_tokens, max_held, orphan_seconds)
    try:
        if isinstance(state, dict) and state.get("format") == LEGACY_FORMAT:
            state = _from_legacy(state, piece_tokens)
        _load(led, state)
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"the data ledger is malformed ({type(e).__name__}: {e})") from None
    pin = Pin(pinned.sha256, pinned.train_tokens) if isinstance(pinned, Dataset) else pinned
    if pin is not None and led.dataset is not None and not pin.fits(led.dataset):
        if led.confirmed:
            raise ValueError(
                f"the data ledger trains {led.dataset.named()}, confirmed by a worker's push; --data-sha256 "
                f"and --data-tokens pin {pin.named()}: pin the same data, or start with --fresh"
            )
        return Ledger(piece_tokens, max_held, orphan_seconds, pinned=pin)  # the provisional one is dropped
    if pin is not None:
        led.pin = pin
        if pin.whole(piece_tokens) is not None:
            if led.dataset is None:
                return Ledger(piece_tokens, max_held, orphan_seconds, pinned=pin)
            led.confirmed = True
    led.orphans = dict.fromkeys(set(led.leases.owner.values()), now + orphan_seconds)
    led.loaded_at = now
    led.changes = 0
    return led


def _load(led: Ledger, state: object) -> None:
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"the data ledger is not of format {FORMAT} (or {LEGACY_FORMAT})")
    d = state["dataset"]
    if d is None:
        if state["held"] or state["deferred"] or state["done_by"] or state["epoch"]:
            raise ValueError("the data ledger has pieces but no dataset")
        return
    if not isinstance(d, dict) or not all(_count(d[k]) for k in ("train_tokens", "piece_tokens")):
        raise ValueError("the data ledger's dataset is malformed")
    if d["piece_tokens"] != led.piece_tokens:
        raise ValueError(
            f"the data ledger cuts pieces of {d['piece_tokens']:,} tokens, this shard "
            f"{led.piece_tokens:,}: start it with the same --piece-tokens, or --fresh"
        )
    if not isinstance(d["confirmed"], bool):
        raise ValueError("the data ledger's dataset is malformed (confirmed)")
    ds = Dataset(d["train_tokens"], d["piece_tokens"], str(d["sha256"]))
    led.bind(ds)
    led.confirmed = d["confirmed"]
    if not _count(epoch := state["epoch"]):
        raise ValueError(f"the data ledger's epoch is {epoch!r}")
    done = PieceSet.decode(state["done"], ds.pieces)
    if len(done) >= ds.pieces:
        raise ValueError("the data ledger has every piece done and its epoch not ended")
    led.current = Epoch(epoch, done, _counts(state["done_by"], "done_by"))
    led.previous_by = _counts(state["previous_by"], "previous_by")
    if sum(led.current.by.values()) != len(done):
        raise ValueError("the data ledger's done_by does not add up to its done pieces")
    if sum(led.previous_by.values()) != (ds.pieces if epoch else 0):
        raise ValueError("the data ledger's previous_by does not add up to the epoch before")
    _load_leases(led, state["held"], "held", max_held=led.max_held)
    _load_leases(led, state["deferred"], "deferred", max_held=led.max_held + MAX_DEFERRED)
    led.counted = _counts(state["counted"], "counted")
    led.recent = _recent(state["recent"], ds.pieces)


def _load_leases(led: Ledger, table: object, what: str, max_held: int) -> None:
    if not isinstance(table, dict):
        raise ValueError(f"the data ledger's {what} is not a table")
    ds, leases = led.dataset, led.leases
    assert ds is not None
    for w, ps in table.items():
        if not _name(w) or not isinstance(ps, list) or not ps or len(ps) + leases.owned(w) > max_held:
            raise ValueError(f"the data ledger's {what} pieces of {str(w)[:80]!r} are malformed")
        for p in ps:
            if not _count(p) or p >= ds.pieces:
                raise ValueError(f"the data ledger's {what} pieces of {w!r} name piece {p!r}")
            if p in leases.owner:
                raise ValueError(f"the data ledger has piece {p} held by both {leases.owner[p]!r} and {w!r}")
            if p in led.current.done:
                raise ValueError(f"the data ledger has piece {p} held by {w!r} and done")
            leases.give(w, p, -math.inf)
            if what == "deferred":
                leases.defer(w, p, -math.inf)


def _counts(table: object, what: str) -> dict[str, int]:
    if not isinstance(table, dict) or not all(_name(w) and _count(n) for w, n in table.items()):
        raise ValueError(f"the data ledger's {what} is not a table of names and counts")
    return dict(table)


def _recent(table: object, pieces: int) -> dict[str, tuple[tuple[int, int], ...]]:
    if not isinstance(table, dict):
        raise ValueError("the data ledger's recent is not a table")
    out = {}
    for w, entries in table.items():
        if not _name(w) or not isinstance(entries, list) or len(entries) > RECENT:
            raise ValueError(f"the data ledger's recent pieces of {str(w)[:80]!r} are malformed")
        pairs = [tuple(e) for e in entries if isinstance(e, list) and len(e) == 2]
        if len(pairs) != len(entries) or not all(_count(e) and _count(p) and p < pieces for e, p in pairs):
            raise ValueError(f"the data ledger's recent pieces of {w!r} are malformed")
        out[w] = tuple(pairs)
    return out


def _from_legacy(state: dict, piece_tokens: int) -> dict:
    """A format 1 ledger (every done piece listed with its worker) as format 2's data."""
    d = state["dataset"]
    if d is None:
        if state["done"] or state["held"] or state["previous"] or state["epoch"]:
            raise ValueError("the data ledger has pieces but no dataset")
        return {"format": FORMAT, "dataset": None, "epoch": 0, "held": {}, "deferred": {}, "done_by": {}}
    if not isinstance(d, dict) or not all(_count(d[k]) for k in ("train_tokens", "piece_tokens")):
        raise ValueError("the data ledger's dataset is malformed")
    if d["piece_tokens"] != piece_tokens:
        return {"format": FORMAT, "dataset": {**d, "confirmed": True}}  # refused by _load, in its words
    ds = Dataset(d["train_tokens"], d["piece_tokens"], str(d["sha256"]))
    done, previous = (_legacy_table(state[k], ds.pieces, k) for k in ("done", "previous"))
    bits = PieceSet(ds.pieces)
    for p in done:
        bits.add(p)
    counted: dict[str, int] = {}
    recent: dict[str, list[list[int]]] = {}
    epoch = state["epoch"]
    for e, table in ((epoch - 1, previous), (epoch, done)):
        for p, w in sorted(table.items()):
            start, end = ds.bounds(p)
            counted[w] = counted.get(w, 0) + end - start
            recent[w] = ([*recent.get(w, []), [e, p]])[-RECENT:]
    return {
        "format": FORMAT,
        "dataset": {**d, "confirmed": bool(done or previous or epoch)},
        "epoch": epoch,
        "done": bits.encode(),
        "done_by": _tally(done),
        "previous_by": _tally(previous),
        "held": state["held"],
        "deferred": {},
        "counted": counted,
        "recent": recent,
    }


def _legacy_table(table: object, pieces: int, what: str) -> dict[int, str]:
    if not isinstance(table, dict):
        raise ValueError(f"the data ledger's {what} is not a table")
    out = {}
    for k, w in table.items():
        if not (isinstance(k, str) and k.isdigit() and int(k) < pieces) or not _name(w):
            raise ValueError(f"the data ledger's {what} has a malformed entry {str(k)[:20]!r}")
        out[int(k)] = w
    return out


def _tally(table: dict[int, str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for w in table.values():
        out[w] = out.get(w, 0) + 1
    return out


def _name(w: object) -> bool:
    return isinstance(w, str) and 0 < len(w) <= MAX_NAME


def _count(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and 0 <= n < _COUNT
