"""The data ledger (server/storage/ledger.py), pure: no piece leased twice, no done piece leased again in its
epoch, no released piece lost, no piece skipped before an epoch ends; idempotent asks; bounds; a saved state
that loads only when it keeps the rules."""

from __future__ import annotations

import json
import random

import pytest

from streamdiloco.server.storage.ledger import MAX_REPORT, Dataset, Ledger, LedgerError
from streamdiloco.server.storage.ledgerstate import from_state, to_state
from streamdiloco.server.storage.pieceset import PieceSet

SHA = "ab" * 32


def ledger(pieces: int = 10, piece_tokens: int = 100, last: int = 100, **kw) -> Ledger:
    led = Ledger(piece_tokens, **kw)
    led.bind(Dataset((pieces - 1) * piece_tokens + last, piece_tokens, SHA))
    return led


def check_rules(led: Ledger) -> None:
    """Every piece is exactly one of done, held (by one worker) or free; the tables agree."""
    assert led.dataset is not None
    held = [p for ps in led.held.values() for p in ps]
    assert len(held) == len(set(held)), "a piece is held twice"
    assert set(held) == set(led.owner)
    assert not set(held) & set(led.done), "a done piece is held"
    for w, ps in led.held.items():
        assert all(led.owner[p] == w for p in ps) and 0 < len(ps) <= led.max_held


def ids(grant) -> list[int]:
    return [p for p, _, _ in grant.held]


def test_pieces_in_order_with_bounds():
    led = ledger(pieces=3, piece_tokens=100, last=40)
    g = led.ask("a", [], [], 2, 0.0)
    assert g.held == [(0, 0, 100), (1, 100, 200)] and (g.epoch, g.done, g.total) == (0, 0, 3)
    g = led.ask("b", [], [], 2, 0.0)
    assert g.held == [(2, 200, 240)]  # the last piece is shorter; nothing else is free


def test_ask_is_idempotent():
    led = ledger()
    first = led.ask("a", [], [], 2, 0.0)
    assert led.ask("a", [], [], 2, 0.0).held == first.held  # a retried call leases nothing more
    g = led.ask("a", [0], [1], 2, 0.0)
    assert ids(g) == [1, 2] and g.done == 1
    again = led.ask("a", [0], [1], 2, 0.0)  # the same report again: acknowledged, not refused
    assert ids(again) == [1, 2] and again.refused == [] and again.repeated == [0] and again.done == 1
    check_rules(led)


def test_done_piece_not_held_is_refused_not_applied():
    led = ledger()
    led.ask("a", [], [], 1, 0.0)
    g = led.ask("b", [0, 3], [], 1, 0.0)
    assert g.refused == [0, 3] and g.done == 0 and led.owner[0] == "a"
    check_rules(led)


def test_release_returns_pieces_lowest_first():
    led = ledger()
    led.ask("a", [], [], 2, 0.0)  # 0, 1
    led.ask("b", [], [], 2, 0.0)  # 2, 3
    assert led.release("a") == [0, 1]
    assert ids(led.ask("c", [], [], 3, 0.0)) == [0, 1, 4]
    check_rules(led)


def test_unclaimed_pieces_go_back():
    led = ledger()
    led.ask("a", [], [], 2, 0.0)
    g = led.ask("a", [], [1], 1, 0.0)  # it lost piece 0 (a restarted worker): 0 is free again
    assert ids(g) == [1]
    assert ids(led.ask("b", [], [], 1, 0.0)) == [0]


def test_epoch_ends_when_every_piece_is_done():
    led = ledger(pieces=3)
    led.ask("a", [], [], 3, 0.0)
    g = led.ask("a", [0, 1], [2], 1, 0.0)
    assert (g.epoch, g.done) == (0, 2)
    g = led.ask("a", [2], [], 1, 0.0)
    assert (g.epoch, g.done, ids(g)) == (1, 0, [0])
    assert led.ask("a", [2], [0], 1, 0.0).refused == []  # a retried report of the last epoch: acknowledged


def test_malformed_asks_change_nothing():
    led = ledger()
    led.ask("a", [], [], 1, 0.0)
    before = json.dumps(to_state(led))
    for done, held, want in [
        ([10], [], 1),
        ([], [-1], 1),
        ([0, 0], [], 1),
        ([0], [0], 1),
        ([], [], led.max_held + 1),
        (list(range(MAX_REPORT + 1)), [], 1),
    ]:
        with pytest.raises(LedgerError) as e:
            led.ask("a", done, held, want, 0.0)
        assert e.value.kind == "invalid"
    assert json.dumps(to_state(led)) == before


def test_other_data_is_refused():
    led = ledger()
    with pytest.raises(LedgerError, match="same data") as e:
        led.bind(Dataset(1000, 100, "cd" * 32))
    assert e.value.kind == "mismatch"
    with pytest.raises(LedgerError, match="pieces are of 100"):
        led.bind(Dataset(1000, 50, SHA))
    with pytest.raises(LedgerError, match="no dataset"):
        Ledger(100).ask("a", [], [], 1, 0.0)


def test_random_run_trains_every_piece_once_per_epoch():
    """Workers come, train, leave and vanish at random, the ledger saved and loaded now and then: each epoch
    has every piece done exactly once, and no piece was ever held by two workers at once."""
    rng = random.Random(7)
    led = ledger(pieces=23, max_held=3)
    workers: dict[str, list[int]] = {}  # what each worker believes it holds
    trained: dict[int, list[int]] = {}  # epoch -> pieces reported done and accepted
    now = 0.0
    for _ in range(3000):
        now += 1.0
        w = f"w{rng.randrange(6)}"
        action = rng.random()
        if action < 0.05 and w in workers:  # leaves: the roster releases it
            led.release(w)
            del workers[w]
        elif action < 0.08:  # a save and a restart of the shard
            led = from_state(json.loads(json.dumps(to_state(led))), 100, now, max_held=3, orphan_seconds=5)
        else:
            mine = workers.get(w, [])
            done = mine[:1] if mine and rng.random() < 0.7 else []
            epoch = led.epoch
            g = led.ask(w, done, mine[len(done) :], rng.randint(0, 3), now)
            for p in done:
                if p not in g.refused and p not in g.repeated:
                    trained.setdefault(epoch, []).append(p)
            workers[w] = ids(g)
        led.expire(now)
        check_rules(led)
        for w2, ps in workers.items():  # a worker's belief never runs ahead of the ledger's
            workers[w2] = [p for p in ps if led.owner.get(p) == w2]
    assert led.epoch >= 3
    for epoch in range(led.epoch):
        assert sorted(trained[epoch]) == list(range(23)), f"epoch {epoch}"


def test_state_round_trip_and_orphans():
    led = ledger()
    led.ask("a", [], [], 2, 0.0)
    led.ask("b", [], [], 1, 0.0)
    led.ask("a", [0], [1], 1, 0.0)
    back = from_state(json.loads(json.dumps(to_state(led))), 100, now=10.0, orphan_seconds=5)
    assert to_state(back) == to_state(led) and back.orphans == {"a": 15.0, "b": 15.0}
    assert ids(back.ask("a", [], [1], 1, 11.0)) == [1]  # back in time: keeps its piece
    assert back.expire(16.0) == ["b"] and ids(back.ask("c", [], [], 2, 16.0)) == [2, 3]
    check_rules(back)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda s: s["held"].update(b=[1]), "held by both"),
        (lambda s: s["held"].update(b=[0]), "held by 'b' and done"),
        (lambda s: s["held"].update(b=[99]), "name piece 99"),
        (lambda s: s["deferred"].update(b=[1]), "held by both"),
        (lambda s: s.update(done="z1:@@"), "does not decode"),
        (lambda s: s.update(done=PieceSet(80).encode()), "bytes long"),
        (lambda s: s["done_by"].update(a=2), "add up"),
        (lambda s: s["counted"].update(a=-1), "counted"),
        (lambda s: s["recent"].update(a=[[0, 99]]), "recent"),
        (lambda s: s.update(epoch=-1), "epoch"),
        (lambda s: s["dataset"].update(piece_tokens=50), "--piece-tokens"),
        (lambda s: s["dataset"].update(sha256="zz"), "sha256"),
        (lambda s: s["dataset"].update(confirmed="yes"), "confirmed"),
        (lambda s: s.pop("held"), "malformed"),
        (lambda s: s.update(format=3), "format"),
        (
            lambda s: (
                s.update(done=PieceSet(10, bytearray(b"\xff\x03")).encode(), done_by={"a": 10}),
                s["held"].clear(),
            ),
            "every piece done",
        ),
    ],
)
def test_damaged_state_is_refused(change, match):
    led = ledger()
    led.ask("a", [], [], 2, 0.0)
    led.ask("a", [0], [1], 1, 0.0)
    state = json.loads(json.dumps(to_state(led)))
    change(state)
    with pytest.raises(ValueError, match=match):
        from_state(state, 100, 0.0)


def test_a_checkpoint_of_the_first_format_loads():
    """ledger.json as the shards before the bitmaps wrote it: every done piece with its worker."""
    old = {
        "format": 1,
        "dataset": {"train_tokens": 1000, "piece_tokens": 100, "sha256": SHA},
        "epoch": 1,
        "done": {"0": "a", "1": "b"},
        "previous": {str(p): "a" if p < 6 else "b" for p in range(10)},
        "held": {"b": [2, 3]},
    }
    led = from_state(old, 100, now=5.0)
    assert sorted(led.done) == [0, 1] and led.held == {"b": [2, 3]} and led.confirmed
    assert (led.current.by, led.previous_by) == ({"a": 1, "b": 1}, {"a": 6, "b": 4})
    assert led.ask("a", [0], [], 1, 6.0).repeated == [0]  # its report, retried: acknowledged
    assert to_state(from_state(to_state(led), 100, 6.0)) == to_state(led)
    unbound = {"format": 1, "dataset": old["dataset"], "epoch": 0, "done": {}, "previous": {}, "held": {}}
    assert not from_state(unbound, 100, 0.0).confirmed  # nothing done under it: provisional
