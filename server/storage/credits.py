"""The contribution credits: what each worker identity gave a shard, so that a collective can credit its
volunteers. One row per name a session proved (server/trust/auth.py's `Identity`: under per-worker tokens or
client certificates the credential binds the name; under the run token the name is the worker's word, and
the row's `via` says so). Per row:

- `tokens`: the tokens of its training that reached the model through this shard: the weights the shard
  bounded of its pushes folded into closed rounds (server/rounds/defenses.py's `counted`: each cut to
  --weight-cap times the median of the round's and the recent rounds' weights and to --max-weight, never
  stretched by a claimed speed, and one token for a lone push nothing could check; never the claim),
  summed over the fragments and divided by the run's P fragments. A liar is credited at most the median
  honest share a round. A worker's push of a fragment carries the tokens it
  trained on since its last push of that fragment, so every token it trained on is pushed once per
  fragment; divided by P, a worker whose every push counted has `tokens` = the tokens it trained on. A
  round whose step came out non-finite (a zero update) credits nothing.
- `pushes`: whole pushes accepted into a round; `clipped` / `capped`: those of them whose norm was clipped
  or weight capped (counted when their round closes); `late`: pushes refused because their round had
  closed; `refused`: the other refusals, by reason (the bounded set `REASONS`; any other is "other");
- `rounds`: closed rounds (of any fragment) that folded one of its pushes;
- `sessions` and `connected_seconds`: sessions opened, and their durations, the open ones' so far.

Bounded: at most `max_rows` identities (MAX_IDENTITIES) have a row. A new identity beyond that folds the
least-contributing rows (fewest tokens, then pushes, then rounds; ones without an open session first; a
64th of the bound at once) into `others`, which sums every folded row and counts them; a folded name that
comes back starts a new row. Names cycled through a run token (each with a session, a push, a refusal)
fold one another away and leave a row that has tokens where it is: tokens are what only a push the shard
accepted and settled in a closed round earns, and that is bounded (below).

Rounds are credited once: `through[f]` is the first round of fragment f not yet credited, kept with the
credits, so that rounds a restarted shard replays from its checkpoint's logs are credited exactly when the
saved credits had not counted them (server/storage/checkpoint.py).

Pure (the clock is passed in; no I/O): the shard's servicer, round runner and checkpoint call it, and the
`streamdiloco credits` command (cli/credit_cmd.py) checks and merges what shards saved or serve. It must not
be mixed with server/storage/ledger.py, the *data* ledger of pieces, nor log: callers pass names through
`shown`.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from streamdiloco.common.logs import escaped

MAX_IDENTITIES = 4096  # rows kept; beyond, the least-contributing idle ones fold into `others`
FOLD_BATCH = 64  # at the bound, a new row folds max_rows // FOLD_BATCH rows at once (amortized cost)
STATUS_ROWS = 100  # rows /api/status lists by default (the most tokens first); the rest sum into others
VERSION = 1
MAX_COUNT = 1 << 53
MAX_NAME = 128  # server/edge/admission.py's bound on worker names
# How a session's credential proved its name (server/trust/auth.py's Identity.via), "" where unknown
VIAS = ("", "worker token", "certificate", "worker token and certificate", "run token", "nothing")
# The reasons intake and staging refuse a push for (server/edge/intake.py, server/rounds/staging.py,
# common/chunks.py); "late" has its own column
REASONS = (
    "bad_chunk",
    "bad_codec",
    "bad_fragment",
    "bad_header",
    "bad_length",
    "bad_loss",
    "bad_message",
    "bad_offset",
    "bad_round",
    "bad_scale",
    "bad_value",
    "bad_weight",
    "duplicate",
    "not_ready",
    "round_changed",
    "staging_full",
    "other",
)
COUNTS = ("pushes", "clipped", "capped", "late", "rounds", "sessions")
SECONDS = ("tokens", "connected_seconds")  # the row's float fields
ROW_KEYS = frozenset({"worker", "via", "refused", *COUNTS, *SECONDS})


def shown(name: str, limit: int = 60) -> str:
    """A worker's name as it goes into a log line or an error: escaped (it cannot forge a line), bounded."""
    text = escaped(name)
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass
class Row:
    """One identity's contribution (see the module's docstring)."""

    via: str = ""
    tokens: float = 0.0
    pushes: int = 0
    clipped: int = 0
    capped: int = 0
    late: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    rounds: int = 0
    sessions: int = 0
    connected_seconds: float = 0.0  # closed sessions' durations

    def add(self, other: Row) -> None:
        """Fold another row's counts into this one."""
        for key in (*COUNTS, *SECONDS):
            setattr(self, key, getattr(self, key) + getattr(other, key))
        for reason, n in other.refused.items():
            self.refused[reason] = self.refused.get(reason, 0) + n

    def rank(self) -> tuple[float, int, int]:
        """How much it contributed, to order rows (the most first when negated)."""
        return (self.tokens, self.pushes, self.rounds)

    def to_dict(self, worker: str | None, connected: float = 0.0) -> dict:
        """The row as JSON data; `connected`: seconds of its open session so far."""
        out: dict = {} if worker is None else {"worker": worker}
        out.update({"via": self.via, "tokens": self.tokens})
        out.update({key: getattr(self, key) for key in COUNTS})
        out["refused"] = dict(sorted(self.refused.items()))
        out["connected_seconds"] = self.connected_seconds + connected
        return out


class Credits:
    """One shard's contribution credits (see the module's docstring)."""

    def __init__(self, num_fragments: int, max_rows: int = MAX_IDENTITIES):
        if num_fragments < 1 or max_rows < 1:
            raise ValueError(f"need at least 1 fragment and 1 row, got {num_fragments} and {max_rows}")
        self.num_fragments, self.max_rows = num_fragments, max_rows
        self.rows: dict[str, Row] = {}
        self.others = Row()  # the rows folded away (bounded), summed
        self.folded = 0  # how many rows `others` holds
        self.through = [0] * num_fragments  # per fragment: the first round not yet credited
        self.open: dict[str, float] = {}  # name -> when its open session began (one session per name)
        self.changed = False  # since the last to_state (the shard saves the credits when they changed)

    # --- what happens on the shard -------------------------------------------------------------------------
    def row(self, name: str) -> Row:
        """The name's row, made (and others folded away, at the bound) if it has none."""
        row = self.rows.get(name)
        if row is None:
            if len(self.rows) >= self.max_rows:
                # a batch at once: names cycled through a run token cost one pass over the rows per
                # FOLD_BATCH of them, not one each (10,000 names took 5 s of the event loop one at a time)
                self._fold(max(1, self.max_rows // FOLD_BATCH))
            row = self.rows[name] = Row()
        self.changed = True
        return row

    def _fold(self, count: int = 1) -> None:
        """Fold the `count` least-contributing rows into `others`, idle ones (no open session) first."""

        def key(name: str) -> tuple[bool, tuple[float, int, int], str]:
            return (name in self.open, self.rows[name].rank(), name)

        for victim in heapq.nsmallest(count, self.rows, key=key):
            self.others.add(self.rows.pop(victim))
            self.folded += 1

    def connected(self, name: str, via: str, now: float) -> None:
        """A session of `name`, proved `via` a credential (Identity.via), opened at `now`."""
        if name in self.open:  # cannot happen (one session per name): close the old one first
            self.disconnected(name, now)
        row = self.row(name)
        row.via = via if via in VIAS else ""
        row.sessions += 1
        self.open[name] = now

    def disconnected(self, name: str, now: float) -> None:
        """The session of `name` ended at `now`: its duration joins its row (or `others`, if folded)."""
        began = self.open.pop(name, None)
        if began is None:
            return
        (self.rows.get(name) or self.others).connected_seconds += max(0.0, now - began)
        self.changed = True

    def accepted(self, name: str) -> None:
        """A whole push of `name` went into its round."""
        self.row(name).pushes += 1

    def refused(self, name: str, reason: str) -> None:
        """A push (or a message on its session) of `name` was refused for `reason`."""
        row = self.row(name)
        if reason == "late":
            row.late += 1
            return
        reason = reason if reason in REASONS else "other"
        row.refused[reason] = row.refused.get(reason, 0) + 1

    def round_closed(
        self,
        fragment: int,
        round: int,
        tokens: dict[str, float],
        clipped: Iterable[str] = (),
        capped: Iterable[str] = (),
        void: bool = False,
    ) -> bool:
        """Credit a closed round: `tokens` maps each contributor to the summed credits (weights as the shard
        bounded them, never a claim) of its pushes folded into it; `clipped` / `capped` name the pushes
        clipped or capped (once each); `void`: its step came out non-finite, nothing reached the model. False
        when the round was credited already (a restart replaying its log), nothing changed then."""
        if not 0 <= fragment < self.num_fragments:
            raise ValueError(f"fragment {fragment} is outside 0..{self.num_fragments - 1}")
        if round < self.through[fragment]:
            return False
        self.through[fragment] = round + 1
        self.changed = True
        if void:
            return True
        for name, share in sorted(tokens.items()):
            row = self.row(name)
            row.tokens += share / self.num_fragments
            row.rounds += 1
        for name in clipped:
            self.row(name).clipped += 1
        for name in capped:
            self.row(name).capped += 1
        return True

    def replayed(self, fragment: int, round: int, credit: object, why: str) -> bool:
        """A round that a restarted shard replayed from its log (CloseJob.record's "credit": tokens per
        worker, the clipped and the capped), credited unless the credits had it; a log written before the
        credits existed credits nothing. ValueError (one line) for a malformed credit."""
        if credit is None:
            return False
        ok = isinstance(credit, dict) and set(credit) == {"tokens", "clipped", "capped"}
        tokens = credit["tokens"] if isinstance(credit, dict) and ok else None
        names = [credit["clipped"], credit["capped"]] if isinstance(credit, dict) and ok else []
        if not (
            isinstance(tokens, dict)
            and all(isinstance(k, str) and _amount(v) for k, v in tokens.items())
            and all(isinstance(xs, list) and all(isinstance(x, str) for x in xs) for xs in names)
        ):
            raise ValueError(f"the credit of fragment {fragment} round {round} is malformed")
        return self.round_closed(fragment, round, tokens, names[0], names[1], why == "nonfinite")

    # --- what is reported ------------------------------------------------------------------------------
    @property
    def identities(self) -> int:
        """Identities counted: the rows, and those folded into others."""
        return len(self.rows) + self.folded

    def ranked(self) -> list[str]:
        """The names, the most tokens (then pushes, rounds) first, then by name."""
        return sorted(self.rows, key=lambda n: (tuple(-x for x in self.rows[n].rank()), n))

    def _open_seconds(self, name: str, now: float) -> float:
        began = self.open.get(name)
        return 0.0 if began is None else max(0.0, now - began)

    def _rest(self, names: list[str], now: float) -> Row:
        """`others` plus the rows of `names`, summed, with their open sessions' seconds so far (and those of
        folded rows whose session is still open)."""
        rest, among = Row(), set(names)
        rest.add(self.others)
        for n in names:
            rest.add(self.rows[n])
        rest.connected_seconds += sum(
            self._open_seconds(n, now) for n in self.open if n not in self.rows or n in among
        )
        return rest

    def status(self, now: float, limit: int = STATUS_ROWS) -> dict:
        """/api/status's "credits": the `limit` rows with the most tokens (with `connected`: a session is
        open), the rest summed into "others" with the folded rows."""
        names = self.ranked()
        rows = [
            {**self.rows[n].to_dict(n, self._open_seconds(n, now)), "connected": n in self.open}
            for n in names[:limit]
        ]
        others = self._rest(names[limit:], now)
        return {
            "identities": self.identities,
            "max_identities": self.max_rows,
            "fragments": self.num_fragments,
            "workers": rows,
            "others": {**others.to_dict(None), "identities": self.folded + len(names[limit:])},
        }

    def top(self, k: int, now: float) -> tuple[list[tuple[str, Row, float]], Row]:
        """The k rows with the most tokens as (name, row, its open session's seconds so far), and the rest
        summed with the folded rows (Prometheus' series: bounded labels)."""
        names = self.ranked()
        tops = [(n, self.rows[n], self._open_seconds(n, now)) for n in names[:k]]
        return tops, self._rest(names[k:], now)

    # --- checkpoints -----------------------------------------------------------------------------------
    def to_state(self, now: float) -> dict:
        """The credits as a checkpoint keeps them (JSON data): open sessions count up to `now` (a restart ends
        them). Clears `changed`."""
        self.changed = False
        return {
            "version": VERSION,
            "fragments": self.num_fragments,
            "through": list(self.through),
            "workers": [self.rows[n].to_dict(n, self._open_seconds(n, now)) for n in sorted(self.rows)],
            "others": {**self.others.to_dict(None), "identities": self.folded},
        }

    @classmethod
    def from_state(
        cls, state: object, num_fragments: int | None = None, max_rows: int = MAX_IDENTITIES
    ) -> Credits:
        """Credits from `to_state`'s data, every field checked: ValueError (one line) for anything else,
        or for credits of another number of fragments than `num_fragments` (None: any). Rows beyond
        `max_rows` are folded into others."""
        keys = {"version", "fragments", "through", "workers", "others"}
        if not isinstance(state, dict) or set(state) != keys:
            raise ValueError(f"not a contribution ledger (want the keys {sorted(keys)})")
        if state["version"] != VERSION:
            raise ValueError(f"credits of version {state['version']!r:.20}, this reads {VERSION}")
        p = state["fragments"]
        if not _count(p) or p < 1 or (num_fragments is not None and p != num_fragments):
            raise ValueError(f"contribution credits of {p!r} fragments, the run has {num_fragments}")
        through = state["through"]
        if not (isinstance(through, list) and len(through) == p and all(_count(r) for r in through)):
            raise ValueError(f"contribution credits' through must be {p} round numbers, got {through!r:.80}")
        workers = state["workers"]
        if not isinstance(workers, list) or len(workers) > MAX_COUNT:
            raise ValueError("contribution credits' workers must be a list of rows")
        credits = cls(p, max_rows)
        credits.through = list(through)
        for d in workers:
            name, row = checked_row(d)
            if name is None or name in credits.rows:
                raise ValueError(f"contribution credits: {shown(repr(name))} has two rows")
            if len(credits.rows) >= max_rows:
                credits._fold()
            credits.rows[name] = row
        others = state["others"]
        if not isinstance(others, dict) or not _count(others.get("identities")):
            raise ValueError("contribution credits' others must be a row with its count of identities")
        _, credits.others = checked_row({k: v for k, v in others.items() if k != "identities"}, named=False)
        credits.folded += others["identities"]
        return credits


def _count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_COUNT


def _amount(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and 0 <= x <= MAX_COUNT


def checked_row(d: object, named: bool = True, live: bool = False) -> tuple[str | None, Row]:
    """A row as `Row.to_dict` wrote it (`named`: with its worker; `live`: with /api/status's `connected`),
    checked: ValueError (one line) for a missing or extra key or a value out of range."""
    keys = ROW_KEYS if named else ROW_KEYS - {"worker"}
    if live:
        keys = keys | {"connected"}
    if not isinstance(d, dict) or set(d) != keys:
        got = sorted(d)[:20] if isinstance(d, dict) else type(d).__name__
        raise ValueError(f"a contribution credits row must have the keys {sorted(keys)}, got {got}")
    name = d.get("worker")
    if named and not (
        isinstance(name, str) and 0 < len(name) <= MAX_NAME and name.isprintable() and name == name.strip()
    ):
        raise ValueError(f"a contribution credits row names no worker: {shown(repr(name))}")
    where = f"the contribution credits row of {shown(str(name))}" if named else "the credits' others row"
    if live and not isinstance(d["connected"], bool):
        raise ValueError(f"{where}: connected must be true or false")
    if d["via"] not in VIAS:
        raise ValueError(f"{where}: via must be one of {list(VIAS)}, got {shown(repr(d['via']))}")
    for key in COUNTS:
        if not _count(d[key]):
            raise ValueError(f"{where}: {key} must be a count, got {d[key]!r:.40}")
    for key in SECONDS:
        if not _amount(d[key]):
            raise ValueError(f"{where}: {key} must be a finite number >= 0, got {d[key]!r:.40}")
    refused = d["refused"]
    if not isinstance(refused, dict) or not all(r in REASONS and _count(n) for r, n in refused.items()):
        raise ValueError(f"{where}: refused must map the reasons {list(REASONS)} to counts")
    row = Row(d["via"], float(d["tokens"]), refused=dict(refused))
    for key in COUNTS:
        setattr(row, key, d[key])
    row.connected_seconds = float(d["connected_seconds"])
    return name if named else None, row
