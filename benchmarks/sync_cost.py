"""Sync-cost benchmark (issue 11): how much of a GPU worker's time the sync path takes, at the model sizes
and step times users have.

A synthetic model (`nn.Linear` blocks in an `nn.ModuleList`, plus a byte embedding and a head outside it:
the non-block fragment) of 1M to 300M parameters. A worker process joins real `streamdiloco server`
processes (1 or 2 shards, on loopback) through the public API, `connect()`, and runs a training loop in
which the GPU step is EMULATED: the training thread sleeps for the step time (50, 100 or 500 ms), then
makes a tiny real change to the parameters (one element per tensor, so that outer gradients are not zero)
and calls `engine.step()`. On a real GPU the step runs on the device and the training thread waits on it;
sleeping leaves the CPUs to the sync work in the same way. Right after joining, the parameters get one
dense random perturbation (outside the timing), so that every outer gradient and update is dense.

Measured, per case (model size, step time, tau, shards), after a warm-up of 2 H-step cycles (each fragment's
first round falls in it: fragment 0's first send is at step H; a first round costs the shard its buffers'
first touch):
  compute utilization  emulated compute time (steps x step time) / wall time of the loop
                       (per H-step cycle too: min and max)
  send / merge steps   time the training thread spends inside engine.step() at steps whose events
                       include a send / a merge (median, p90); "other" steps: no event
  late wake-ups        how much later than asked the training thread's sleep returned (mean ms per step):
                       time it could not run, e.g. waiting for the GIL held by sync threads
  blocked              engine.blocked_seconds over the measured steps (merges waiting for an update)
  RSS                  peak RSS of the worker and of each shard process, against parameters x 4 bytes
                       (also beyond the worker's RSS before it built the model: Python + torch + imports)
  load                 /proc/loadavg and the CPU other processes on the machine used during the case
Also, as hooks into other benchmarks, when they are there:
  codecs  encode/decode throughput against a memcpy: benchmarks/codecs.py's codec_table()
  ingest  shard ingest against plain TCP: `python -m benchmarks.wire --parts b` (a subprocess)

Real GPU steps (issue 29: `--real-models large,benchmarks.sync_cost:gpt_300m --device cuda`): the worker
trains a GPT of the run (a --model spec the shards build too) on the device, forward, backward and AdamW
in --precision on random tokens, and waits for the step's kernels before calling engine.step(). Before
joining it times half of --baseline-steps such steps with no sync at all (after warm-up steps), and the
other half after the synced loop (the engine closed), so that a drift of the GPU's clocks shows in both; the
compute utilization is then measured steps x the median no-sync step time / wall time of the synced loop,
and "late wake-ups" reads as how much longer a synced step took than a no-sync one. scripts/gpu-check.py
runs it.

Headline (issue 11): 100M parameters, 100 ms steps, H=30, P=5, tau=2, alpha=0.5, E3M0 both ways, 1 shard:
target compute utilization >= 0.90. Also 100M, 50 ms, tau=1.

    python -m benchmarks.sync_cost                     # the default cases, ~10-15 min on 2 cores
    python -m benchmarks.sync_cost --headline          # only the two headline cases
    python -m benchmarks.sync_cost --quick             # a smoke run: 1M parameters, few steps (~1 min)
    python -m benchmarks.sync_cost --cases 300M:100:2:1,30M:500:2:2    # SIZE:STEP_MS:TAU:SHARDS
    python -m benchmarks.sync_cost --sizes 1M,10M --step-ms 50,100 --shards 1,2   # a grid
    python -m benchmarks.sync_cost --json results.json --out DIR       # raw results; results.md/json/run.log
    python -m benchmarks.sync_cost --real-models large --device cuda --batch-size 64 --shards 2 --parts sync

Every process it starts runs in its own process group, is bounded in time (a case that hangs is killed
and reported) and is stopped at the end, on an error and on Ctrl+C. Process logs go to a temp folder,
shown when something fails (--keep-logs keeps the folder).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from benchmarks import harness
from benchmarks.harness import (
    Procs,
    Session,
    bench,
    group_cpu_seconds,
    group_peak_rss,
    loadavg,
    say,
    system_busy_seconds,
    wait_quiet,
)
from streamdiloco.common.atomic import atomic_write_text

# The shards build the model from this spec (modelspec imports it with the repository root as the working
# directory); its size comes from the environment variable.
MODEL_SPEC = "benchmarks.sync_cost:synthetic_model"
PARAMS_ENV = "SYNC_COST_PARAMS"
BLOCKS = 12  # nn.Linear blocks in the ModuleList (P=5: 4 fragments of 3 blocks, and the rest)
VOCAB = 256  # byte embedding and head: the non-block fragment
HEADLINE = [("100M", 100, 2, 1), ("100M", 50, 1, 1)]
DEFAULT_CASES = [
    *HEADLINE,
    ("100M", 100, 2, 2),
    ("100M", 500, 2, 1),
    ("1M", 100, 2, 1),
    ("10M", 100, 2, 1),
    ("30M", 100, 2, 1),
]
QUICK_CASES = [("1M", 50, 1, 1), ("1M", 50, 2, 2)]
TARGET = 0.90
INGEST_HEAD = "## Shard ingest against plain TCP (benchmarks/wire/, part b)"


# --- the synthetic model ------------------------------------------------------------------------------------
def parse_size(text: str) -> int:
    t = str(text).strip().upper().replace("_", "")
    mult = {"K": 10**3, "M": 10**6, "G": 10**9, "B": 10**9}.get(t[-1:], 1)
    return int(float(t[:-1] if mult > 1 else t) * mult)


def size_label(n: int) -> str:
    return f"{n / 1e6:.3g}M"


class SyntheticModel(nn.Module):
    """Byte embedding -> BLOCKS x Linear(width, width) -> head. Only the parameters matter here."""

    def __init__(self, width: int, blocks: int = BLOCKS, vocab: int = VOCAB):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = x + torch.relu(block(x))
        return self.head(x)


def width_for(params: int, blocks: int = BLOCKS, vocab: int = VOCAB) -> int:
    """The width (a multiple of 8) whose model has about `params` parameters:
    blocks*(w^2 + w) + vocab*w (embedding) + w*vocab + vocab (head)."""
    a, b, c = blocks, blocks + 2 * vocab, vocab - params
    w = (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)
    return max(8, int(round(w / 8)) * 8)


def gpt_300m() -> nn.Module:
    """A ~300M-parameter built-in GPT (GPT-2 medium's shape on bytes: 24 blocks of 1024, 1024 context), for
    the real-step cases: --model benchmarks.sync_cost:gpt_300m (the shards build it too)."""
    from streamdiloco.worker.model import build_gpt

    return build_gpt("large", n_layer=24, n_head=16, n_embd=1024, block_size=1024)


def synthetic_model() -> SyntheticModel:
    """The factory the shards load (--model benchmarks.sync_cost:synthetic_model); the size (e.g. 100M)
    comes from $SYNC_COST_PARAMS."""
    return SyntheticModel(width_for(parse_size(os.environ.get(PARAMS_ENV, "1M"))))


# --- the worker (a subprocess: `sync_cost.py _worker`) ------------------------------------------------------
def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


# one step of the loop: (step, start, seconds of the (emulated) GPU step, after the change, end, event kinds)
Rec = tuple[int, float, float, float, float, list[str]]


def worker_main(spec: dict, result_path: Path) -> int:
    """`python -m benchmarks.sync_cost _worker SPEC RESULT`: join, train `spec`'s steps, write the figures."""
    from streamdiloco.common.config import SyncConfig
    from streamdiloco.worker.join import connect

    base_rss = _peak_rss_bytes()  # Python, torch and the package, before the model
    t_start = time.perf_counter()
    os.environ[PARAMS_ENV] = str(spec["params"])
    torch.manual_seed(1)
    model, gpu_step, baseline, step_s = _model(spec)
    numel = sum(p.numel() for p in model.parameters())
    cfg = SyncConfig(**spec["sync"])
    steps, warm = spec["steps"], spec["warmup"]
    t0 = time.perf_counter()
    engine = connect(model, spec["servers"], sync=cfg, total_steps=steps, name=f"sync-cost-{os.getpid()}")
    join_s = time.perf_counter() - t0
    if gpu_step is None:  # (real steps change every parameter)
        g = torch.Generator().manual_seed(2)
        with torch.no_grad():  # once, untimed: dense outer gradients and updates from the first send on
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g), alpha=1e-3)
    print(
        f"joined in {join_s:.1f}s; {numel:,} parameters; {steps} steps of {step_s * 1e3:.0f} ms", flush=True
    )
    recs, blocked, cpu_window = _train(engine, model, gpu_step, step_s, cfg.sync_every, steps, warm)
    t0 = time.perf_counter()
    engine.close()
    close_s = time.perf_counter() - t0
    if gpu_step is not None and baseline is not None:  # the other half, now: no sync, the same GPU
        baseline += _time_steps(gpu_step, spec.get("baseline_steps", 10) - len(baseline))
        step_s = statistics.median(baseline)
        print(f"no-sync steps: median {step_s * 1e3:.1f} ms ({len(baseline)} steps)", flush=True)
    figures = _loop_figures(recs, step_s, warm, cfg.sync_every, steps)
    res = {
        "params": numel,
        "width": model.blocks[0].in_features if isinstance(model, SyntheticModel) else None,
        "blocks": len(model.blocks) if isinstance(model, SyntheticModel) else None,
        "model": spec.get("model"),
        "device": spec.get("device", "cpu"),
        "baseline_step_ms": [t * 1e3 for t in baseline] if baseline else None,
        "steps": steps,
        "warmup_steps": warm,
        "measured_steps": figures.pop("measured_steps"),
        "step_ms": step_s * 1e3,
        "join_seconds": join_s,
        "close_seconds": close_s,
        **figures,
        "blocked_seconds": blocked,
        "blocked_seconds_total": float(engine.blocked_seconds),
        "worker_cpu_cores_window": cpu_window / figures["wall_seconds"],
        "worker_cpu_seconds_total": time.process_time(),
        "worker_base_rss": base_rss,
        "worker_peak_rss": _peak_rss_bytes(),
        "lifetime_seconds": time.perf_counter() - t_start,
        **{k: getattr(engine, k, None) for k in ("bytes_sent", "bytes_received", "pushes", "merges")},
    }
    result_path.write_text(json.dumps(res, indent=2))
    return 0


def _model(spec: dict) -> tuple[nn.Module, Any, list[float] | None, float]:
    """The worker's model, its real step (None: emulated), the no-sync step times measured before joining
    (real steps only) and the step's seconds."""
    if spec.get("model"):
        model, gpu_step = _real_training(spec)
        baseline = _time_steps(gpu_step, spec.get("baseline_steps", 10) // 2)
        return model, gpu_step, baseline, statistics.median(baseline)  # a step with no sync at all (the log)
    return synthetic_model(), None, None, spec["step_ms"] / 1e3


def _train(
    engine: Any, model: nn.Module, gpu_step: Any, step_s: float, H: int, steps: int, warm: int
) -> tuple[list[Rec], float, float]:
    """The training loop: each step (real, or a sleep and a tiny change) then engine.step(); a line per H
    steps. Its records, and the blocked and CPU seconds after the warm-up."""
    params = [p for p in model.parameters()] if gpu_step is None else []
    recs: list[Rec] = []
    blocked0 = cpu0 = 0.0
    for i in range(1, steps + 1):
        if i == warm + 1:
            blocked0, cpu0 = float(engine.blocked_seconds), time.process_time()
        ts = time.perf_counter()
        if gpu_step is not None:
            tokens, loss = gpu_step()  # a real step, its kernels done
        else:
            time.sleep(step_s)  # the emulated GPU step
            tokens, loss = 1024, 1.0
        t1 = time.perf_counter()
        with torch.no_grad():  # a tiny real change: one element per tensor
            for p in params:
                p.view(-1)[i % p.numel()] += 1e-4
        t2 = time.perf_counter()
        evs = engine.step(tokens=tokens, loss=loss)
        t3 = time.perf_counter()
        recs.append((i, ts, t1 - ts, t2, t3, sorted({str(getattr(e, "kind", e)) for e in evs})))
        if i % H == 0 or i == steps:
            _say_cycle(recs[-H:], i, steps, warm, step_s, float(engine.blocked_seconds))
    return recs, float(engine.blocked_seconds) - blocked0, time.process_time() - cpu0


def _say_cycle(cyc: list[Rec], i: int, steps: int, warm: int, step_s: float, blocked: float) -> None:
    wall = cyc[-1][4] - cyc[0][1]
    sends = [r[4] - r[3] for r in cyc if "send" in r[5]]
    merges = [r[4] - r[3] for r in cyc if "merge" in r[5]]
    print(
        f"step {i}/{steps}{' (warm-up)' if i <= warm else ''}: last {len(cyc)} steps "
        f"{wall:.1f}s, utilization {len(cyc) * step_s / wall:.3f}; max send step "
        f"{max(sends, default=0) * 1e3:.0f} ms, max merge step "
        f"{max(merges, default=0) * 1e3:.0f} ms; "
        f"blocked {blocked:.2f}s in all",
        flush=True,
    )


def _loop_figures(recs: list[Rec], step_s: float, warm: int, H: int, steps: int) -> dict:
    """The measured steps' figures: wall time, utilization (over all, per H cycle), the time inside
    engine.step() at send, merge and other steps, the late wake-ups."""
    win = [r for r in recs if r[0] > warm]
    wall = win[-1][4] - win[0][1]
    cycles = []
    for c in range(warm, steps, H):
        cyc = [r for r in recs if c < r[0] <= c + H]
        if len(cyc) == H:
            cycles.append(H * step_s / (cyc[-1][4] - cyc[0][1]))

    def ms(xs: list[float]) -> dict:
        return {
            "n": len(xs),
            "median_ms": statistics.median(xs) * 1e3 if xs else None,
            "p90_ms": _pct(xs, 0.9) * 1e3 if xs else None,  # type: ignore[operator]
            "max_ms": max(xs) * 1e3 if xs else None,
            "total_s": sum(xs),
        }

    return {
        "measured_steps": len(win),
        "wall_seconds": wall,
        "compute_seconds": len(win) * step_s,
        "utilization": len(win) * step_s / wall,
        "cycle_utilization": cycles,
        "in_step": {
            "send": ms([r[4] - r[3] for r in win if "send" in r[5]]),
            "merge": ms([r[4] - r[3] for r in win if "merge" in r[5]]),
            "other": ms([r[4] - r[3] for r in win if not r[5]]),
        },
        "in_step_total_s": sum(r[4] - r[3] for r in win),
        "late_wakeup_ms_mean": statistics.mean(r[2] - step_s for r in win) * 1e3,
        "late_wakeup_ms_p90": _pct([r[2] - step_s for r in win], 0.9) * 1e3,  # type: ignore[operator]
    }


def _real_training(spec: dict) -> tuple[nn.Module, Any]:
    """The real-step worker's model on its device and its step (forward, backward and AdamW in the
    precision, on random tokens; returns when the device is done: (tokens, loss)), after
    spec["baseline_warmup"] untimed steps."""
    from streamdiloco.common.modelspec import build_model, model_block_size
    from streamdiloco.worker.train import forward_backward

    device = torch.device(spec.get("device", "cpu"))
    model = build_model(spec["model"]).to(device)
    block = model_block_size(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)  # small: the weights stay sane for the whole run
    data = torch.randint(0, VOCAB, (spec["batch"], block + 1), generator=torch.Generator().manual_seed(3))
    x, y = data[:, :-1].to(device), data[:, 1:].to(device)

    def step() -> tuple[int, float]:
        loss = forward_backward(model, x, y, 1, spec.get("precision", "bf16"))  # float(): waits for it
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the optimizer's kernels too: a step is done when they are
        return x.numel(), loss

    for _ in range(spec.get("baseline_warmup", 3)):
        step()
    print(f"real steps on {device}: {spec['batch']} x {block} tokens each", flush=True)
    return model, step


def _time_steps(step: Any, n: int) -> list[float]:
    """Seconds of each of n steps."""
    times = []
    for _ in range(max(1, n)):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


# --- one case -----------------------------------------------------------------------------------------------
def case_label(c: dict) -> str:
    step = f"{c['step_ms']}ms" if not c.get("model") else f"real steps on {c['device']}"
    return f"{c['size']} {step} tau={c['tau']} S={c['shards']}"


def sync_settings(tau: int, args) -> dict:
    return {
        "sync_every": args.sync_every,
        "num_fragments": args.num_fragments,
        "fragment_sync_delay": tau,
        "fragment_update_alpha": args.alpha,
        "uplink_codec": args.codec,
        "downlink_codec": args.codec,
        "final_sync": False,  # every measured step is an ordinary one
    }


def shard_flags(sync: dict) -> list[str]:
    return [
        "--sync-every",
        str(sync["sync_every"]),
        "--num-fragments",
        str(sync["num_fragments"]),
        "--fragment-sync-delay",
        str(sync["fragment_sync_delay"]),
        "--fragment-update-alpha",
        str(sync["fragment_update_alpha"]),
        "--uplink-codec",
        sync["uplink_codec"],
        "--downlink-codec",
        sync["downlink_codec"],
        "--no-final-sync",
    ]


def start_shards(
    procs: Procs, tmp: Path, tag: str, case: dict, sync: dict, args: argparse.Namespace
) -> list[tuple]:
    flags = ["--model", case.get("model") or MODEL_SPEC, "--min-workers", "1", *shard_flags(sync)]
    env = {PARAMS_ENV: str(case["params"])}
    return harness.start_shards(
        procs, tmp, tag, case["shards"], flags, checkpoint=args.shard_checkpoint, env_extra=env,
        timeout=args.start_timeout,
    )  # fmt: skip


def run_case(procs: Procs, tmp: Path, case: dict, rep: int, args: argparse.Namespace) -> dict:
    """One repeat of a case: fresh shards, the worker process to its end (or its time bound); its figures,
    or its status and the logs' tails when it failed."""
    size = case["size"].replace(":", "-").replace(".", "-")  # a model spec: a file name's part
    tag = f"{size}-{case['step_ms']}ms-tau{case['tau']}-S{case['shards']}-r{rep}"
    label = f"[{case_label(case)}{f' #{rep + 1}' if args.repeats > 1 else ''}]"
    sync = sync_settings(case["tau"], args)
    steps = args.sync_every * args.cycles
    step_ms = case["step_ms"] or 1000  # real steps: a second each at most, for the default timeout
    timeout = args.case_timeout or (args.start_timeout + 120 + steps * (step_ms / 1e3 + 3.0))
    out: dict = {"case": case, "repeat": rep, "status": "ok", "loadavg_before": loadavg()}
    out["machine_busy_before"] = wait_quiet(label, args.max_wait) if args.max_wait > 0 else None
    say(
        f"{label} starting {case['shards']} shard process(es) for "
        f"{case.get('model') or format(case['params'], ',') + ' parameters'} (load {out['loadavg_before']})"
    )
    t0 = time.monotonic()
    shards = start_shards(procs, tmp, tag, case, sync, args)
    out["shard_start_seconds"] = time.monotonic() - t0
    servers = ",".join(f"127.0.0.1:{info['grpc_port']}" for _, _, info in shards)
    spec = _worker_spec(case, args, servers, sync, steps)
    result, wname = tmp / f"{tag}-worker.json", f"{tag}-worker"
    cpu0 = (system_busy_seconds(), sum(group_cpu_seconds(p.pid) for _, p, _ in shards), time.process_time())
    worker = procs.start(
        wname,
        bench("sync_cost", "_worker", json.dumps(spec), str(result)),
        env_extra={PARAMS_ENV: str(case["params"])},
        pipe=True,
    )
    code, shard_died, wall = _follow(worker, shards, label, tmp / f"{wname}.log", timeout)
    cpu1 = (system_busy_seconds(), sum(group_cpu_seconds(p.pid) for _, p, _ in shards), time.process_time())
    out["shard_peak_rss"] = [group_peak_rss(p.pid) for _, p, _ in shards]
    out["loadavg_after"] = loadavg()
    dead = [(n, p.returncode) for n, p, _ in shards if p.poll() is not None]
    if code is None:
        procs.stop(worker)
        out["status"] = "a shard exited mid-run" if shard_died else f"timed out after {timeout:.0f}s"
    elif code != 0 or not result.exists():
        out["status"] = f"worker exited with {code}"
    for _, p, _ in shards:
        procs.stop(p, timeout=30)
    if out["status"] != "ok" or dead:
        tails = "\n".join([procs.tail(wname, 40)] + [procs.tail(n) for n, _, _ in shards])
        say(f"{label} FAILED: {out['status']}; shards exited early: {dead or 'none'}\n{tails}")
        out["log_tail"] = tails
        if out["status"] == "ok":
            out["status"] = f"shard(s) exited early: {dead}"
        return out
    out.update(_case_figures(json.loads(result.read_text()), out["shard_peak_rss"], cpu0, cpu1, wall))
    _say_case(label, out)
    return out


def _worker_spec(case: dict, args: argparse.Namespace, servers: str, sync: dict, steps: int) -> dict:
    """What the worker process runs (`_worker SPEC`)."""
    spec = {
        "params": case["params"],
        "servers": servers,
        "sync": sync,
        "steps": steps,
        "warmup": args.sync_every * args.warmup_cycles,
        "step_ms": case["step_ms"],
    }
    if case.get("model"):  # real steps (see the module's docstring)
        spec |= {"model": case["model"], "device": case["device"], "batch": args.batch_size}
        spec |= {"precision": args.precision, "baseline_steps": args.baseline_steps}
    return spec


def _follow(
    worker: subprocess.Popen, shards: list[tuple], label: str, log: Path, timeout: float
) -> tuple[int | None, bool, float]:
    """Relay the worker's lines (said with `label`, kept in `log`) until it exits, a shard exits (the worker
    would wait for it, for minutes) or `timeout` s pass: its exit code (None: still running), whether a
    shard died, and the seconds it ran."""
    t0 = time.monotonic()
    lines: list[str] = []

    def relay() -> None:
        assert worker.stdout is not None
        for line in worker.stdout:
            line = line.rstrip("\n")
            lines.append(line)
            if not line.startswith(" ") and "Traceback" not in line:
                say(f"{label} {line}")

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    code, shard_died = None, False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = worker.poll()
        if code is not None:
            break
        if any(p.poll() is not None for _, p, _ in shards):
            shard_died = True
            break
        time.sleep(0.2)
    wall = time.monotonic() - t0
    reader.join(5)
    log.write_text("\n".join(lines) + "\n")
    return code, shard_died, wall


def _case_figures(w: dict, shard_rss: list[int], cpu0: tuple, cpu1: tuple, wall: float) -> dict:
    """The worker's figures (`w`) with the CPU the shards and the other processes used over its `wall` s
    (cpu0, cpu1: the machine's busy, the shards' and this process's CPU seconds before and after) and the
    RSS against the parameters' fp32 bytes."""
    busy, shard_cpu, me = (b - a for a, b in zip(cpu0, cpu1, strict=True))
    ours = w["worker_cpu_seconds_total"] + shard_cpu + me
    bpp = 4 * w["params"]
    return {
        **w,
        "shard_cpu_cores": shard_cpu / wall,
        "others_cpu_cores": max(0.0, busy - ours) / wall,
        "worker_process_seconds": wall,
        "worker_rss_ratio": w["worker_peak_rss"] / bpp,
        "worker_rss_excess_ratio": (w["worker_peak_rss"] - w["worker_base_rss"]) / bpp,
        "shard_rss_ratio": [r / bpp for r in shard_rss],
        "shard_rss_excess_ratio": [(r - w["worker_base_rss"]) / bpp for r in shard_rss],
    }


def _say_case(label: str, out: dict) -> None:
    s, m = out["in_step"]["send"], out["in_step"]["merge"]
    say(
        f"{label} utilization {out['utilization']:.3f} over {out['measured_steps']} steps "
        f"(cycles {min(out['cycle_utilization'], default=0):.3f}-"
        f"{max(out['cycle_utilization'], default=0):.3f}); "
        f"send step {_f(s['median_ms'])} ms (p90 {_f(s['p90_ms'])}), merge step {_f(m['median_ms'])} ms "
        f"(p90 {_f(m['p90_ms'])}); blocked {out['blocked_seconds']:.2f}s; worker RSS "
        f"{out['worker_peak_rss'] / 2**30:.2f} GiB ({out['worker_rss_ratio']:.2f}x params*4B); "
        f"other processes {out['others_cpu_cores']:.2f} cores; load {out['loadavg_after']}"
    )


def _f(x: float | None, fmt: str = ".0f") -> str:
    return "-" if x is None else format(x, fmt)


# --- tables -------------------------------------------------------------------------------------------------
def summarize(runs: list[dict]) -> dict:
    """One row per case: medians over its successful repeats."""
    ok = [r for r in runs if r["status"] == "ok"]
    case = runs[0]["case"]
    if not ok:
        return {"case": case, "status": runs[0]["status"], "repeats": len(runs), "ok": 0}

    def med(get):
        vals = [v for v in (get(r) for r in ok) if v is not None]
        return statistics.median(vals) if vals else None

    return {
        "case": case,
        "status": "ok",
        "repeats": len(runs),
        "ok": len(ok),
        "params": ok[0]["params"],
        "step_ms": med(lambda r: r["step_ms"]),
        "utilization": med(lambda r: r["utilization"]),
        "utilization_all": [r["utilization"] for r in ok],
        "cycle_min": min(min(r["cycle_utilization"], default=r["utilization"]) for r in ok),
        "cycle_max": max(max(r["cycle_utilization"], default=r["utilization"]) for r in ok),
        "send_median_ms": med(lambda r: r["in_step"]["send"]["median_ms"]),
        "send_p90_ms": med(lambda r: r["in_step"]["send"]["p90_ms"]),
        "merge_median_ms": med(lambda r: r["in_step"]["merge"]["median_ms"]),
        "merge_p90_ms": med(lambda r: r["in_step"]["merge"]["p90_ms"]),
        "other_median_ms": med(lambda r: r["in_step"]["other"]["median_ms"]),
        "late_wakeup_ms": med(lambda r: r["late_wakeup_ms_mean"]),
        "blocked_seconds": med(lambda r: r["blocked_seconds"]),
        "measured_steps": ok[0]["measured_steps"],
        "wall_seconds": med(lambda r: r["wall_seconds"]),
        "worker_cpu_cores": med(lambda r: r["worker_cpu_cores_window"]),
        "shard_cpu_cores": med(lambda r: r["shard_cpu_cores"]),
        "others_cpu_cores": med(lambda r: r["others_cpu_cores"]),
        "loadavg": [r["loadavg_before"] for r in ok],
        "join_seconds": med(lambda r: r["join_seconds"]),
        "worker_peak_rss": max(r["worker_peak_rss"] for r in ok),
        "worker_base_rss": min(r["worker_base_rss"] for r in ok),
        "worker_rss_ratio": max(r["worker_rss_ratio"] for r in ok),
        "worker_rss_excess_ratio": max(r["worker_rss_excess_ratio"] for r in ok),
        "shard_peak_rss": [max(x) for x in zip(*(r["shard_peak_rss"] for r in ok), strict=True)],
        "shard_rss_ratio": [max(x) for x in zip(*(r["shard_rss_ratio"] for r in ok), strict=True)],
        "shard_rss_excess_ratio": [
            max(x) for x in zip(*(r["shard_rss_excess_ratio"] for r in ok), strict=True)
        ],
    }


UTIL_HEADER = (
    "| params | step (emulated) | τ | shards | compute utilization | cycles min–max | send step ms "
    "(median / p90) | merge step ms (median / p90) | other steps ms | late wake-ups ms/step | blocked s "
    "| CPU cores: worker / shards / others | load avg |"
)


def table_util(rows: list[dict]) -> str:
    out = [UTIL_HEADER, "|" + "---:|" * 4 + "---:|" * 9]
    for r in rows:
        c = r["case"]
        n = r.get("params") or c["params"]
        step = f"{c['step_ms']} ms"
        if c.get("model") and r.get("step_ms") is not None:  # real: the no-sync step's median
            step = f"real {r['step_ms']:.0f} ms ({c['model']})"
        head = f"| {size_label(n)} | {step} | {c['tau']} | {c['shards']} |"
        if r["status"] != "ok":
            out.append(head + f" **{r['status']}** |" + " |" * 8)
            continue
        util = f"**{r['utilization']:.3f}**"
        if r["ok"] > 1:
            util += f" ({', '.join(f'{u:.3f}' for u in r['utilization_all'])})"
        out.append(
            head + f" {util} | {r['cycle_min']:.3f}–{r['cycle_max']:.3f} | "
            f"{_f(r['send_median_ms'])} / {_f(r['send_p90_ms'])} | "
            f"{_f(r['merge_median_ms'])} / {_f(r['merge_p90_ms'])} | {_f(r['other_median_ms'], '.2f')} | "
            f"{_f(r['late_wakeup_ms'], '.1f')} | {r['blocked_seconds']:.2f} | "
            f"{r['worker_cpu_cores']:.2f} / {r['shard_cpu_cores']:.2f} / {r['others_cpu_cores']:.2f} | "
            f"{r['loadavg'][0]} |"
        )
    return "\n".join(out)


RSS_HEADER = (
    "| params | shards | params × 4 B | worker peak RSS | ÷ params × 4 B | beyond base ÷ params × 4 B "
    "| shard peak RSS (each) | ÷ params × 4 B | beyond base ÷ params × 4 B |"
)


def table_rss(rows: list[dict]) -> str:
    seen, out = set(), [RSS_HEADER, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["status"] != "ok":
            continue
        key = (r["params"], r["case"]["shards"])
        if key in seen:
            continue
        seen.add(key)
        gib = 2**30
        out.append(
            f"| {size_label(r['params'])} | {r['case']['shards']} | {4 * r['params'] / gib:.2f} GiB | "
            f"{r['worker_peak_rss'] / gib:.2f} GiB | {r['worker_rss_ratio']:.2f} | "
            f"{r['worker_rss_excess_ratio']:.2f} | "
            f"{', '.join(f'{x / gib:.2f}' for x in r['shard_peak_rss'])} GiB | "
            f"{', '.join(f'{x:.2f}' for x in r['shard_rss_ratio'])} | "
            f"{', '.join(f'{x:.2f}' for x in r['shard_rss_excess_ratio'])} |"
        )
    return "\n".join(out)


# --- hooks: codecs (benchmarks/codecs.py) and ingest (benchmarks/wire/, part b) ---------------------------
def codecs_main(out_path: Path, quick: bool) -> int:
    """In a subprocess: benchmarks/codecs.py's codec_table(); writes its table and raw numbers."""
    from benchmarks.codecs import codec_table

    md, raw = codec_table(quick=quick)
    atomic_write_text(out_path, json.dumps({"markdown": md, "raw": raw}, indent=2))
    return 0


def _run_hook(procs: Procs, name: str, argv: list[str], timeout: float) -> dict | None:
    """Run a hook's process to its end; None if it succeeded, else the status to report."""
    p = procs.start(name, argv)
    try:
        code = p.wait(timeout)
    except subprocess.TimeoutExpired:
        procs.stop(p)
        say(f"[{name}] timed out after {timeout:.0f}s\n{procs.tail(name)}")
        return {"status": f"timed out after {timeout:.0f}s"}
    procs.stop(p)
    if code != 0:
        say(f"[{name}] failed (exit {code}):\n{procs.tail(name)}")
        return {"status": f"failed (exit {code})", "log_tail": procs.tail(name)}
    return None


def run_codecs(procs: Procs, tmp: Path, args) -> dict:
    res = tmp / "codecs.json"
    say("[codecs] benchmarks/codecs.py codec_table() ...")
    argv = bench("sync_cost", "_codecs", str(res), "1" if args.quick else "0")
    failed = _run_hook(procs, "codecs", argv, args.hook_timeout)
    if failed is not None:
        return failed
    return {"status": "ok", **json.loads(res.read_text())}


def run_ingest(procs: Procs, tmp: Path, args) -> dict:
    out_dir = tmp / "wire-b"
    argv = bench("wire", "--parts", "b", "--out", str(out_dir), "--no-profile")
    argv += ["--max-wait", str(args.max_wait)] + (["--quick"] if args.quick else [])
    say(f"[ingest] {shlex.join(['python', *argv[1:]])} ...")
    failed = _run_hook(procs, "ingest", argv, args.ingest_timeout)
    if failed is not None:
        return failed
    md = (out_dir / "results.md").read_text()
    raw = json.loads((out_dir / "results.json").read_text())
    md = "\n".join(("#" + ln) if ln.startswith("#") else ln for ln in md.splitlines())  # one level down
    return {"status": "ok", "command": shlex.join(["python", *argv[1:]]), "markdown": md, "raw": raw.get("b")}


# --- main ---------------------------------------------------------------------------------------------------
def parse_cases(text: str) -> list[tuple]:
    out = []
    for item in text.split(","):
        parts = item.strip().split(":")
        if len(parts) != 4:
            raise ValueError(f"--cases: {item!r} is not SIZE:STEP_MS:TAU:SHARDS (e.g. 100M:100:2:1)")
        out.append((parts[0], int(parts[1]), int(parts[2]), int(parts[3])))
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: 1M parameters, 2 cycles (~1 min)")
    ap.add_argument("--headline", action="store_true", help="only the issue's two cases (100M, 1 shard)")
    ap.add_argument("--cases", help="SIZE:STEP_MS:TAU:SHARDS,... (e.g. 100M:100:2:1,300M:50:1:2)")
    ap.add_argument("--sizes", help="a grid instead: sizes (1M,10M,30M,100M,300M)")
    ap.add_argument("--step-ms", help="grid: emulated step times in ms (default 100)")
    ap.add_argument("--shards", help="grid: shard counts (default 1)")
    ap.add_argument("--tau", type=int, help="grid: tau (default: 1 for steps <= 50 ms, else 2)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per case, fresh shards each; median")
    ap.add_argument("--cycles", type=int, help="H-step cycles per run, warm-up included (default 5)")
    ap.add_argument(
        "--warmup-cycles",
        type=int,
        help="H-step cycles not measured (default 2: every fragment's first round)",
    )
    ap.add_argument("--sync-every", type=int, default=30, help="H (default 30)")
    ap.add_argument("--num-fragments", type=int, default=5, help="P (default 5)")
    ap.add_argument("--alpha", type=float, default=0.5, help="fragment_update_alpha (default 0.5)")
    ap.add_argument("--codec", default="e3m0", help="uplink and downlink codec (default e3m0)")
    ap.add_argument("--shard-checkpoint", action="store_true", help="shards checkpoint every round")
    ap.add_argument("--parts", default="sync,codecs,ingest", help="sync, codecs, ingest (default: all)")
    ap.add_argument("--case-timeout", type=float, help="seconds a case may take (default from its steps)")
    ap.add_argument("--start-timeout", type=float, default=180.0, help="seconds for shards to serve")
    ap.add_argument("--hook-timeout", type=float, help="seconds for codecs (default 300, quick 40)")
    ap.add_argument("--ingest-timeout", type=float, default=900.0, help="seconds for wire's part b")
    ap.add_argument("--max-wait", type=float, help="seconds to wait for a quiet machine (default 10)")
    real = ap.add_argument_group("real GPU steps (issue 29; see the module's docstring)")
    real.add_argument(
        "--real-models", help="model specs to train for real, e.g. large,benchmarks.sync_cost:gpt_300m"
    )
    real.add_argument("--real-taus", default="1,2", help="tau of each real case (default %(default)s)")
    real.add_argument("--device", default="cuda", help="where the real steps run (default %(default)s)")
    real.add_argument("--batch-size", type=int, default=16, help="sequences per real step (default 16)")
    real.add_argument("--precision", default="bf16", help="bf16 (autocast) or fp32 (default %(default)s)")
    real.add_argument("--baseline-steps", type=int, default=10, help="no-sync steps timed (default 10)")
    ap.add_argument("--json", help="write the raw results here")
    ap.add_argument("--out", help="write results.md, results.json and run.log into this folder")
    ap.add_argument("--label", default="", help="a note for the results' header (e.g. which code)")
    ap.add_argument("--keep-logs", action="store_true", help="keep the processes' logs (temp folder)")
    return ap


def settle(
    ap: argparse.ArgumentParser, a: argparse.Namespace, argv: list[str]
) -> tuple[set[str], list[dict]]:
    """The defaults that depend on --quick, into `a`; the parts to run and the cases. Exits with the
    parser's error on a bad flag or a case whose settings the config refuses."""
    a.cycles = a.cycles or (2 if a.quick else 5)
    a.warmup_cycles = a.warmup_cycles if a.warmup_cycles is not None else (1 if a.quick else 2)
    a.hook_timeout = a.hook_timeout or (40.0 if a.quick else 300.0)
    a.max_wait = a.max_wait if a.max_wait is not None else (0.0 if a.quick else 10.0)
    parts = {x.strip() for x in a.parts.split(",") if x.strip()}
    if parts - {"sync", "codecs", "ingest"}:
        ap.error(f"--parts: choose from sync, codecs, ingest; got {a.parts!r}")
    if a.quick and "ingest" in parts and "--parts" not in argv:
        parts.discard("ingest")  # minutes on its own: run it with --parts ingest
        a.ingest_note = "skipped in --quick (minutes on its own; run with --parts ingest)"
    else:
        a.ingest_note = None
    if a.warmup_cycles < 1 or a.cycles <= a.warmup_cycles:
        ap.error("--cycles must be more than --warmup-cycles, which must be at least 1")
    try:
        cases = make_cases(a)
        for c in cases:  # fail now, not after minutes: the config the shards and the worker will use
            from streamdiloco.common.config import SyncConfig

            SyncConfig(**sync_settings(c["tau"], a))
    except ValueError as e:
        ap.error(str(e))
    return parts, cases


def make_cases(a: argparse.Namespace) -> list[dict]:
    """The cases the flags ask for: real models, --cases, a grid, --quick, --headline or the defaults."""
    if a.real_models:
        raw_cases = [
            (spec, 0, int(tau), s)
            for spec in a.real_models.split(",")
            for tau in a.real_taus.split(",")
            for s in [int(x) for x in (a.shards or "1").split(",")]
        ]
        return [
            {"size": sz, "params": 0, "model": sz, "device": a.device, "step_ms": 0, "tau": tau, "shards": s}
            for sz, _, tau, s in raw_cases
        ]
    if a.cases:
        raw_cases = parse_cases(a.cases)
    elif a.sizes or a.step_ms or a.shards or a.tau is not None:
        sizes = (a.sizes or "100M").split(",")
        steps_ms = [int(x) for x in (a.step_ms or "100").split(",")]
        shard_counts = [int(x) for x in (a.shards or "1").split(",")]
        raw_cases = [
            (sz, ms, a.tau if a.tau is not None else (1 if ms <= 50 else 2), s)
            for sz in sizes
            for ms in steps_ms
            for s in shard_counts
        ]
    else:
        raw_cases = QUICK_CASES if a.quick else HEADLINE if a.headline else DEFAULT_CASES
    return [
        {"size": sz, "params": parse_size(sz), "step_ms": ms, "tau": tau, "shards": s}
        for sz, ms, tau, s in raw_cases
    ]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_worker":
        return worker_main(json.loads(argv[1]), Path(argv[2]))
    if argv and argv[0] == "_codecs":
        return codecs_main(Path(argv[1]), argv[2] == "1")
    ap = build_parser()
    a = ap.parse_args(argv)
    parts, cases = settle(ap, a, argv)
    md: list[str] = []
    with Session("sync_cost", argv, Path(a.out) if a.out else None, keep=a.keep_logs) as s:
        say_setting(a, s.code)
        s.results |= {
            "label": a.label,
            "loadavg_start": loadavg(),
            "settings": {
                "sync": sync_settings(-1, a) | {"fragment_sync_delay": "per case"},
                "steps_per_run": a.sync_every * a.cycles,
                "warmup_steps": a.sync_every * a.warmup_cycles,
                "repeats": a.repeats,
                "shard_checkpoint": a.shard_checkpoint,
                "model": f"embedding {VOCAB} x w, {BLOCKS} x Linear(w, w), head Linear(w, {VOCAB})",
            },
            "cases": [],
            "runs": [],
        }
        if "sync" in parts:
            md += sync_part(s.procs, s.tmp, a, cases, s.results)
        if "codecs" in parts:
            s.results["codecs"] = run_codecs(s.procs, s.tmp, a)
            body = s.results["codecs"].get("markdown") or s.results["codecs"]["status"]
            md += ["## Codecs against memcpy (benchmarks/codecs.py)", "", body, ""]
        if "ingest" in parts:
            s.results["ingest"] = run_ingest(s.procs, s.tmp, a)
            md += ingest_md(s.results["ingest"])
        elif a.ingest_note:
            s.results["ingest"] = {"status": a.ingest_note}
            md += [INGEST_HEAD, "", a.ingest_note, ""]
    s.results["wall_seconds"] = s.seconds
    s.results["loadavg_end"] = loadavg()
    md = [head_line(a, s), ""] + md
    say("")
    say("\n".join(md))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(a.json, json.dumps(s.results, indent=2, default=str))
    failed = any(r["status"] != "ok" for r in s.results["cases"])
    return s.finish(md, title="Sync cost (issue 11)", echo=False, partial=True, status=int(failed))


def say_setting(a: argparse.Namespace, code: dict) -> None:
    """The lines that say which code runs and what a step is, at the start."""
    say(
        f"commit {code['commit'][:12]}"
        f"{' (tracked files modified)' if code['tracked_files_modified'] else ''}; load {loadavg()}"
    )
    say(f"code under test: {code['code']}{'; ' + a.label if a.label else ''}")
    say(
        f"Real steps on {a.device}: the model trains, forward, backward and AdamW in {a.precision}, and "
        "engine.step() follows each step's kernels; utilization against the same steps with no sync."
        if a.real_models
        else "The GPU step is EMULATED: the training thread sleeps for the step time (the real case is a "
        "GPU step), then changes one element per tensor and calls engine.step()."
    )


def head_line(a: argparse.Namespace, s: Session) -> str:
    """results.md's line under the harness's head: the commit, the load, the code under test."""
    code, info, results = s.code, s.info, s.results
    return (
        f"`{s.command}`; {s.started}; commit {code['commit']}"
        f"{' (tracked files modified)' if code['tracked_files_modified'] else ''}. Machine: {info['cpus']} "
        f"CPUs ({info['cpu']}), {info['memory_gib']} GiB, torch {info['torch']}; load average at start "
        f"{results['loadavg_start']}, at end {results['loadavg_end']}; {results['wall_seconds']:.0f} s. "
        f"Code under test: {code['code']}.{' ' + a.label if a.label else ''}"
    )


def sync_part(procs: Procs, tmp: Path, a: argparse.Namespace, cases: list[dict], results: dict) -> list[str]:
    """Every case, a.repeats times (into results' "runs" and "cases"); results.md's section."""
    steps = a.sync_every * a.cycles
    say(
        f"{len(cases)} case(s) x {a.repeats}: {steps} steps each "
        f"({a.sync_every * a.warmup_cycles} warm-up), H={a.sync_every}, "
        f"P={a.num_fragments}, alpha={a.alpha}, {a.codec} both ways, shards "
        f"{'checkpointing every round' if a.shard_checkpoint else 'with --no-checkpoint'}"
    )
    for c in cases:
        runs = []
        for rep in range(a.repeats):
            try:
                runs.append(run_case(procs, tmp, c, rep, a))
            except RuntimeError as e:  # shards did not start: report, go on with the next case
                say(f"[{case_label(c)}] FAILED: {e}")
                runs.append({"case": c, "repeat": rep, "status": f"failed: {str(e).splitlines()[0]}"})
            procs.stop_all()
        results["runs"] += runs
        results["cases"].append(summarize(runs))
    return sync_md(a, results["cases"])


def sync_md(a: argparse.Namespace, cases: list[dict]) -> list[str]:
    """results.md's section of the sync part: what was measured, the utilization table, the issue's
    verdicts, the RSS table."""
    steps = a.sync_every * a.cycles
    lines = [
        f"REAL steps on {a.device} ({a.precision}, batch {a.batch_size}): compute utilization = "
        "measured steps x the median no-sync step (timed before joining) / wall time of the synced "
        "loop; late wake-ups: how much longer a synced step took. What follows about emulated "
        "steps does not apply. "
        if a.real_models
        else "",
        "The GPU step is emulated: the training thread sleeps for the step time, then changes one "
        "element per tensor (outer gradients and updates are dense: the parameters got one random "
        f"perturbation after joining) and calls `engine.step()`. {steps} steps per run, the first "
        f"{a.sync_every * a.warmup_cycles} ({a.warmup_cycles} H cycles: every fragment's first "
        f"round) not measured; H={a.sync_every}, P={a.num_fragments}, "
        f"α={a.alpha}, {a.codec} up and down, shards on loopback "
        f"({'checkpointing every round' if a.shard_checkpoint else '--no-checkpoint'}). "
        "Compute utilization = emulated compute ÷ wall time. Send/merge step: time inside "
        "`engine.step()` at steps whose events include a send/merge; other steps: no event. Late "
        "wake-ups: how much later than asked the training thread's sleep returned. CPU: cores used "
        "during the run by the worker (measured steps), the shards, and other processes on the "
        "machine.",
        "",
        table_util(cases),
        "",
    ]
    for hc in HEADLINE:
        key = ("size", "step_ms", "tau", "shards")
        row = next((r for r in cases if tuple(r["case"][k] for k in key) == hc), None)
        if row is not None and row["status"] == "ok":
            verdict = "met" if row["utilization"] >= TARGET else "NOT met"
            lines.append(
                f"Issue 11 case {hc[0]}, {hc[1]} ms, τ={hc[2]}, {hc[3]} shard: compute utilization "
                f"**{row['utilization']:.3f}** (target ≥ {TARGET:.2f}: {verdict})."
            )
    lines += [
        "",
        "Peak RSS against the parameters' fp32 bytes (base: the worker's RSS before it built the "
        "model, Python + torch + imports; the same base is taken off the shards' figures):",
        "",
        table_rss(cases),
        "",
    ]
    return ["## Compute utilization and the training thread's sync time", "", *lines]


def ingest_md(ing: dict) -> list[str]:
    """results.md's section of the ingest part (the wire benchmark's part b), with the issue's verdict."""
    body = ing.get("markdown") or ing["status"]
    if ing.get("command"):
        body = f"`{ing['command']}`\n\n{body}"
    ratio = ((ing.get("raw") or {}).get("ratios_grpc_over_tcp") or {}).get("discard")
    if isinstance(ratio, (int, float)):
        verdict = "met" if ratio >= 0.5 else "NOT met"
        body += f"\n\nShard ingest ÷ plain TCP read-and-discard: **{ratio:.3f}** (target ≥ 0.50: {verdict})."
    return [INGEST_HEAD, "", body, ""]


if __name__ == "__main__":
    sys.exit(main())
