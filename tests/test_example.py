"""The README's library example: a user's own model and loop, synced through a real shard process."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.support.procs import ROOT, shard_process


def test_own_model_and_loop_train_through_a_shard(tmp_path):
    flags = ["--model", "examples.own_loop:build", "--sync-every", "12", "--num-fragments", "3"]
    with shard_process(tmp_path, *flags) as (target, _, _):
        r = subprocess.run(
            [sys.executable, "examples/own_loop.py", "--servers", target, "--steps", "120", "--name", "ex"],
            capture_output=True,
            text=True,
            timeout=180,
            cwd=ROOT,
        )
    assert r.returncode == 0, r.stdout + r.stderr
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", r.stdout)]
    assert len(losses) >= 3 and losses[-1] < 0.5 * losses[0], r.stdout
    pushes = int(re.search(r"in (\d+) pushes", r.stdout).group(1))
    assert pushes == 120 // 12 * 3 + 3 - 1  # every H/P steps one fragment, plus the final sync of all
