"""A worker that is a process group (torchrun): its ranks train as one worker, in step, equal to one rank
with the whole batch; a rank that dies takes the worker down. Real shard processes, real rank processes."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from streamdiloco.common.ports import free_port
from tests.support.procs import ROOT, Cluster, masters_hashes, wait_until

# fp32 codecs: the 4-bit ones round, and a round-off difference may move a value to the next level
RUN = [
    *("--model", "nano", "--sync-every", "4", "--num-fragments", "2", "--merge-policy", "fixed"),
    *("--uplink-codec", "fp32", "--downlink-codec", "fp32"),
]
WORKER = ["--eval-every", "0", "--eval-batches", "1", "--log-every", "4"]


def torchrun(c: Cluster, name: str, nproc: int, servers: list[str], *flags: str) -> subprocess.Popen:
    """`torchrun --nproc-per-node N -m streamdiloco worker ...`: a worker of N ranks; output in NAME.log."""
    log = open(c.tmp / f"{name}.log", "a")  # noqa: SIM115 (the child holds it)
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
        + ["--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--monitor-interval", "0.1"]
        + ["-m", "streamdiloco", "worker", "--servers", ",".join(servers), "--name", "site"]
        + ["--summary", str(c.tmp / f"{name}.json"), "--checkpoint", str(c.tmp / f"{name}.pt"), *flags],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env=c.env,
        start_new_session=True,  # its own process group: the Cluster kills the ranks with it, however it ends
    )
    proc.own_session = True  # type: ignore[attr-defined]
    log.close()
    c.procs[name] = proc
    return proc


# in `make test-slow` (torchrun, two ranks and a one-rank run to compare); covered by
# test_the_library_a_ddp_model_joins_with_connect_group_and_connect_says_so (two ranks, one worker) and
# test_the_ranks_slices_make_the_workers_batch_and_collective_errors_are_told_apart
@pytest.mark.slow
def test_a_two_rank_worker_equals_one_rank_with_the_whole_batch_and_its_mirror_equals_the_masters(tmp_path):
    steps = ["--steps", "12", *WORKER]
    results = {}
    for name, nproc, batch in (("two", 2, 4), ("one", 1, 8)):
        with Cluster(tmp_path) as c:
            shards = [c.shard(f"{name}-s{i}", "--shard", str(i), "--num-shards", "2", *RUN) for i in range(2)]
            servers = [t for t, _ in shards]
            flags = [*steps, *RUN, "--batch-size", str(batch), "--save-global", str(tmp_path / f"{name}.pt")]
            if nproc == 1:
                c.worker(name, servers, "--name", "site", *flags)
            else:
                torchrun(c, name, nproc, servers, *flags)
            assert c.wait(name, timeout=240) == 0, c.log(name)[-3000:]
            summary = c.summary(name)
            assert summary["mirror_hashes"] == masters_hashes([h for _, h in shards])
            results[name] = summary
    two, one = results["two"], results["one"]
    assert two["ranks"] == 2 and one["ranks"] == 1
    rank1 = json.loads((tmp_path / "two.json.rank1").read_text())
    assert rank1["params_hash"] == two["params_hash"]  # every rank holds rank 0's parameters
    assert rank1["optimizer_hash"] == two["optimizer_hash"]  # and had the same gradients at every step
    assert two["tokens"] == one["tokens"] == 12 * 8 * 32  # the ranks' slices make the one rank's batch
    assert two["bytes_sent"] == one["bytes_sent"]  # one copy of each fragment crosses the WAN
    assert two["group_broadcast_bytes"] > 0
    a, b = torch.load(tmp_path / "two.pt"), torch.load(tmp_path / "one.pt")
    for x, y in zip(a, b, strict=True):
        # the same steps on the same data, the gradients averaged in another order: fp32 round-off apart
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6)  # measured: 1.5e-8 after 12 steps
    assert two["eval_loss"] == pytest.approx(one["eval_loss"], abs=1e-5)


# 6 processes (2 shards, torchrun and its 2 ranks, a slow worker): in `make test-slow`. `make test` covers its
# two halves: the adaptive schedule's fast site taking more inner steps with real processes
# (test_unequal_speed.py::test_two_sites_one_twice_as_slow_the_fast_one_keeps_computing) and a two-rank
# worker whose ranks stay equal (test_a_two_rank_worker_equals_one_rank_with_the_whole_batch_...)
@pytest.mark.slow
def test_a_fast_two_rank_site_takes_more_inner_steps_in_step_with_its_ranks(tmp_path):
    """--sync-schedule adaptive: the group's rank 0 decides how many inner steps make a schedule step, and
    its other rank follows that count (the lr, the end of the run), so the ranks stay equal."""
    work = [*RUN, "--steps", "16", *WORKER, "--checkpoint-every", "0"]
    with Cluster(tmp_path) as c:
        shard = [*RUN, "--sync-schedule", "adaptive", "--min-workers", "2", "--num-shards", "2"]
        shards = [c.shard(f"s{i}", *shard, "--shard", str(i)) for i in range(2)]
        servers = [t for t, _ in shards]
        torchrun(c, "site", 2, servers, *work, "--batch-size", "4", "--step-delay", "0.05")
        c.worker("slow", servers, *work, "--name", "slow", "--batch-size", "8", "--step-delay", "0.2")
        for name in ("site", "slow"):
            assert c.wait(name, timeout=240) == 0, c.log(name)[-3000:]
        site, slow = c.summary("site"), c.summary("slow")
        masters = masters_hashes([h for _, h in shards])
    assert site["steps"] == slow["steps"] == 16
    assert site["inner_steps"] > slow["inner_steps"], (site["inner_steps"], slow["inner_steps"])
    rank1 = json.loads((tmp_path / "site.json.rank1").read_text())
    assert rank1["params_hash"] == site["params_hash"] and rank1["optimizer_hash"] == site["optimizer_hash"]
    assert site["mirror_hashes"] == slow["mirror_hashes"] == masters


def rank_pid(launcher: subprocess.Popen, rank: int) -> int:
    """The pid of torchrun's child with RANK=rank (read from its environment)."""
    for child in open(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read().split():
        try:
            env = open(f"/proc/{child}/environ", "rb").read().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        if f"RANK={rank}".encode() in env:
            return int(child)
    raise AssertionError(f"no rank {rank} among torchrun's children")


@pytest.mark.slow
def test_a_rank_that_dies_takes_the_worker_down_and_it_resumes_from_its_checkpoint(tmp_path):
    flags = [*RUN, "--steps", "40", "--checkpoint-every", "4", *WORKER]
    with Cluster(tmp_path) as c:
        shards = [c.shard(f"s{i}", "--shard", str(i), "--num-shards", "2", *RUN) for i in range(2)]
        servers = [t for t, _ in shards]
        launcher = torchrun(c, "site", 2, servers, *flags, "--batch-size", "4", "--step-delay", "0.1")
        wait_until("the first checkpoint", (tmp_path / "site.pt").exists, timeout=120)
        os.kill(rank_pid(launcher, 1), signal.SIGKILL)
        code = c.wait("site", timeout=60)  # no hang: rank 0 stops at its next collective
        assert code != 0
        out = c.log("site")
        assert "streamdiloco: error: rank 0 of 2: the worker's process group broke" in out, out[-3000:]
        assert "Traceback" not in out.split("streamdiloco: error:")[0]  # the worker's own lines: no traceback
        # the site resumes with 1 rank of twice the batch: the worker's batch is what the checkpoint holds
        c.worker("site", servers, *flags, "--batch-size", "8", "--auto-resume")
        assert c.wait("site", timeout=240) == 0, c.log("site")[-3000:]
        summary = c.summary("site")
        assert summary["resumed"] and summary["first_step"] >= 4 and summary["ranks"] == 1
        assert summary["mirror_hashes"] == masters_hashes([h for _, h in shards])


def test_torchruns_environment_is_checked_with_one_line_errors(monkeypatch):
    from streamdiloco.worker.group import group_from_env

    for name in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert group_from_env("cpu", 60) == (None, "cpu")  # not started by torchrun: a one-process worker
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert group_from_env("cpu", 60) == (None, "cpu")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ValueError, match=r"^RANK=2 with WORLD_SIZE=2: start the ranks with torchrun$"):
        group_from_env("cpu", 60)
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ValueError, match=r"^WORLD_SIZE=2 but MASTER_ADDR is not set"):
        group_from_env("cpu", 60)
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match=r"^the environment's WORLD_SIZE='two' is not an integer$"):
        group_from_env("cpu", 60)


def test_the_ranks_slices_make_the_workers_batch_and_collective_errors_are_told_apart():
    from streamdiloco.worker.group import RankGroup, _why, batch_slice, is_collective_error

    x = torch.arange(24).view(8, 3)
    groups = [RankGroup(rank=r, size=4, src=0, device=torch.device("cpu")) for r in range(4)]
    assert torch.equal(torch.cat([batch_slice(x, g) for g in groups]), x)
    assert batch_slice(x, None) is x
    with pytest.raises(ValueError, match="^a batch of 8 rows does not split over 3 ranks"):
        batch_slice(x, RankGroup(rank=0, size=3, src=0, device=torch.device("cpu")))
    gloo = RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:51110. This is typically caused by a remote worker crashing."
    )
    assert is_collective_error(gloo) and _why(gloo) == "Connection closed by peer [127.0.0.1]:51110"
    assert not is_collective_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    with pytest.raises(ValueError, match="model's"), groups[1].guard("step 3"):
        raise ValueError("the model's own error passes through")
    with pytest.raises(Exception, match=r"^rank 1 of 4: the worker's process group broke during step 3 \("):
        with groups[1].guard("step 3"):
            raise gloo


def test_rank_timeout_must_be_positive(capsys):
    from streamdiloco.cli import main

    assert main(["worker", "--servers", "127.0.0.1:7070", "--rank-timeout", "0"]) == 2
    err = capsys.readouterr().err
    assert err == "streamdiloco: error: --rank-timeout must be positive seconds, got 0.0\n"


@pytest.mark.slow
def test_sigterm_to_torchrun_stops_every_rank_after_the_step_with_a_checkpoint_and_it_resumes(tmp_path):
    flags = [*RUN, "--steps", "40", "--batch-size", "4", "--checkpoint-every", "0", *WORKER]
    with Cluster(tmp_path) as c:
        shards = [c.shard(f"s{i}", "--shard", str(i), "--num-shards", "2", *RUN) for i in range(2)]
        servers = [t for t, _ in shards]
        launcher = torchrun(c, "site", 2, servers, *flags, "--step-delay", "0.1")
        wait_until("step 8", lambda: "site step 8/40" in c.log("site"), timeout=120)
        launcher.send_signal(signal.SIGTERM)
        c.wait("site", timeout=60)  # torchrun itself exits non-zero on a signal, whatever its ranks did
        assert "site: stopped at step" in c.log("site"), c.log("site")[-3000:]
        stopped = c.summary("site")["stopped_at_step"]
        assert 8 <= stopped < 40
        rank1 = json.loads((tmp_path / "site.json.rank1").read_text())
        assert rank1["stopped_at_step"] == stopped  # the group stopped together, after the same step
        torchrun(c, "site", 2, servers, *flags, "--auto-resume")
        assert c.wait("site", timeout=240) == 0, c.log("site")[-3000:]
        summary = c.summary("site")
        assert summary["resumed"] and summary["first_step"] == stopped
        assert summary["mirror_hashes"] == masters_hashes([h for _, h in shards])
        rank1 = json.loads((tmp_path / "site.json.rank1").read_text())
        assert rank1["params_hash"] == summary["params_hash"]


def test_the_library_a_ddp_model_joins_with_connect_group_and_connect_says_so(tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from streamdiloco.common.config import SyncConfig
    from streamdiloco.worker.group import batch_slice, connect_group
    from streamdiloco.worker.join import connect
    from streamdiloco.worker.model import build_gpt
    from tests.support.procs import shard_process

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)  # a group of one rank, in-process
    try:
        flags = ["--model", "nano", "--sync-every", "4", "--num-fragments", "2"]
        with shard_process(tmp_path, *flags) as (t, http, _):
            torch.manual_seed(0)
            model = DistributedDataParallel(build_gpt("nano"))
            cfg = SyncConfig(sync_every=4, num_fragments=2)
            with pytest.raises(ValueError, match=r"^a DistributedDataParallel-wrapped model .*connect_group"):
                connect(model, [t], cfg, name="lib")
            engine = connect_group(model, [t], cfg, total_steps=8, name="lib")
            try:
                assert engine.size == 1 and engine.engine is not None
                opt = torch.optim.SGD(model.parameters(), lr=1e-2)
                for _ in range(8):
                    x = batch_slice(torch.randint(0, 256, (4, 32)), engine.group)
                    _, loss = model(x, x)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    engine.step(tokens=x.numel(), loss=loss.item())
                engine.drain()
                assert engine.engine.pushes == 8 // 2 + 1  # a fragment every 2 steps, and the final sync
                from streamdiloco.worker.checkpoint import mirror_digests

                assert mirror_digests(engine.engine) == masters_hashes([http])
            finally:
                engine.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_the_ddp_example_trains_as_one_worker_of_two_ranks(tmp_path):
    from tests.support.procs import shard_process

    flags = ["--model", "examples.own_loop:build", "--sync-every", "12", "--num-fragments", "3"]
    with shard_process(tmp_path, *flags) as (target, _, _):
        r = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr"]
            + ["127.0.0.1", "--master-port", str(free_port()), "-m", "examples.ddp_loop"]
            + ["--servers", target, "--steps", "120"],
            capture_output=True,
            text=True,
            timeout=180,
            cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    assert r.returncode == 0, r.stdout + r.stderr
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", r.stdout)]
    assert len(losses) >= 3 and losses[-1] < 0.5 * losses[0], r.stdout
    assert r.stdout.count("done:") == 1  # rank 0 alone speaks for the worker
    pushes = int(re.search(r"in (\d+) pushes", r.stdout).group(1))
    assert pushes == 120 // 12 * 3 + 3 - 1  # as examples/own_loop.py's one-process worker


@pytest.mark.slow
def test_a_rank_that_hangs_takes_the_worker_down_at_the_rank_timeout(tmp_path):
    flags = [*RUN, "--steps", "400", "--batch-size", "4", "--checkpoint-every", "4", *WORKER]
    with Cluster(tmp_path) as c:
        shards = [c.shard(f"s{i}", "--shard", str(i), "--num-shards", "2", *RUN) for i in range(2)]
        launcher = torchrun(c, "site", 2, [t for t, _ in shards], *flags, "--rank-timeout", "15")
        wait_until("the first checkpoint", (tmp_path / "site.pt").exists, timeout=120)
        hung = rank_pid(launcher, 1)
        os.kill(hung, signal.SIGSTOP)  # alive, but never at the next collective
        try:
            assert c.wait("site", timeout=90) != 0  # rank 0 gives up after 15 s; torchrun ends rank 1
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(hung, signal.SIGCONT)
        out = c.log("site")
        assert "streamdiloco: error: rank 0 of 2: the worker's process group broke" in out, out[-3000:]
