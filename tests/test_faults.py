"""Faults with real processes on loopback: workers that join, die, stall or come back; shards that die and
restart from their checkpoints. Every test bounds its waits and kills what it started."""

from __future__ import annotations

import signal

import pytest
import torch

from streamdiloco.common.config import SyncConfig
from streamdiloco.common.schedule import next_send_after, send_step
from tests.support.netproxy import ThrottledProxy
from tests.support.procs import Cluster, http_json, wait_until

# merges at exactly t + tau, one inner step per schedule step whatever the timing (the deterministic merge
# policy and schedule): these runs are compared bit for bit with runs that nobody interrupted
NANO = [
    *("--model", "nano", "--sync-every", "6", "--num-fragments", "3"),
    *("--merge-policy", "fixed", "--sync-schedule", "fixed"),
]


def _masters_hashes(http_ports: list[int]) -> list[list[str]]:
    statuses = [http_json(p) for p in http_ports]
    return [
        [st["fragments"][f]["master_hash"] for st in statuses] for f in range(len(statuses[0]["fragments"]))
    ]


def _run_two_workers(tmp, steps: int, kill_shard: bool) -> tuple[list[torch.Tensor], dict]:
    """2 shards, 2 workers (worker-b slow, so rounds stay open with one push for a while); with
    `kill_shard`, shard 0 is killed with SIGKILL while one of its rounds holds worker-a's push only, and
    started again from its checkpoint on the same port."""
    shard_flags = [*NANO, "--num-shards", "2", "--min-workers", "2", "--round-timeout", "300"]
    work = [*NANO, "--steps", str(steps), "--log-every", "6", "--checkpoint-every", "0"]
    with Cluster(tmp) as c:
        t0, h0 = c.shard("shard0", "--shard", "0", *shard_flags)
        t1, h1 = c.shard("shard1", "--shard", "1", *shard_flags)
        c.worker(
            "worker-a",
            [t0, t1],
            *work,
            "--rank",
            "0",
            "--step-delay",
            "0.02",
            "--save-global",
            str(tmp / "a.pt"),
        )
        c.worker(
            "worker-b",
            [t0, t1],
            *work,
            "--rank",
            "1",
            "--step-delay",
            "0.25",
            "--save-global",
            str(tmp / "b.pt"),
        )
        killed_round = None
        if kill_shard:

            def half_open():  # a round of shard 0 that has worker-a's push and waits for worker-b's
                st = http_json(h0)
                for fr in st["fragments"]:
                    if fr["round"] >= 1 and fr["contributors"] == ["worker-a"]:
                        return fr["fragment"], fr["round"]
                return None

            killed_round = wait_until("a half-full round on shard 0", half_open, timeout=120)
            c.procs["shard0"].send_signal(signal.SIGKILL)
            c.procs["shard0"].wait()
            _, h0 = c.shard("shard0", "--shard", "0", *shard_flags, port=int(t0.rsplit(":", 1)[1]))
        for name in ("worker-a", "worker-b"):
            assert c.wait(name, timeout=240) == 0, c.log(name)[-4000:]
        summaries = {name: c.summary(name) for name in ("worker-a", "worker-b")}
        masters = _masters_hashes([h0, h1])
        for s in summaries.values():  # every mirror equals the masters, bit for bit
            assert s["mirror_hashes"] == masters
        mirrors = torch.load(tmp / "a.pt")
        assert all(torch.equal(x, y) for x, y in zip(mirrors, torch.load(tmp / "b.pt"), strict=True))
        return mirrors, {"summaries": summaries, "killed_round": killed_round, "log0": c.log("shard0")}


# two whole 2-shard runs (~1 min): in `make test-slow`. `make test` covers its parts in-process: the kept push
# sent again to a restarted shard (test_elastic_units.py::test_a_kept_push_is_sent_again_to_a_shard_restarted_
# from_its_checkpoint), the restart's replay bit for bit (test_elastic_units.py::test_a_restart_replays_the_
# logged_rounds_after_the_whole_state_bit_for_bit) and a shard process restarted on its checkpoint
# (test_checkpoint_checks.py::test_a_shard_restarted_on_its_checkpoint_reports_the_same_hashes_...)
@pytest.mark.slow
def test_a_shard_killed_mid_round_restarts_from_its_checkpoint_and_the_run_ends_as_if_uninterrupted(tmp_path):
    (tmp_path / "ref").mkdir()
    (tmp_path / "kill").mkdir()
    want, _ = _run_two_workers(tmp_path / "ref", steps=30, kill_shard=False)
    got, info = _run_two_workers(tmp_path / "kill", steps=30, kill_shard=True)
    a, b = info["summaries"]["worker-a"], info["summaries"]["worker-b"]
    assert a["reconnects"] >= 1 and b["reconnects"] >= 1
    # worker-a's push of the round that was open when shard 0 died was lost with it, and sent again
    assert a["pushes_resent"] >= 1, info
    assert "resumed from checkpoint" in info["log0"]
    # the same config and seeds: the same global parameters as the run nobody interrupted, bit for bit
    assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))


def _worker_a_alone_or_with_a_dying_b(tmp, with_b: bool, stall: bool = False) -> list[torch.Tensor]:
    """Worker-a trains; worker-b, behind a slow uplink, is caught in the middle of its first push and then
    killed (its session ends at once), or (stall) its link stops passing anything (the session stays open)
    until the round has closed at its deadline, and then it is killed."""
    flags = [*NANO, "--chunk-bytes", "256", "--min-workers", "1", "--round-timeout", "3" if stall else "120"]
    work = [*NANO, "--steps", "24", "--checkpoint-every", "0", "--log-every", "6"]
    with Cluster(tmp) as c:
        target, http = c.shard("shard", *flags)
        if with_b:
            port = int(target.rsplit(":", 1)[1])
            with ThrottledProxy(port, up_bytes_per_second=1500) as proxy:
                c.worker("worker-b", [f"127.0.0.1:{proxy.port}"], *work, "--rank", "1")
                wait_until(
                    "worker-b to become a member",
                    lambda: any(
                        m["name"] == "worker-b" and m["state"] == "member" for m in http_json(http)["members"]
                    ),
                    timeout=120,
                )
                c.worker(
                    "worker-a",
                    [target],
                    *work,
                    "--rank",
                    "0",
                    "--step-delay",
                    "0.1",
                    "--save-global",
                    str(tmp / "a.pt"),
                )

                def b_mid_push():
                    for m in http_json(http)["members"]:
                        if m["name"] == "worker-b" and m["receiving"] and m["receiving"][0]["values"] > 0:
                            return m
                    return None

                b = wait_until("worker-b in the middle of a push", b_mid_push, timeout=120)
                assert b["pushes"] == 0  # nothing of worker-b's is in any round
                if stall:
                    proxy.pause()
                    half = b["receiving"][0]

                    def closed_without_b():
                        for r in http_json(http, "/api/status?rounds=500")["recent_rounds"]:
                            if (r["fragment"], r["round"]) == (half["fragment"], half["round"]):
                                return r
                        return None

                    # it closes without worker-b's half push: at the deadline, or before it where worker-b
                    # is dormant already (its first push, this slow, missed a round of another fragment)
                    r = wait_until("the round to close without worker-b", closed_without_b, timeout=60)
                    assert r["contributors"] == ["worker-a"], r
                    assert r["why"] in ("deadline", "all") and r["seconds"] < 5.0, r
                    if r["why"] == "deadline":
                        assert r["seconds"] >= 3.0, r
                c.procs["worker-b"].send_signal(signal.SIGKILL)
                c.procs["worker-b"].wait()
                proxy.resume()  # so that the proxy sees the connection end and ends the shard's side
                wait_until(
                    "worker-b to leave",
                    lambda: all(m["name"] != "worker-b" for m in http_json(http)["members"]),
                )
        else:
            c.worker("worker-a", [target], *work, "--rank", "0", "--save-global", str(tmp / "a.pt"))
        assert c.wait("worker-a", timeout=240) == 0, c.log("worker-a")[-4000:]
        status = http_json(http)
        assert status["pushes_accepted"] == c.summary("worker-a")["pushes"]  # worker-a's only
        assert all(r["contributors"] == ["worker-a"] for r in status["recent_rounds"])
        assert c.summary("worker-a")["mirror_hashes"] == [[f["master_hash"]] for f in status["fragments"]]
        return torch.load(tmp / "a.pt")


# two runs each (~40 s): in `make test-slow`. `make test` covers it in-process: a member that leaves mid-push
# takes its chunks with it (test_shard_chunks.py::test_a_member_that_leaves_mid_push_takes_its_chunks_with_it)
# and a round closes at its deadline without a straggler (test_a_slow_worker_does_not_hold_the_others_...)
@pytest.mark.slow
@pytest.mark.parametrize("stall", [False, True], ids=["killed", "link-stalls"])
def test_a_worker_killed_in_the_middle_of_a_push_leaves_nothing_behind(tmp_path, stall):
    (tmp_path / "alone").mkdir()
    (tmp_path / "kill").mkdir()
    want = _worker_a_alone_or_with_a_dying_b(tmp_path / "alone", with_b=False)
    got = _worker_a_alone_or_with_a_dying_b(tmp_path / "kill", with_b=True, stall=stall)
    # the round closed with worker-a's push alone, and no chunk of worker-b's half push got into the
    # masters: the run ends exactly where worker-a alone ends
    assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))


# 2 shards and 4 workers over 72 steps: in `make test-slow`. `make test` covers joining a run in progress at
# the run's step and taking part from the next round with real shard processes
# (test_e2e.py::test_a_worker_joins_a_run_in_progress_at_the_runs_step_and_stays_in_sync)
@pytest.mark.slow
def test_workers_that_join_a_running_run_take_part_from_the_next_round(tmp_path):
    shard_flags = [*NANO, "--num-shards", "2", "--min-workers", "1", "--round-timeout", "60"]
    work = [*NANO, "--steps", "72", "--checkpoint-every", "0", "--log-every", "12", "--step-delay", "0.05"]
    cfg = SyncConfig(sync_every=6, num_fragments=3)
    with Cluster(tmp_path) as c:
        t0, h0 = c.shard("shard0", "--shard", "0", *shard_flags)
        t1, h1 = c.shard("shard1", "--shard", "1", *shard_flags)
        for m, name in enumerate(("worker-a", "worker-b")):
            c.worker(name, [t0, t1], *work, "--rank", str(m))
        wait_until(
            "the run to be under way", lambda: http_json(h0)["fragments"][0]["round"] >= 2, timeout=120
        )
        # the run is paused (its workers stopped) until the joiners are in: however slowly processes start
        # on a loaded machine, they join a run that is still going
        running = [c.procs["worker-a"], c.procs["worker-b"]]
        for p in running:
            p.send_signal(signal.SIGSTOP)
        try:
            for m, name in enumerate(("worker-c", "worker-d"), start=2):  # two at once
                c.worker(name, [t0, t1], *work, "--rank", str(m))

            def joined() -> bool:  # members of both shards: they have the masters and chose their step
                return all(
                    {"worker-c", "worker-d"}
                    <= {m["name"] for m in http_json(h)["members"] if m["state"] == "member"}
                    for h in (h0, h1)
                )

            wait_until("the joiners to be members", joined, timeout=180)
        finally:
            for p in running:
                p.send_signal(signal.SIGCONT)
        names = ("worker-a", "worker-b", "worker-c", "worker-d")
        for name in names:
            assert c.wait(name, timeout=300) == 0, c.log(name)[-4000:]
        s = {name: c.summary(name) for name in names}
        history = http_json(h0, "/api/status?rounds=500")["recent_rounds"]
        assert history[0]["round"] == 0  # all of it
        masters = _masters_hashes([h0, h1])
    for name in ("worker-c", "worker-d"):
        j = s[name]
        assert j["first_step"] > 6  # it started counting at the run's step, not at 0
        assert j["tokens"] == (72 - j["first_step"]) * 16 * 32
        # its first contribution is in the next round: the first one to start after it joined (a joiner
        # also tries the round in progress, if there is one, and that push may come too late)
        mine = [r for r in history if name in r["contributors"]]
        first = min(mine, key=lambda r: send_step(r["fragment"], r["round"], cfg))
        assert send_step(first["fragment"], first["round"], cfg) <= next_send_after(j["first_step"] + 1, cfg)
        assert j["late_refusals"] <= 2  # that one push, refused by each of the 2 shards
        # and from then on it is in every round of every fragment
        later = [r for r in history if send_step(r["fragment"], r["round"], cfg) > j["first_step"] + 6]
        assert later and all(name in r["contributors"] for r in later)
        # it joined from the global parameters of the time, which were better than the initial ones
        assert j["eval_loss_start"] < s["worker-a"]["eval_loss_start"] - 0.1
    for j in s.values():  # the run's eval loss kept falling; every mirror equals the masters
        assert j["eval_loss"] < s["worker-c"]["eval_loss_start"]
        assert j["mirror_hashes"] == masters


def _two_workers_one_stops(tmp, how: str | None) -> tuple[list[torch.Tensor], dict]:
    """1 shard, 2 workers; worker-b is stopped mid-run (SIGTERM or SIGKILL) and started again with --resume,
    or (how=None) runs through."""
    flags = [*NANO, "--min-workers", "2", "--round-timeout", "300"]
    work = [*NANO, "--steps", "36", "--log-every", "6", "--checkpoint-every", "6", "--step-delay", "0.1"]
    with Cluster(tmp) as c:
        target, http = c.shard("shard", *flags)
        c.worker("worker-a", [target], *work, "--rank", "0", "--save-global", str(tmp / "a.pt"))
        b_flags = [*work, "--rank", "1", "--save-global", str(tmp / "b.pt")]
        c.worker("worker-b", [target], *b_flags)
        info: dict = {}
        if how is not None:
            ckpt = tmp / "worker-b.pt"
            wait_until("worker-b's first checkpoint", ckpt.exists, timeout=120)
            wait_until("a few more steps", lambda: http_json(http)["fragments"][1]["round"] >= 3, timeout=120)
            c.procs["worker-b"].send_signal(signal.SIGTERM if how == "term" else signal.SIGKILL)
            info["code"] = c.procs["worker-b"].wait(60)
            info["stopped"] = c.summary("worker-b") if how == "term" else None
            c.worker("worker-b", [target], *b_flags, "--resume")
        for name in ("worker-a", "worker-b"):
            assert c.wait(name, timeout=240) == 0, c.log(name)[-4000:]
        info["a"], info["b"] = c.summary("worker-a"), c.summary("worker-b")
        info["log_b"] = c.log("worker-b")
        status = http_json(http)
        for s in (info["a"], info["b"]):
            assert s["mirror_hashes"] == [[f["master_hash"]] for f in status["fragments"]]
        return torch.load(tmp / "a.pt"), info


# in `make test-slow`; covered by test_a_worker_killed_with_sigkill_resumes_from_its_last_checkpoint (the
# same resume, from a periodic checkpoint) and test_launch_stops_every_process_it_started[sigterm]
@pytest.mark.slow
def test_a_worker_stopped_with_sigterm_resumes_and_the_run_ends_as_if_uninterrupted(tmp_path):
    (tmp_path / "ref").mkdir()
    (tmp_path / "term").mkdir()
    want, _ = _two_workers_one_stops(tmp_path / "ref", None)
    got, info = _two_workers_one_stops(tmp_path / "term", "term")
    assert info["code"] == 0  # a clean stop: it finished its step, handed in its pushes, wrote a checkpoint
    stopped_at = info["stopped"]["stopped_at_step"]
    assert 6 <= stopped_at < 36
    assert "stopping after this step" in info["log_b"] and "continue with --resume" in info["log_b"]
    b = info["b"]
    assert b["resumed"] and b["first_step"] == stopped_at  # it went on from the very step it stopped at
    assert b["tokens"] == 36 * 16 * 32  # every step once: none lost, none done twice
    # the same config and seeds: the same global parameters as the run in which nobody stopped, bit for bit
    assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))


def test_a_worker_killed_with_sigkill_resumes_from_its_last_checkpoint(tmp_path):
    _, info = _two_workers_one_stops(tmp_path, "kill")
    assert info["code"] == -signal.SIGKILL
    b = info["b"]
    assert b["resumed"] and b["first_step"] > 0 and b["first_step"] % 6 == 0  # a periodic checkpoint's step
    assert b["tokens"] >= 36 * 16 * 32  # the steps after the checkpoint were done again
    assert b["eval_loss"] < b["eval_loss_start"] - 0.5


def test_a_slow_worker_does_not_hold_the_others_beyond_the_deadline(tmp_path):
    timeout = 1.0
    flags = [*NANO, "--min-workers", "1", "--round-timeout", str(timeout)]
    work = [*NANO, "--steps", "18", "--log-every", "6", "--checkpoint-every", "0"]
    with Cluster(tmp_path) as c:
        target, http = c.shard("shard", *flags)
        # the slow worker first, a member before worker-a starts: else, on a busy machine, worker-a can
        # finish the run's 18 steps before the slow one has even joined
        c.worker("worker-slow", [target], *work, "--rank", "1", "--step-delay", "0.7")

        def slow_member() -> bool:
            return any(
                m["name"] == "worker-slow" and m["state"] == "member" for m in http_json(http)["members"]
            )

        wait_until("worker-slow to be a member", slow_member, timeout=120)
        c.worker("worker-a", [target], *work, "--rank", "0")
        assert c.wait("worker-a", timeout=120) == 0, c.log("worker-a")[-4000:]
        a_done = http_json(http, "/api/status?rounds=500")
        assert c.wait("worker-slow", timeout=120) == 0, c.log("worker-slow")[-4000:]
        a, slow = c.summary("worker-a"), c.summary("worker-slow")
        status = http_json(http, "/api/status?rounds=500")
    rounds = a_done["recent_rounds"]
    # (the rule's outer bounds: a quorum's grace cut at the deadline, or no quorum long after; then the slow
    # worker is dormant and rounds close "all" without it, until a late push shows it is there again)
    by_deadline = [r for r in rounds if r["why"] in ("deadline", "quorum", "overdue")]
    # rounds closed without the slow worker's push (a deadline round just after worker-a joined may lack
    # worker-a's first push instead: that is the deadline doing its job too) ...
    assert any(r["contributors"] == ["worker-a"] for r in by_deadline), rounds
    # ... none later than the deadline (plus the shard's 0.2 s tick and some slack for a busy machine)
    assert max(r["seconds"] for r in rounds) < timeout + 0.7
    assert a["blocked_seconds"] < len(rounds) * (timeout + 0.7)
    # the slow worker's pushes for closed rounds were refused as late; it applied those updates anyway,
    # finished, and its mirror equals the masters, as does worker-a's
    assert slow["late_refusals"] >= 1
    masters = [[f["master_hash"]] for f in status["fragments"]]
    assert a["mirror_hashes"] == masters == slow["mirror_hashes"]


@pytest.mark.slow
def test_a_long_run_survives_every_fault_in_turn(tmp_path):
    """2 shards, workers joining, dying, stopping and resuming, a shard killed and restarted, one after
    another in one run: it finishes, every mirror equals the masters, and the eval loss fell."""
    shard_flags = [*NANO, "--num-shards", "2", "--min-workers", "1", "--round-timeout", "20"]
    work = [*NANO, "--steps", "240", "--log-every", "24", "--checkpoint-every", "12", "--step-delay", "0.05"]
    with Cluster(tmp_path) as c:
        t0, h0 = c.shard("shard0", "--shard", "0", *shard_flags)
        t1, h1 = c.shard("shard1", "--shard", "1", *shard_flags)
        servers = [t0, t1]

        def at_round(r: int) -> None:
            wait_until(f"round {r}", lambda: http_json(h1)["fragments"][0]["round"] >= r, timeout=180)

        for m in range(2):
            c.worker(f"w{m}", servers, *work, "--rank", str(m))
        at_round(4)
        c.worker("w2", servers, *work, "--rank", "2")  # joins
        at_round(8)
        c.procs["w0"].send_signal(signal.SIGKILL)  # dies, comes back from its last checkpoint
        c.procs["w0"].wait()
        c.worker("w0", servers, *work, "--rank", "0", "--resume")
        at_round(12)
        c.procs["shard0"].send_signal(signal.SIGKILL)  # a shard dies and restarts from its checkpoint
        c.procs["shard0"].wait()
        _, h0 = c.shard("shard0", "--shard", "0", *shard_flags, port=int(t0.rsplit(":", 1)[1]))
        at_round(18)
        c.procs["w1"].send_signal(signal.SIGTERM)  # stops cleanly, resumes
        assert c.procs["w1"].wait(60) == 0
        c.worker("w1", servers, *work, "--rank", "1", "--resume")
        at_round(24)
        c.procs["shard1"].send_signal(signal.SIGTERM)  # a clean shard restart
        assert c.procs["shard1"].wait(60) == 0
        _, h1 = c.shard("shard1", "--shard", "1", *shard_flags, port=int(t1.rsplit(":", 1)[1]))
        for name in ("w0", "w1", "w2"):
            assert c.wait(name, timeout=600) == 0, c.log(name)[-4000:]
        masters = _masters_hashes([h0, h1])
        summaries = [c.summary(n) for n in ("w0", "w1", "w2")]
    for s in summaries:
        assert s["mirror_hashes"] == masters
        assert s["eval_loss"] < summaries[0]["eval_loss_start"] - 1.0
    assert summaries[0]["resumed"] and summaries[1]["resumed"]
    assert summaries[2]["first_step"] > 0
