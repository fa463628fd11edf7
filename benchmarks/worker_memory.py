"""What a worker holds in memory beside its model: the engine's mirror, the snapshot taken at each send, the
outer gradient's buffer, the encoded pushes kept until answered, the gRPC sessions.

For each model, one process builds it with AdamW and trains a step (the baseline: what any trainer holds),
then joins a real shard process with connect() and does 2*H inner steps (every fragment sent and merged
at least once, so every buffer exists). Its resident memory (RSS) is read at both points; the table shows
the difference in MB and in bytes per parameter, beside the engine's own tensors counted one by one.

    python -m benchmarks.worker_memory                     # nano, tiny, small and the 10M GPT-2 config
    python -m benchmarks.worker_memory --models tiny
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.harness import ROOT, Procs, machine, machine_line, start_shards

MODELS = ("nano", "tiny", "small", "hf:examples/gpt2-10m")
SYNC = ["--sync-every", "6", "--num-fragments", "3"]

CHILD = r"""
import json, os, sys, torch
from benchmarks.harness.procfs import status_kib
from streamdiloco.common.modelspec import build_model
from streamdiloco.worker.join import connect

def rss() -> int:
    return status_kib(os.getpid())["VmRSS"] * 1024

spec, target = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
model = build_model(spec)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
def step():
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)
step()
params = sum(p.numel() for p in model.parameters())
before = rss()
engine = connect(model, target, total_steps=1000, name="memory")
for _ in range(12):
    step()
    engine.step(tokens=1)
after = rss()
held = {
    "mirror": sum(f.mirror.numel() * f.mirror.element_size() for f in engine.fragments),
    "snapshot": sum(f.snapshot.numel() * 4 for f in engine.fragments if f.snapshot is not None),
    "delta": sum(f._delta.numel() * 4 for f in engine.fragments if f._delta is not None),
}
engine.close()
print(json.dumps({"params": params, "before": before, "after": after, "held": held}))
"""


def measure(spec: str, tmp: Path) -> dict:
    procs = Procs(tmp)
    try:
        [(_, _, ports)] = start_shards(procs, tmp, "mem", 1, ["--model", spec, *SYNC, "--min-workers", "1"])
        target = f"127.0.0.1:{ports['grpc_port']}"
        r = subprocess.run(
            [sys.executable, "-c", CHILD, spec, target], capture_output=True, text=True, timeout=900, cwd=ROOT
        )  # from the root: the child imports the harness
        if r.returncode != 0:
            raise RuntimeError(f"{spec}: {r.stderr[-2000:]}")
        return json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        procs.stop_all()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated model specs")
    args = p.parse_args()
    print(machine_line(machine()))
    # the first model's growth is mostly fixed (numba's compiled codecs, gRPC's threads and buffers): the
    # per-parameter cost of the others is their growth beyond it
    head = f"{'model':<22} {'params':>11} {'RSS +MB':>9} {'beyond fixed B/param':>21}"
    print(f"{head} {'engine tensors B/param':>23}")
    fixed = None
    for spec in args.models.split(","):
        with tempfile.TemporaryDirectory() as d:
            m = measure(spec, Path(d))
        grew, n = m["after"] - m["before"], m["params"]
        fixed = grew if fixed is None else fixed
        beyond = "" if grew is fixed else f"{(grew - fixed) / n:.1f}"
        held = sum(m["held"].values())
        print(f"{spec:<22} {n:>11,} {grew / 2**20:>9.1f} {beyond:>21} {held / n:>23.1f}", flush=True)


if __name__ == "__main__":
    main()
