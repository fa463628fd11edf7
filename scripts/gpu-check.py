#!/usr/bin/env python3
"""The one prepared check for a CUDA machine (issue 29): everything the project has to prove on a GPU, in
one call of about 8 minutes, every result under one folder.

Parts, in order, each a subprocess with its own time limit; a part that fails or runs out of time is
recorded (its status and the tail of its output) and the next one runs:
  header       nvidia-smi, Python, torch and its CUDA, the GPU, the commit
  tests        the CUDA tests, `-k cuda`: tests/test_device.py's, tests/test_codecs.py's, tests/test_topk.py's
  utilization  benchmarks/sync_cost.py with REAL training steps: the built-in GPT at ~100M (`large`) and
               ~300M (benchmarks.sync_cost:gpt_300m) parameters on the GPU, two shard processes on the same
               machine, tau = 1 and 2; utilization against the same steps with no sync, and the training
               thread's time per send and merge step
  codecs       benchmarks/codecs.py --device cuda: encode, decode, add_into, accumulate against a
               device-to-device copy
  quality      benchmarks/quality_long.py on the simulator, in one process on the GPU: data-parallel against
               the full method at M = 4, 20 tokens per parameter, each at the best of a small lr grid, at
               the largest built-in size whose runs fit the part's time (timed here first: `pick`)
Writes OUT/header.json, tests.json, utilization.json, codecs.json, quality.json (each with "status" and
"seconds"), OUT/summary.md (the table of all of them, then each part's own tables) and OUT/run.log (every
subprocess's output): seven files, what the device tool brings back.

    python scripts/gpu-check.py --out DIR                    # on the GPU machine (docs/gpu-check.md)
    python scripts/gpu-check.py --out DIR --parts codecs,quality   # again, some parts only
    python scripts/gpu-check.py --out DIR --dry-run          # the same on the CPU at toy sizes, in seconds

Where the package is not installed (the GPU machine's own Python, see docs/gpu-check.md), it is laid out as
a tree of symlinks (scripts/typecheck.py's) and put on PYTHONPATH for every part.
It must not change what it measures: each part is an existing test file or benchmark, run as a user would.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import resource
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("header", "tests", "utilization", "codecs", "quality")
PY = sys.executable


@dataclass(frozen=True)
class Plan:
    """What each part runs: the GPU's sizes or the dry run's toy ones."""

    device: str
    limits: dict[str, float]  # seconds per part
    util_models: tuple[tuple[str, str, int], ...]  # (label, model spec, batch)
    util_taus: str = "1,2"
    util_shards: int = 2
    util_h_p: tuple[int, int] = (30, 5)  # H, P (sync_cost's defaults)
    util_cycles: tuple[int, int] = (3, 1)  # H-step cycles per case, of which warm-up
    baseline_steps: int = 10
    codec_values: str = "64M"
    codec_repeats: int = 5
    quality_candidates: tuple[str, ...] = ("small", "tiny", "nano")  # the largest first
    quality_workers: int = 4
    quality_tpp: float = 20.0
    quality_lrs: tuple[float, ...] = (1.5e-3, 5e-3)  # the lr grid of each method (the first: --lr)
    env: tuple[tuple[str, str], ...] = ()  # for every part's processes


GPU = Plan(
    device="cuda",
    # 460 s in all: with the machine's start and the wheels, a call takes about 10 of a lease's 15 minutes
    limits={"header": 20, "tests": 80, "utilization": 140, "codecs": 30, "quality": 190},
    util_models=(("100M", "large", 32), ("300M", "benchmarks.sync_cost:gpt_300m", 16)),
)
DRY = Plan(
    device="cpu",
    # generous: the dry run checks that every part works, not how fast (a busy 2-core machine is slow)
    limits={"header": 60, "tests": 120, "utilization": 180, "codecs": 60, "quality": 180},
    util_models=(("toy", "nano", 2),),
    util_taus="2",
    util_shards=1,
    util_h_p=(4, 2),
    util_cycles=(2, 1),
    baseline_steps=2,
    codec_values="64K",
    codec_repeats=1,
    quality_candidates=("nano",),
    quality_tpp=0.1,
    quality_lrs=(1.5e-3,),
    # one thread per process, as the tests' processes (on 2 cores, torch's threads of several processes
    # spinning against each other make a toy step take a second); the codecs as the torch ops that CUDA
    # runs (no numba: a few seconds less of imports and compiles)
    env=(("OMP_NUM_THREADS", "1"), ("MKL_NUM_THREADS", "1"), ("STREAMDILOCO_CODECS_NUMBA", "0")),
)


# --- running a part's commands ------------------------------------------------------------------------------
class Runner:
    """Runs commands in the repository's root with a deadline, keeps their output for run.log."""

    def __init__(self, out: Path, env: dict[str, str]):
        self.log = (out / "run.log").open("a", encoding="utf-8")
        self.env = env

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")
        self.log.flush()

    def __call__(
        self, argv: list[str], deadline: float, env: dict[str, str] | None = None
    ) -> tuple[int, str]:
        """(exit status, output); status 124 when it ran past the deadline (killed with its children)."""
        self.say(f"$ {shlex.join(argv)}")
        timeout = max(1.0, deadline - time.monotonic())
        try:
            proc = subprocess.Popen(
                argv,
                cwd=ROOT,
                env={**self.env, **(env or {})},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,  # its own process group: a timeout stops the shards it started too
            )
        except OSError as e:  # no such program (nvidia-smi, git)
            self.say(f"[gpu-check] not run: {e}")
            return 127, f"not run: {e}"
        try:
            out, _ = proc.communicate(timeout=timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(10)
                    break
                except subprocess.TimeoutExpired:
                    continue
            out, _ = proc.communicate()
            code = 124
            out += f"\n[gpu-check] killed after {timeout:.0f} s (the part's time limit)\n"
        self.log.write(out)
        self.log.flush()
        return code, out


class PartFailed(Exception):
    """A part's command failed: its status line and the tail of its output."""

    def __init__(self, status: str, output: str = ""):
        super().__init__(status)
        self.status, self.output = status, output


def check(code: int, out: str, what: str) -> None:
    if code == 124:
        raise PartFailed(f"timed out: {what}", out)
    if code != 0:
        raise PartFailed(f"failed (exit {code}): {what}", out)


# --- the parts ----------------------------------------------------------------------------------------------
def part_header(run: Runner, plan: Plan, deadline: float, tmp: Path) -> dict:
    res: dict[str, Any] = {"python": platform.python_version(), "machine": platform.platform()}
    res["cpus"] = os.cpu_count()
    code, out = run(["nvidia-smi"], deadline)
    res["nvidia_smi"] = out.strip()
    probe = (
        "import json, torch; c = torch.cuda.is_available(); print(json.dumps({'torch': torch.__version__, "
        "'cuda': torch.version.cuda, 'cudnn': torch.backends.cudnn.version(), 'cuda_available': c, "
        "'gpu': torch.cuda.get_device_name(0) if c else None, "
        "'capability': list(torch.cuda.get_device_capability(0)) if c else None, "
        "'gpu_memory_gib': round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) "
        "if c else None, "
        "'nccl': str(torch.cuda.nccl.version()) if c else None}))"
    )
    code, out = run([PY, "-c", probe], deadline)
    check(code, out, "torch's versions")
    res.update(json.loads(out.strip().splitlines()[-1]))
    code, out = run(["git", "rev-parse", "HEAD"], deadline)  # the device tool's copy has no .git
    res["commit"] = out.strip() if code == 0 else None
    if plan.device == "cuda" and not res["cuda_available"]:
        raise PartFailed("torch sees no CUDA device", json.dumps(res))
    res["headline"] = f"{res['gpu'] or 'no GPU'}; torch {res['torch']}, CUDA {res['cuda']}"
    return res


def part_tests(run: Runner, plan: Plan, deadline: float, tmp: Path) -> dict:
    xml = tmp / "tests.xml"
    argv = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "", "-k", "cuda", "-rs"]
    argv += ["--junitxml", str(xml), "tests/test_device.py", "tests/test_codecs.py", "tests/test_topk.py"]
    code, out = run(argv, deadline)
    if code == 124 or not xml.exists():
        check(code if code else 1, out, "pytest")
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    cases = []
    for case in suite.iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome, message = child.tag, (child.get("message") or "")[:500]
        cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome})
        if message:
            cases[-1]["message"] = message
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failure", "error", "skipped")}
    res = {"exit_code": code, "counts": counts, "cases": cases}
    res["headline"] = (
        f"{counts['passed']} passed, {counts['failure']} failed, {counts['error']} errors, "
        f"{counts['skipped']} skipped"
    )
    if code not in (0, 5) or counts["failure"] or counts["error"]:
        raise PartFailed(f"failed: {res['headline']}", out) from None
    return res


def part_utilization(run: Runner, plan: Plan, deadline: float, tmp: Path) -> dict:
    H, P = plan.util_h_p
    cycles, warm = plan.util_cycles
    res: dict[str, Any] = {"models": {}, "rows": [], "markdown": []}
    errors = []
    start = time.monotonic()
    models = plan.util_models
    for i, (label, spec, batch) in enumerate(models):
        raw = tmp / f"sync-cost-{label}.json"
        argv = [PY, "-m", "benchmarks.sync_cost", "--parts", "sync", "--real-models", spec, "--device"]
        argv += [plan.device, "--batch-size", str(batch), "--real-taus", plan.util_taus]
        argv += ["--shards", str(plan.util_shards), "--sync-every", str(H), "--num-fragments", str(P)]
        argv += ["--cycles", str(cycles), "--warmup-cycles", str(warm), "--max-wait", "0"]
        argv += ["--baseline-steps", str(plan.baseline_steps), "--json", str(raw)]
        share = (deadline - time.monotonic()) / (len(models) - i)  # the time left, shared by what is left
        code, out = run(argv, min(deadline, time.monotonic() + share))
        if not raw.exists():
            errors.append(f"{label}: {'timed out' if code == 124 else f'exit {code}'}")
            res["models"][label] = {"status": errors[-1], "output_tail": out[-3000:]}
            continue
        data = json.loads(raw.read_text())
        res["models"][label] = {"status": "ok" if code == 0 else f"exit {code}", "cases": data["cases"]}
        if code != 0 or not data["cases"]:  # killed at the limit, it still writes what it has
            errors.append(f"{label}: {'timed out' if code == 124 else f'exit {code}'}")
            res["models"][label]["output_tail"] = out[-3000:]
        for c in data["cases"]:
            row = {"model": label, "spec": spec, "tau": c["case"]["tau"], "shards": c["case"]["shards"]}
            row["status"] = c["status"]
            if c["status"] == "ok":
                row |= {k: c.get(k) for k in ("params", "utilization", "step_ms", "blocked_seconds")}
                row |= {k: c.get(k) for k in ("send_median_ms", "send_p90_ms", "merge_median_ms")}
                row |= {"merge_p90_ms": c.get("merge_p90_ms"), "measured_steps": c.get("measured_steps")}
            else:
                errors.append(f"{label} tau={row['tau']}: {c['status']}")
            res["rows"].append(row)
    res["seconds_models"] = time.monotonic() - start
    ok = [r for r in res["rows"] if r["status"] == "ok"]
    res["headline"] = "; ".join(
        f"{r['model']} τ={r['tau']}: {r['utilization']:.3f} (step {r['step_ms']:.0f} ms)" for r in ok
    )
    if errors:
        raise PartFailed("; ".join(errors), json.dumps(res, default=str)[-3000:])
    return res


def part_codecs(run: Runner, plan: Plan, deadline: float, tmp: Path) -> dict:
    raw = tmp / "codecs.json"
    argv = [PY, "-m", "benchmarks.codecs", "--device", plan.device, "--values", plan.codec_values]
    argv += ["--repeats", str(plan.codec_repeats), "--json", str(raw)]
    # the dry run: the torch ops on the CPU too (what CUDA runs), not the compiled CPU kernels
    code, out = run(argv, deadline, env={"STREAMDILOCO_CODECS_NUMBA": "0"} if plan.device == "cpu" else None)
    check(code, out, "benchmarks/codecs.py")
    data = json.loads(raw.read_text())
    e3 = next(r for r in data["rows"] if r["codec"] == "e3m0")["x_copy"]
    data["markdown"] = out[out.find(f"{data['values'] / 1e6:.3g}M fp32 values on") :].strip()
    data["headline"] = "e3m0 × copy: " + ", ".join(f"{op} {v:.2f}" for op, v in e3.items())
    data["slowest_x_copy"] = min(v for r in data["rows"] for v in r["x_copy"].values())
    return data


PICK = r"""
import json, statistics, sys, time
import torch
from streamdiloco.common.modelspec import build_model, model_block_size
from streamdiloco.worker.train import forward_backward
device, batch, workers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
tpp, runs, budget = float(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
out = []
for spec in sys.argv[7:]:
    model = build_model(spec).to(device)
    params, block = sum(p.numel() for p in model.parameters()), model_block_size(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (batch, block), device=device)
    times = []
    for i in range(13):
        t0 = time.perf_counter()
        forward_backward(model, x, x)
        opt.step()
        opt.zero_grad()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    step = statistics.median(times[3:])
    steps = max(1, round(tpp * params / (workers * batch * block)))
    # M workers' steps per run, and the simulator's own work beside them (the engines, the evaluation)
    estimate = 1.3 * runs * workers * steps * step
    out.append({"model": spec, "params": params, "step_ms": step * 1e3, "steps": steps})
    out[-1]["estimate_s"] = estimate
    print(json.dumps(out[-1]), flush=True)
    if estimate <= budget:
        break
print(json.dumps({"picked": out[-1]}))
"""


def part_quality(run: Runner, plan: Plan, deadline: float, tmp: Path) -> dict:
    lrs = ",".join(f"{x:g}" for x in plan.quality_lrs)
    runs = 2 * len(plan.quality_lrs)  # each method at each lr of the grid
    budget = 0.8 * (deadline - time.monotonic()) - 10  # its start-up and the evaluations beside
    pick: dict[str, Any] = {"model": plan.quality_candidates[0], "params": None}
    if len(plan.quality_candidates) > 1:  # time them on the device, the largest first
        argv = [
            PY,
            "-c",
            PICK,
            plan.device,
            "16",
            str(plan.quality_workers),
            str(plan.quality_tpp),
            str(runs),
        ]
        code, out = run(argv + [f"{budget:.0f}", *plan.quality_candidates], deadline)
        check(code, out, "timing the candidate models")
        pick = json.loads(out.strip().splitlines()[-1])["picked"]
    folder = tmp / "quality"
    argv = [PY, "-m", "benchmarks.quality_long", "--model", pick["model"], "--device", plan.device]
    argv += [
        "--workers-list",
        str(plan.quality_workers),
        "--second-workers",
        "",
        "--lr",
        f"{plan.quality_lrs[0]:g}",
    ]
    argv += ["--dp-lrs", lrs, "--full-variants", lrs, "--tokens-per-param", f"{plan.quality_tpp:g}"]
    argv += ["--batch-size", "16", "--out", str(folder), "--fresh"]
    code, out = run(argv, deadline)
    check(code, out, "benchmarks/quality_long.py")
    data = json.loads((folder / "results.json").read_text())
    row = data["rows"][0]
    res = {"picked": pick, "settings": data["settings"], "rows": data["rows"]}
    res["markdown"] = (folder / "results.md").read_text().strip()
    res["runs"] = [json.loads(line) for line in (folder / "runs.jsonl").read_text().splitlines() if line]
    res["headline"] = (
        f"{pick['model']}, M={row['M']}: tuned gap {row['gap_tuned_pct']:+.2f} % "
        f"(DP {row['best_dp']:.4f} at lr {row['best_dp_lr']:g}, full {row['best_full']:.4f})"
    )
    return res


PART_FUNCS: dict[str, Callable[[Runner, Plan, float, Path], dict]] = {
    "header": part_header,
    "tests": part_tests,
    "utilization": part_utilization,
    "codecs": part_codecs,
    "quality": part_quality,
}


# --- the summary --------------------------------------------------------------------------------------------
def summary_md(results: dict[str, dict], dry: bool, total: float, label: str = "") -> str:
    head = results.get("header", {})
    lines = [
        "# GPU check" + (" (DRY RUN: CPU, toy sizes)" if dry else ""),
        "",
        f"{head.get('headline', 'header not run')}; commit {(head.get('commit') or label or '?')[:12]}; "
        f"{head.get('cpus', '?')} CPUs; {total:.0f} s in all.",
        "",
        "| part | status | seconds (limit) | result |",
        "|---|---|---:|---|",
    ]
    for name in PARTS:
        r = results.get(name)
        if r is None:
            continue
        text = str(r.get("headline") or r.get("error") or "").replace("|", "/").replace("\n", " ")
        lines.append(f"| {name} | {r['status']} | {r['seconds']:.0f} ({r['limit']:.0f}) | {text[:400]} |")
    lines += targets(results)
    util = results.get("utilization", {})
    if util.get("rows"):
        lines += [
            "",
            "## Compute utilization with real steps",
            "",
            "| model | params | τ | shards | no-sync step ms | utilization | send step ms (median / p90) "
            "| merge step ms (median / p90) | blocked s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in util["rows"]:
            if r["status"] != "ok":
                lines.append(f"| {r['model']} | | {r['tau']} | {r['shards']} | | **{r['status']}** | | | |")
                continue
            lines.append(
                f"| {r['model']} ({r['spec']}) | {r['params'] / 1e6:.1f}M | {r['tau']} | {r['shards']} | "
                f"{r['step_ms']:.1f} | **{r['utilization']:.3f}** | {_ms(r['send_median_ms'])} / "
                f"{_ms(r['send_p90_ms'])} | {_ms(r['merge_median_ms'])} / {_ms(r['merge_p90_ms'])} | "
                f"{r['blocked_seconds']:.2f} |"
            )
    for name, title in (
        ("codecs", "Codecs against a device-to-device copy"),
        ("quality", "Quality at M = 4"),
    ):
        if results.get(name, {}).get("markdown"):
            lines += ["", f"## {title}", "", results[name]["markdown"]]
    failed = [n for n in PARTS if n in results and results[n]["status"] != "ok"]
    for name in failed:
        lines += [
            "",
            f"## {name}: {results[name]['status']}",
            "",
            "```",
            results[name].get("output_tail", ""),
            "```",
        ]
    return "\n".join(lines) + "\n"


# issue 29's targets: utilization at tau = 2 by model, codecs against a copy, the quality gap at M = 4 (goal)
UTILIZATION_TARGETS = {"100M": 0.95, "300M": 0.90}
CODEC_TARGET = 0.5
GAP_GOAL_PCT = 2.0


def targets(results: dict[str, dict]) -> list[str]:
    """The issue's targets against what the parts measured, as a list (nothing for a part not run)."""
    out = []
    for r in results.get("utilization", {}).get("rows", []):
        want = UTILIZATION_TARGETS.get(r["model"])
        if want is not None and r["tau"] == 2 and r["status"] == "ok":
            met = "met" if r["utilization"] >= want else "NOT met"
            out.append(
                f"- utilization at {r['model']}, τ = 2: {r['utilization']:.3f} (target ≥ {want}: {met})"
            )
    for r in results.get("codecs", {}).get("rows", []):  # each codec's slowest operation
        op, x = min(r["x_copy"].items(), key=lambda kv: kv[1])
        met = "met" if x >= CODEC_TARGET else "NOT met"
        out.append(
            f"- {r['codec']}: its slowest operation, {op}, at {x:.2f} × a device copy "
            f"(target ≥ {CODEC_TARGET}: {met})"
        )
    for row in results.get("quality", {}).get("rows", []):
        met = "met" if row["gap_tuned_pct"] <= GAP_GOAL_PCT else "NOT met"
        out.append(
            f"- quality at M = {row['M']}: tuned gap {row['gap_tuned_pct']:+.2f} % to data-parallel "
            f"(goal ≤ {GAP_GOAL_PCT:g} %: {met})"
        )
    return ["", "Targets (issue 29):", "", *out] if out else []


def _children_cpu() -> float:
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def package_env(tmp: Path) -> dict[str, str]:
    """The environment of every part: the package importable (installed, or as a symlink tree here)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    paths = [str(ROOT)]
    if importlib.util.find_spec("streamdiloco") is None:  # not installed: the GPU machine's own Python
        sys.path.insert(0, str(ROOT / "scripts"))
        from typecheck import build_tree

        paths.insert(0, str(build_tree(ROOT, tmp / "pkg")))
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the folder for the JSON files, summary.md and run.log")
    ap.add_argument(
        "--dry-run", action="store_true", help="on the CPU at toy sizes (seconds): the same parts"
    )
    ap.add_argument("--parts", default=",".join(PARTS), help="which parts, in their order (default: all)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every part's time limit by this")
    ap.add_argument("--label", default="", help="the commit checked, where git cannot tell (no .git there)")
    a = ap.parse_args(argv)
    parts = [p.strip() for p in a.parts.split(",") if p.strip()]
    if set(parts) - set(PARTS):
        ap.error(f"--parts: choose from {', '.join(PARTS)}")
    plan = DRY if a.dry_run else GPU
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp_name:
        tmp = Path(tmp_name)
        run = Runner(out, package_env(tmp) | dict(plan.env))
        run.say(f"gpu-check {'dry run' if a.dry_run else 'on ' + plan.device}: parts {', '.join(parts)}")
        for name in [p for p in PARTS if p in parts]:
            limit = plan.limits[name] * a.scale
            run.say(f"\n=== {name} (limit {limit:.0f} s)")
            t0, cpu0 = time.monotonic(), _children_cpu()
            try:
                res = PART_FUNCS[name](run, plan, t0 + limit, tmp) | {"status": "ok"}
            except PartFailed as e:
                res = {"status": e.status, "error": e.status, "output_tail": e.output[-4000:]}
            except Exception as e:  # the script's own bug in a part: recorded, the next part runs
                res = {"status": f"error: {type(e).__name__}: {e}", "error": repr(e), "output_tail": ""}
            res |= {"part": name, "seconds": time.monotonic() - t0, "limit": limit}
            res["cpu_seconds"] = _children_cpu() - cpu0  # its processes' (those waited for)
            results[name] = res
            (out / f"{name}.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
            run.say(f"=== {name}: {res['status']} in {res['seconds']:.0f} s; {res.get('headline', '')}")
        total = time.monotonic() - t_start
        md = summary_md(results, a.dry_run, total, a.label)
        (out / "summary.md").write_text(md)
        run.say("\n" + md)
        run.log.close()
    return 0 if all(r["status"] == "ok" for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
