"""The ledger test through real processes: one shard keeps the run's data ledger while workers train their
pieces (--data-pieces); workers join mid-run, one leaves (SIGTERM), one is killed (SIGKILL) and started
again from its checkpoint, and the shard is killed (SIGKILL) and restarted from its checkpoint. Afterwards
every piece of the first epoch was trained to its end exactly once, counted from the workers' records (their
logs: a killed process writes no summary) and from the shard's ledger (its checkpoint's ledger.json), which
agree on how many pieces each worker trained."""

from __future__ import annotations

import json
import re
import signal

import pytest

from tests.support.procs import Cluster, http_json, wait_until

pytestmark = pytest.mark.timeout(300)

NANO = ["--model", "nano", "--sync-every", "6", "--num-fragments", "2", "--merge-policy", "fixed"]
PIECE_TOKENS = 512  # nano's windows are 33 bytes: 15 windows, 4 steps of batch 4 per piece
DONE = re.compile(r"(\S+): piece (\d+) of epoch (\d+) done")


def _text(n: int) -> str:
    words = [f"word{i % 97} " for i in range(n // 6)]
    return "".join(words)[:n]


def _done(log: str) -> list[tuple[str, int, int]]:
    return [(m[1], int(m[2]), int(m[3])) for m in DONE.finditer(log)]


# a minute or more of processes: in `make test-slow`. `make test` covers its parts: the ledger's rules through
# random joins, leaves and restarts (test_ledger.py::test_random_run_trains_every_piece_once_per_epoch), the
# RPC's session binding, release on leaving and restart from the checkpoint (test_pieces_rpc.py) and the
# worker's stream against a ledger (test_piecestream.py)
@pytest.mark.slow
def test_every_piece_of_an_epoch_is_trained_once_through_joins_leaves_kills_and_a_shard_restart(tmp_path):
    data = tmp_path / "text.txt"
    data.write_text(_text(32000))  # 30400 train bytes: 60 pieces of 512 (the last of 192)
    shard_flags = [*NANO, "--min-workers", "1", "--round-timeout", "10", "--piece-tokens", str(PIECE_TOKENS)]
    work = [*NANO, "--data", str(data), "--data-pieces", "--batch-size", "4", "--log-every", "20"]
    work += ["--checkpoint-every", "4", "--eval-every", "0", "--step-delay", "0.1", "--steps", "100000"]
    logs: list[str] = []  # every worker process's log
    with Cluster(tmp_path) as c:
        target, http = c.shard("shard", *shard_flags)
        port = int(target.rsplit(":", 1)[1])

        def data() -> dict:
            return http_json(http)["data"]

        def pieces_of(name: str) -> int:
            path = tmp_path / f"{name}.log"
            return len(_done(path.read_text())) if path.exists() else 0

        def one_more(name: str):
            n = pieces_of(name)
            wait_until(f"{name} to finish a piece", lambda: pieces_of(name) > n, timeout=120)

        c.worker("worker-a", [target], *work)
        c.worker("worker-b", [target], *work)
        wait_until("a piece done", lambda: data()["pieces_done"] >= 1, timeout=120)
        c.worker("worker-c", [target], *work)  # joins mid-run
        one_more("worker-c")
        c.procs["worker-c"].send_signal(signal.SIGTERM)  # leaves: its pieces go back
        assert c.wait("worker-c", timeout=60) == 0, c.log("worker-c")[-3000:]
        logs.append(c.log("worker-c"))

        one_more("worker-b")
        c.procs["worker-b"].send_signal(signal.SIGKILL)  # killed: its session breaks, its pieces go back
        c.procs["worker-b"].wait()  # (its restart appends to its log)
        c.worker("worker-b", [target], *work, "--auto-resume")
        one_more("worker-b")

        c.procs["shard"].send_signal(signal.SIGKILL)  # the shard, mid-run: its checkpoint has the ledger
        c.procs["shard"].wait()
        target, http = c.shard("shard", *shard_flags, port=port)
        assert "resumed from checkpoint" in c.log("shard")
        assert data()["epoch"] == 0  # the restart came within the first epoch

        wait_until("the first epoch to end", lambda: data()["epoch"] >= 1, timeout=240)
        status = data()
        for name in ("worker-a", "worker-b"):
            c.procs[name].send_signal(signal.SIGTERM)
        for name in ("worker-a", "worker-b"):
            assert c.wait(name, timeout=60) == 0, c.log(name)[-4000:]
            logs.append(c.log(name))
        c.procs["shard"].send_signal(signal.SIGTERM)  # writes its checkpoint, the ledger with it
        assert c.wait("shard", timeout=60) == 0
    ledger = json.loads((tmp_path / "shard-checkpoint" / "ledger.json").read_text())
    assert status["pieces_total"] == 60 and ledger["epoch"] == 1, (status, ledger["epoch"])
    # the shard's record of the first epoch: how many pieces each worker did (the done set is a bitmap)
    first = ledger["previous_by"]
    assert sum(first.values()) == 60, ledger
    # the workers' records: each piece of epoch 0 reported done and taken exactly once
    reports = [(p, w) for log in logs for w, p, e in _done(log) if e == 0]
    twice = sorted({(p, w) for p, w in reports if [q for q, _ in reports].count(p) > 1})
    assert not twice, f"trained twice: {twice}"
    # a worker logs a piece done once the shard has taken its report: the SIGKILL of worker-b may land
    # between the two, and then the piece is in the ledger (worker-b's) and not in its log
    missing = sorted(set(range(60)) - {p for p, _ in reports})
    logged = {w: sum(1 for _, v in reports if v == w) for w in first}
    assert len(missing) <= 1 and logged == {**first, "worker-b": first["worker-b"] - len(missing)}, (
        missing,
        first,
        logged,
    )
    assert {w for _, w in reports} == {"worker-a", "worker-b", "worker-c"}
