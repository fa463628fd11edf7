"""scripts/gpu-check.py, the prepared check for a CUDA machine: its dry run (the same parts on the CPU at toy
sizes, the CUDA tests skipping) writes every part's JSON and the summary, so that the script cannot rot
between the rare sessions that have a GPU; a part that fails or runs out of time is recorded and the next
one runs."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

from tests.support.procs import ROOT, wait_until

SCRIPT = ROOT / "scripts" / "gpu-check.py"


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_dry_run_writes_every_part_and_the_summary(tmp_path):
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    names = ("header", "tests", "utilization", "codecs", "quality")
    # what the device tool brings back: at most 8 files, none in a subfolder
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [f"{n}.json" for n in names] + ["summary.md", "run.log"]
    )
    parts = {n: json.loads((out / f"{n}.json").read_text()) for n in names}
    for name, part in parts.items():
        assert part["status"] == "ok" and part["part"] == name and part["seconds"] <= part["limit"], part
    assert parts["header"]["torch"] and parts["header"]["cuda_available"] is False
    counts = parts["tests"]["counts"]  # the CUDA tests exist and skip here
    assert counts["skipped"] >= 10 and counts["passed"] == counts["failure"] == counts["error"] == 0
    assert any("test_device" in c["test"] for c in parts["tests"]["cases"])
    (row,) = parts["utilization"]["rows"]
    assert row["status"] == "ok" and row["tau"] == 2 and row["utilization"] > 0 and row["step_ms"] > 0
    assert row["send_median_ms"] is not None and row["merge_median_ms"] is not None
    codecs = parts["codecs"]
    from benchmarks.codecs import CODECS  # every codec of the speed table, top-k's included

    assert [r["codec"] for r in codecs["rows"]] == list(CODECS) and "topk64_4096" in CODECS
    assert codecs["copy"] > 0
    assert set(codecs["rows"][0]["x_copy"]) == {"encode", "decode", "add_into", "accumulate"}
    (q,) = parts["quality"]["rows"]
    assert (
        q["M"] == 4
        and q["best_dp"] > 0
        and q["best_full"] > 0
        and parts["quality"]["picked"]["model"] == "nano"
    )
    md = (out / "summary.md").read_text()
    assert md.startswith("# GPU check (DRY RUN")
    for name in names:
        assert f"| {name} | ok |" in md
    assert "## Compute utilization with real steps" in md and "| toy (nano) |" in md
    assert "## Codecs against a device-to-device copy" in md and "## Quality at M = 4" in md


def test_a_failing_part_is_recorded_and_the_next_one_runs(tmp_path, monkeypatch):
    gc = load_script()

    def broken(run, plan, deadline, tmp):
        raise RuntimeError("a bug in the part")

    def failed(run, plan, deadline, tmp):
        code, out = run([sys.executable, "-c", "print('what it said'); raise SystemExit(3)"], deadline)
        gc.check(code, out, "the thing")

    def fine(run, plan, deadline, tmp):
        return {"headline": "all good"}

    monkeypatch.setattr(gc, "PART_FUNCS", {"header": broken, "tests": failed, "utilization": fine})
    out = tmp_path / "out"
    assert gc.main(["--out", str(out), "--dry-run", "--parts", "header,tests,utilization"]) == 1
    header, tests, util = (
        json.loads((out / f"{n}.json").read_text()) for n in ("header", "tests", "utilization")
    )
    assert header["status"] == "error: RuntimeError: a bug in the part"
    assert tests["status"] == "failed (exit 3): the thing" and "what it said" in tests["output_tail"]
    assert util["status"] == "ok" and util["headline"] == "all good"
    md = (out / "summary.md").read_text()
    assert "| tests | failed (exit 3): the thing |" in md and "| utilization | ok |" in md
    assert "what it said" in md  # the failed part's output, under its own heading
    assert "what it said" in (out / "run.log").read_text()


def test_a_command_past_its_deadline_is_killed_with_its_children(tmp_path):
    gc = load_script()
    run = gc.Runner(tmp_path, {"PATH": "/usr/bin:/bin"})
    t0 = time.monotonic()
    child = (
        "import subprocess, time; p = subprocess.Popen(['sleep', '60']); print(p.pid, flush=True); "
        "time.sleep(60)"
    )
    code, out = run([sys.executable, "-c", child], time.monotonic() + 3)
    assert code == 124 and "killed after" in out
    assert time.monotonic() - t0 < 20
    grandchild = Path(f"/proc/{int(out.split()[0])}/stat")
    wait_until(
        "the grandchild to be gone", lambda: not grandchild.exists() or ") Z " in grandchild.read_text()
    )


def test_the_package_is_laid_out_for_a_python_that_has_not_installed_it(tmp_path, monkeypatch):
    gc = load_script()
    monkeypatch.setattr(gc.importlib.util, "find_spec", lambda name: None)
    env = gc.package_env(tmp_path)
    first = Path(env["PYTHONPATH"].split(":")[0])
    assert (first / "streamdiloco" / "worker" / "engine.py").is_file()
    assert (first / "streamdiloco" / "cli.py").is_file() or (first / "streamdiloco" / "__init__.py").is_file()
    r = subprocess.run(
        [sys.executable, "-I", "-c", "import sys; sys.path[:0] = sys.argv[1].split(':'); "
         "import streamdiloco.worker.engine as e; print(e.__file__)", env["PYTHONPATH"]],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert str(first) in r.stdout
