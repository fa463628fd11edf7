"""A worker that is a process group (torchrun): its ranks train as one worker, in step, equal to one rank
with the whole batch; a rank that dies takes the worker down. Real shard processes, real rank processes."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
import torch
from procs import ROOT, Cluster, http_json

# fp32 codecs: the 4-bit ones round, and a round-off difference may move a value to the next level
RUN = [
    *("--model", "nano", "--sync-every", "4", "--num-fragments", "2", "--merge-policy", "fixed"),
    *("--uplink-codec", "fp32", "--downlink-codec", "fp32"),
]
WORKER = ["--eval-every", "0", "--eval-batches", "1", "--log-every", "4"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    )
    log.close()
    c.procs[name] = proc
    return proc


def masters_hashes(http: list[int]) -> list[list[str]]:
    """[fragment][shard] master hashes, as the workers' summaries list their mirrors'."""
    per_shard = [[f["master_hash"] for f in http_json(p)["fragments"]] for p in http]
    return [list(x) for x in zip(*per_shard, strict=True)]


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
    assert two["tokens"] == one["tokens"] == 12 * 8 * 32  # the ranks' slices make the one rank's batch
    assert two["bytes_sent"] == one["bytes_sent"]  # one copy of each fragment crosses the WAN
    assert two["group_broadcast_bytes"] > 0
    a, b = torch.load(tmp_path / "two.pt"), torch.load(tmp_path / "one.pt")
    for x, y in zip(a, b, strict=True):
        # the same steps on the same data, the gradients averaged in another order: fp32 round-off apart
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6)  # measured: 1.5e-8 after 12 steps
    assert two["eval_loss"] == pytest.approx(one["eval_loss"], abs=1e-5)
