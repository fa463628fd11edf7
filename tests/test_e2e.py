"""End to end with real processes on loopback: shards and workers as `streamdiloco` processes."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request

import pytest
import torch

from streamdiloco.common.config import ModelSettings, RunSettings, SyncConfig
from streamdiloco.export import fetch_masters
from streamdiloco.sim.simulator import SimConfig, simulate
from streamdiloco.worker.join import SyncError, connect
from streamdiloco.worker.model import build_gpt
from tests.support.procs import shard_process, streamdiloco


def test_two_shards_two_workers_equal_the_simulator_and_mirrors_equal_masters(tmp_path):
    # merges at exactly t + tau, one inner step per schedule step (as the lock-step simulator does whatever
    # the timing): the deterministic merge policy and schedule
    flags = [
        "--model",
        "nano",
        "--steps",
        "36",
        "--sync-every",
        "6",
        "--num-fragments",
        "3",
        "--merge-policy",
        "fixed",
        "--sync-schedule",
        "fixed",
    ]
    out = tmp_path / "run"
    r = streamdiloco("launch", "--shards", "2", "--workers", "2", "--out", str(out), "--save-global", *flags)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "every worker's mirror equals the shards' masters: yes" in r.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mirrors_match_masters"]
    masters = torch.load(out / "masters.pt")
    for m in range(2):  # every worker's mirror equals the shards' masters, bit for bit
        mirror = torch.load(out / f"worker-{m}-global.pt")
        assert all(torch.equal(a, b) for a, b in zip(mirror, masters, strict=True))
    threads = torch.get_num_threads()
    # the threads launch gives each of its 2 workers: the same matmul order, so the same bits
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))
    try:
        sim = simulate(
            SimConfig(
                workers=2,
                run=RunSettings(steps=36),
                model=ModelSettings(model="nano"),
                num_shards=2,
                eval_every=36,
                sync=SyncConfig(sync_every=6, num_fragments=3, merge_policy="fixed", sync_schedule="fixed"),
            ),
            log=None,
        )
    finally:
        torch.set_num_threads(threads)
    assert len(masters) == len(sim["global_params"]) == 3
    for got, want in zip(masters, sim["global_params"], strict=True):
        # same config, seeds and threads: the distributed run equals the lock-step simulator bit for bit
        assert torch.equal(got, want), f"max difference {(got - want).abs().max().item():.3g}"
    assert summary["global_eval_loss"] == pytest.approx(sim["eval_loss"], abs=1e-5)
    for w in summary["workers"]:
        assert w["tokens"] == 36 * 16 * 32  # steps x batch x nano context
        assert w["bytes_sent"] > 0 and w["bytes_received"] == w["bytes_sent"]
    shards = summary["shards"]
    assert [s["shard"] for s in shards] == [0, 1]
    assert sum(s["bytes"]["codec_in"] for s in shards) == sum(w["bytes_sent"] for w in summary["workers"])


def _train(target: str, tau: int, steps: int = 12, step_seconds: float = 0.2):
    torch.manual_seed(0)
    model = build_gpt("nano")
    cfg = SyncConfig(sync_every=6, num_fragments=3, fragment_sync_delay=tau, final_sync=False)
    engine = connect(model, [target], cfg, total_steps=steps, name=f"overlap-tau{tau}")
    try:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        for _ in range(steps):
            x = torch.randint(0, 256, (2, 16))
            _, loss = model(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            time.sleep(step_seconds)  # a slow step: the update has all of it to arrive
            engine.step(tokens=x.numel(), loss=loss.item())
        return engine.merges, engine.waits, engine.blocked_seconds
    finally:
        engine.close()


def test_with_overlap_a_worker_does_not_wait_for_updates_that_arrive_within_tau_steps(tmp_path):
    model_flags = ["--model", "nano", "--sync-every", "6", "--num-fragments", "3"]
    for tau in (0, 1):
        with shard_process(tmp_path, *model_flags, "--fragment-sync-delay", str(tau), name=f"t{tau}") as (
            t,
            _,
            _,
        ):
            merges, waits, blocked = _train(t, tau)
        assert merges == 6 - tau  # 6 sends in 12 steps; with tau=1 the last one would merge at step 13
        if tau == 0:  # the update is needed in the step that sent it: every merge waits for the round trip
            assert waits == merges
        else:  # the update had a whole step to arrive: no merge waits
            assert waits == 0, f"{waits} of {merges} merges waited ({blocked:.3f}s blocked)"
            assert blocked < 0.05


def test_status_reports_members_rounds_and_master_hashes(tmp_path):
    with shard_process(tmp_path, "--model", "nano", "--sync-every", "6", "--num-fragments", "3") as (
        t,
        http,
        _,
    ):
        torch.manual_seed(0)
        model = build_gpt("nano")
        engine = connect(model, [t], SyncConfig(sync_every=6, num_fragments=3), name="w-status")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http}/api/status", timeout=10) as resp:
                status = json.loads(resp.read())
            assert [m["name"] for m in status["members"]] == ["w-status"]
            assert [f["round"] for f in status["fragments"]] == [0, 0, 0]
            from streamdiloco.worker.checkpoint import mirror_digests

            hashes = mirror_digests(engine)
            assert [[f["master_hash"]] for f in status["fragments"]] == hashes
        finally:
            engine.close()


def test_a_worker_with_a_different_model_is_refused_at_join_with_the_difference(tmp_path):
    with shard_process(tmp_path, "--model", "tiny") as (target, _, _):
        r = streamdiloco("worker", "--servers", target, "--model", "nano", "--steps", "2", timeout=120)
        assert r.returncode == 1
        assert "FAILED_PRECONDITION" in r.stderr, r.stderr[-2000:]
        assert "has shape [32] on the worker, [128] on the shard" in r.stderr
        with pytest.raises(SyncError, match="sync_every is 7 on the worker, 30 on the shard"):
            connect(build_gpt("tiny"), [target], SyncConfig(sync_every=7, num_fragments=1), name="w-h")


def test_a_shard_started_from_saved_parameters_serves_them(tmp_path):
    from streamdiloco.common.fragments import build_layout, flatten, fragment_params
    from streamdiloco.export import fetch_masters

    torch.manual_seed(123)  # not the run's seed: the shard's factory alone would give other values
    model = build_gpt("nano")
    torch.save(model.state_dict(), tmp_path / "init.pt")
    layout = build_layout(model, 3)
    want = [flatten(fragment_params(model, f)) for f in layout.fragments]
    flags = [
        "--model",
        "nano",
        "--sync-every",
        "6",
        "--num-fragments",
        "3",
        "--init",
        str(tmp_path / "init.pt"),
    ]
    with shard_process(tmp_path, *flags) as (target, _, _):
        got = fetch_masters([target])
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    torch.save({"nope": torch.zeros(1)}, tmp_path / "bad.pt")
    r = streamdiloco("server", "--model", "nano", "--init", str(tmp_path / "bad.pt"), timeout=120)
    assert r.returncode == 2 and "does not fit the model" in r.stderr, r.stderr


def test_a_worker_joins_a_run_in_progress_at_the_runs_step_and_stays_in_sync(tmp_path):
    # the fixed schedule: one inner step is one schedule step for both workers, whatever the machine's load
    # (under the adaptive one a worker faster than the pace takes two inner steps for one, and the 12 steps
    # below can end a schedule step short of the other's push: the round then waits for its deadline)
    flags = ["--model", "nano", "--sync-every", "6", "--num-fragments", "3", "--sync-schedule", "fixed"]
    with shard_process(tmp_path, *flags) as (target, http, _):
        cfg = SyncConfig(sync_every=6, num_fragments=3, final_sync=False, sync_schedule="fixed")
        first = connect(build_gpt("nano"), [target], cfg, name="first")
        second = None
        try:
            for _ in range(3):  # fragment 1 is sent at step 2 and its round closes (min_workers 1)
                first.step(tokens=1)
            torch.manual_seed(1)
            joiner_model = build_gpt("nano")  # other initial values: the joiner must take the global ones
            second = connect(joiner_model, [target], cfg, name="second")
            # the latest send was fragment 1's round 0 at step 2, closed: the next send is at step 4, and
            # the joiner starts just before it, with its parameters and mirror equal to the masters
            assert second.step_count == 3
            assert all(torch.equal(a, b) for a, b in zip(second.mirrors, first.mirrors, strict=True))
            for _ in range(12):  # steps 4..15: both push every round from here on
                second_thread = threading.Thread(target=second.step, kwargs={"tokens": 1})
                second_thread.start()
                first.step(tokens=1)
                second_thread.join(60)
            status = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{http}/api/status").read())
            assert {m["name"] for m in status["members"]} == {"first", "second"}
            rounds = status["recent_rounds"]
            after = {
                (r["fragment"], r["round"]): r
                for r in rounds
                if r["closed_at"] and "second" in r["contributors"]
            }
            # the joiner's first push went into the next round: fragment 2's round 0 (step 4), with both, and
            # none before it (closes of different fragments run side by side: they may end in either order)
            assert (1, 0) not in after and after[2, 0]["contributors"] == ["first", "second"]
            first.drain()
            second.drain()
            masters = fetch_masters([target])
            for engine in (first, second):
                assert all(torch.equal(a, b) for a, b in zip(engine.mirrors, masters, strict=True))
        finally:
            first.close()
            if second is not None:
                second.close()


def test_a_worker_that_starts_late_at_the_start_of_a_run_still_does_every_step(tmp_path):
    # --min-workers 2: the first worker's push of fragment 1's round 0 (step 2) waits for the second one
    flags = ["--model", "nano", "--sync-every", "6", "--num-fragments", "3", "--min-workers", "2"]
    with shard_process(tmp_path, *flags) as (target, http, _):
        cfg = SyncConfig(sync_every=6, num_fragments=3, final_sync=False)
        first = connect(build_gpt("nano"), [target], cfg, name="first")
        second = None
        try:
            ahead = threading.Thread(target=lambda: [first.step(tokens=1) for _ in range(3)])
            ahead.start()  # steps 1, 2 (pushes fragment 1's round 0), 3 (waits for that round's update)
            deadline = time.monotonic() + 30
            while not json.loads(urllib.request.urlopen(f"http://127.0.0.1:{http}/api/status").read())[
                "fragments"
            ][1]["contributors"]:
                assert time.monotonic() < deadline, "the first worker's push never arrived"
                time.sleep(0.05)
            second = connect(build_gpt("nano"), [target], cfg, name="second")
            assert (
                second.step_count == 0
            )  # no round has closed: it does every step, as if it had been on time
            for _ in range(3):
                second.step(tokens=1)
            ahead.join(30)
            assert not ahead.is_alive() and first.step_count == second.step_count == 3
            assert all(torch.equal(a, b) for a, b in zip(first.mirrors, second.mirrors, strict=True))
        finally:
            first.close()
            if second is not None:
                second.close()
