"""The WAN sweep's points (see the package's docstring): per (rate, delay) the delaying proxies and the
self-check, the no-communication reference, then the runs of each system (streamdiloco: a shard and its
workers; DDP over gloo: benchmarks/wan_ddp.py), each in its namespaces, bounded in time, with the bytes
through every worker's interface; `summarize_run` turns a run into its figures.

It runs processes on a testbed it is given (testbed.py builds it); the tables and plots are report.py's.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness import Procs, bench, say, wait_quiet
from benchmarks.wan.linkproxy import proxy_limit
from benchmarks.wan.report import check_line, rate_label, run_line
from benchmarks.wan.testbed import (
    CHECK_PORT,
    DC_ADDR,
    DDP_PORT,
    IFACE,
    PROXY_PORT,
    SHARD_PORT,
    MiB,
    Testbed,
    in_ns,
    wan_py,
)
from streamdiloco.common.atomic import atomic_write_text


class LogWatch:
    """Reads what a process has added to its log since the last look."""

    def __init__(self, path: Path):
        self.path, self.pos = path, 0

    def new_lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1  # whole lines only: the rest is still being written
        self.pos += end
        return data[:end].decode(errors="replace").splitlines()


def last_logged_step(log: Path, name: str) -> int:
    """The last step worker `name` logged (`NAME step S/STEPS ...`) in `log`; 0 if none."""
    step = 0
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        if f"{name} step " in line:
            try:
                step = int(line.split(f"{name} step ", 1)[1].split("/", 1)[0])
            except ValueError:
                pass
    return step


class Sweep:
    """Runs the points of the sweep on one testbed; every process goes through `procs` (the harness's)."""

    def __init__(self, args: argparse.Namespace, bed: Testbed, procs: Procs, tmp: Path):
        self.a, self.bed, self.procs, self.tmp = args, bed, procs, tmp
        self.env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.proxies: list = []
        self.checkers: list = []
        self.count = 0  # runs so far
        self.refs = 0  # references so far

    # --- per point: proxies, self-check, reference
    def start_proxies(self, delay: float, rate: float | None) -> None:
        self.stop_proxies()
        limit = proxy_limit(delay, rate)
        ready = []
        for i, ns in enumerate(self.bed.ns):
            f = self.tmp / f"proxy-w{i}.ready"
            f.unlink(missing_ok=True)
            argv = wan_py("_proxy", "--port", str(PROXY_PORT), "--delay", str(delay), "--limit", str(limit))
            p = self.procs.start(f"proxy-w{i}", in_ns(ns, *argv, "--ready", str(f)))
            self.proxies.append(p)
            ready.append((f, p))
        servers = [(self.bed.dc, DC_ADDR)] + (
            [(self.bed.ns[1], self.bed.addr[1])] if self.bed.workers > 1 else []
        )
        for ns, addr in servers:
            f = self.tmp / f"check-{ns}.ready"
            f.unlink(missing_ok=True)
            argv = wan_py("_check-server", "--host", addr, "--port", str(CHECK_PORT), "--ready", str(f))
            p = self.procs.start(f"check-{ns}", in_ns(ns, *argv))
            self.checkers.append(p)
            ready.append((f, p))
        deadline = time.monotonic() + 30
        for f, p in ready:
            while not f.exists():
                if p.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"a proxy or check server did not start (see {self.tmp})")
                time.sleep(0.02)

    def stop_proxies(self) -> None:
        for p in self.proxies + self.checkers:
            self.procs.stop(p, timeout=5)
        self.proxies, self.checkers = [], []

    def self_check(self, rate: float | None, delay: float) -> dict:
        """Round trips from every worker, bulk up and down through worker 0's link."""
        n = 64 * MiB if rate is None else max(64 << 10, int(rate * 1e6 / 8 * self.a.check_seconds))
        n = min(n, 64 * MiB)
        out: dict = {"workers": []}
        for i, ns in enumerate(self.bed.ns):
            argv = ["_check", "--target", f"{DC_ADDR}:{CHECK_PORT}"]
            if i == 0:
                argv += ["--bytes", str(n)]
                if self.bed.workers > 1:
                    argv += ["--peer", f"{self.bed.addr[1]}:{CHECK_PORT}"]
            limit = 60 + (0 if rate is None else 3 * n * 8 / (rate * 1e6))
            r = subprocess.run(in_ns(ns, *wan_py(*argv)), capture_output=True, text=True, timeout=limit)
            if r.returncode != 0:
                raise RuntimeError(f"self-check from {ns} failed: {r.stderr.strip()[-2000:]}")
            out["workers"].append(json.loads(r.stdout))
        w0 = out["workers"][0]
        out.update(
            rtt_ms=[w["rtt_ms"] for w in out["workers"]],
            rtt_peer_ms=w0.get("rtt_peer_ms"),
            up_mbit=w0["up_mbit"],
            down_mbit=w0["down_mbit"],
            bulk_bytes=n,
        )
        return out

    def reference(self) -> dict:
        """The training loop without communication, in every worker namespace at once: mean step time."""
        if self.a.max_wait > 0:
            wait_quiet("reference", self.a.max_wait)
        self.refs += 1
        d = self.tmp / f"ref-{self.refs}"
        d.mkdir()
        go = d / "go"
        started = []
        for i, ns in enumerate(self.bed.ns):
            argv = bench("wan_ddp", "--no-comm", "--rank", str(i))
            argv += ["--steps", str(self.a.ref_steps), "--summary", str(d / f"r{i}.json")]
            argv += ["--ready-file", str(d / f"r{i}.ready"), "--go-file", str(go)]
            argv += self.train_flags()
            started.append(self.procs.start(f"ref-{self.refs}-r{i}", in_ns(ns, *argv), env_extra=self.env))
        deadline = time.monotonic() + 180
        while not all((d / f"r{i}.ready").exists() for i in range(self.bed.workers)):
            self._check_alive(started, deadline, "the reference")
            time.sleep(0.05)
        go.touch()
        while any(p.poll() is None for p in started):
            self._check_alive(started, deadline, "the reference")
            time.sleep(0.1)
        per_rank = []
        for i in range(self.bed.workers):
            s = json.loads((d / f"r{i}.json").read_text())["step_seconds"]
            skip = min(3, len(s) // 4)  # the first steps warm up; the last may run alone
            per_rank.append(statistics.fmean(s[skip : len(s) - skip]))
        for p in started:
            self.procs.stop(p)
        return {"step_seconds": statistics.fmean(per_rank), "per_rank": per_rank, "steps": self.a.ref_steps}

    def _check_alive(self, procs: list, deadline: float, what: str) -> None:
        if any(p.poll() not in (None, 0) for p in procs):
            raise RuntimeError(f"{what} failed: a process exited with an error (logs in {self.tmp})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not finish in time (logs in {self.tmp})")

    # --- flags
    def train_flags(self) -> list[str]:
        """What the workers and the DDP ranks train alike."""
        f = ["--batch-size", str(self.a.batch_size), "--model", self.a.model, "--seed", str(self.a.seed)]
        f += ["--eval-batches", str(self.a.eval_batches)]
        if self.a.block_size:
            f += ["--block-size", str(self.a.block_size)]
        if self.a.data:
            f += ["--data", self.a.data]
        return f + shlex.split(self.a.train_flags)

    def sync_flags(self) -> list[str]:
        f = ["--sync-every", str(self.a.sync_every), "--num-fragments", str(self.a.num_fragments)]
        return f + shlex.split(self.a.sdl_flags)

    # --- the runs
    def run_sdl(self, d: Path) -> dict:
        a, bed = self.a, self.bed
        ready = d / "shard.ready"
        model = ["--model", a.model, "--seed", str(a.seed)]
        if a.block_size:
            model += ["--block-size", str(a.block_size)]
        argv = ["-m", "streamdiloco", "server", "--host", DC_ADDR, "--port", str(SHARD_PORT)]
        argv += ["--http-port", "0", "--ready-file", str(ready), "--min-workers", str(bed.workers)]
        argv += ["--no-checkpoint", "--insecure", *model, *self.sync_flags(), *shlex.split(a.server_flags)]
        shard = self.procs.start(f"{d.name}-shard", in_ns(bed.dc, sys.executable, *argv), env_extra=self.env)
        deadline = time.monotonic() + 120
        while not ready.exists():
            self._check_alive([shard], deadline, "the shard")
            if shard.poll() is not None:
                raise RuntimeError(f"the shard exited:\n{self.procs.tail(f'{d.name}-shard')}")
            time.sleep(0.05)
        names = [f"w{i}" for i in range(bed.workers)]
        procs, watches = [], []
        for i, (ns, w) in enumerate(zip(bed.ns, names, strict=True)):
            argv = ["-m", "streamdiloco", "worker", "--servers", f"{DC_ADDR}:{SHARD_PORT}", "--name", w]
            argv += ["--rank", str(i), "--steps", str(a.steps), "--summary", str(d / f"{w}.json")]
            argv += ["--checkpoint", str(d / f"{w}.pt"), "--checkpoint-every", "0", "--log-every", "10"]
            argv += ["--eval-every", "0"]  # no evaluations inside the training time DDP is compared with
            argv += [*self.train_flags(), *self.sync_flags(), *shlex.split(a.worker_flags)]
            env = self.env
            procs.append(self.procs.start(f"{d.name}-{w}", in_ns(ns, sys.executable, *argv), env_extra=env))
            watches.append(LogWatch(self.procs.logdir / f"{d.name}-{w}.log"))
        train_start: list[float | None] = [None] * bed.workers
        at_start: list[dict | None] = [None] * bed.workers

        def watch() -> None:  # the start of training: its time and the interface's bytes (after the Fetch)
            for i, w in enumerate(watches):
                for line in w.new_lines():
                    if train_start[i] is None and f"{names[i]}: " in line and " params in " in line:
                        train_start[i], at_start[i] = time.time(), bed.counters(i)

        status, t_stop = self._wait(procs + [shard], procs, a.timeout, watch, f"{d.name}-")
        watch()
        for p in procs:
            self.procs.stop(p, timeout=20)  # on a timeout: SIGTERM, the worker stops after its step
        self.procs.stop(shard)
        workers = []
        for i, name in enumerate(names):
            f = d / f"{name}.json"
            s = json.loads(f.read_text()) if f.exists() else {}
            finished = "train_seconds" in s
            log = self.procs.logdir / f"{d.name}-{name}.log"
            steps = a.steps if finished else (s.get("stopped_at_step") or last_logged_step(log, name))
            wall = s["train_seconds"] if finished else (t_stop - (train_start[i] or t_stop))
            workers.append(
                {
                    "steps": steps,
                    "train_seconds": wall,
                    "own_compute_utilization": s.get("compute_utilization"),
                    "blocked_seconds": s.get("blocked_seconds"),
                    "eval_loss": s.get("eval_loss"),
                    "train_start_bytes": at_start[i],
                    "summary": s,
                }
            )
        return {"status": status, "workers": workers}

    def run_ddp(self, d: Path) -> dict:
        a, bed = self.a, self.bed
        procs = []
        for i, ns in enumerate(bed.ns):
            argv = bench("wan_ddp", "--rank", str(i), "--world-size", str(bed.workers))
            argv += ["--master", f"{bed.addr[0]}:{DDP_PORT}", "--iface", IFACE, "--steps", str(a.steps)]
            argv += ["--summary", str(d / f"rank{i}.json"), *self.train_flags()]
            env = {**self.env, "GLOO_SOCKET_IFNAME": IFACE}
            procs.append(self.procs.start(f"{d.name}-rank{i}", in_ns(ns, *argv), env_extra=env))
        status, t_stop = self._wait(procs, procs, a.ddp_timeout, None, f"{d.name}-")
        for p in procs:
            self.procs.stop(p, timeout=5)
        workers = []
        for i in range(bed.workers):
            f = d / f"rank{i}.json"
            s = json.loads(f.read_text()) if f.exists() else {}
            finished = bool(s.get("finished"))
            steps = s.get("steps", 0)
            if finished:
                wall = s["train_seconds"]
            elif "train_start_unix" in s:
                wall = t_stop - s["train_start_unix"]
            else:
                wall = 0.0
            workers.append(
                {
                    "steps": steps,
                    "train_seconds": wall,
                    "own_compute_utilization": None,
                    "blocked_seconds": None,
                    "eval_loss": s.get("eval_loss"),
                    "train_start_bytes": s.get("iface_bytes_at_start"),
                    "summary": {k: v for k, v in s.items() if k != "step_seconds"},
                    "step_seconds_median": statistics.median(s["step_seconds"])
                    if s.get("step_seconds")
                    else None,
                }
            )
        return {"status": status, "workers": workers}

    def _wait(self, watched: list, workers: list, timeout: float, tick, prefix: str) -> tuple[str, float]:
        """Until the workers exit (ok), one of the processes fails (failed) or `timeout` s pass (timed
        out); returns the status and when it was decided."""
        deadline = time.monotonic() + timeout
        while True:
            if tick:
                tick()
            if all(p.poll() is not None for p in workers):
                ok = all(p.returncode == 0 for p in workers)
                if not ok:
                    self._say_tails(prefix)
                return ("ok" if ok else "failed"), time.time()
            if any(p.poll() not in (None, 0) for p in watched):
                self._say_tails(prefix)
                return "failed", time.time()
            if time.monotonic() > deadline:
                return "timed out", time.time()
            time.sleep(0.2)

    def _say_tails(self, prefix: str) -> None:
        for name, _ in self.procs.procs:
            if name.startswith(prefix):
                say(self.procs.tail(name, 8))

    def point(
        self, rate: float | None, delay_ms: float, systems: list[str], total: int, results: dict, save: Path
    ) -> None:
        """One (rate, delay) point: shape, proxies, self-check, reference, then a run of each of `systems`,
        each added to `results` ("points", "runs"; written to `save` after every run; `total`: the runs of
        the whole sweep, for the progress lines)."""
        self.bed.shape(rate, self.a.queue_ms / 1e3)
        self.start_proxies(delay_ms / 1e3, rate)
        pt: dict = {"rate_mbit": rate, "delay_ms": delay_ms, "check": self.self_check(rate, delay_ms)}
        say(check_line(rate, delay_ms, pt["check"], self.a.queue_ms / 1e3))
        if not self.a.check_only:
            pt["reference"] = self.reference()
            say(
                f"[{rate_label(rate)}, {delay_ms:g} ms] reference without communication: "
                f"{1e3 * pt['reference']['step_seconds']:.1f} ms/step ({self.bed.workers} processes at once)"
            )
        results["points"].append(pt)
        for system in systems:
            bound = self.a.timeout if system == "sdl" else self.a.ddp_timeout
            n = len(results["runs"]) + 1
            say(f"[{n}/{total}] {system} {rate_label(rate)}, {delay_ms:g} ms: running (bound {bound:.0f} s)")
            r = self.run(system, rate, delay_ms, pt["reference"]["step_seconds"])
            results["runs"].append(r)
            say(f"[{n}/{total}] {run_line(r)}")
            atomic_write_text(save, json.dumps(results, indent=2, default=str))
        self.stop_proxies()

    def run(self, system: str, rate: float | None, delay_ms: float, t_ref: float) -> dict:
        self.count += 1
        d = self.tmp / f"run{self.count}-{system}"
        d.mkdir()
        before = [self.bed.counters(i) for i in range(self.bed.workers)]
        t0 = time.monotonic()
        res = (self.run_sdl if system == "sdl" else self.run_ddp)(d)
        after = [self.bed.counters(i) for i in range(self.bed.workers)]
        res.update(
            system=system, rate_mbit=rate, delay_ms=delay_ms, t_ref=t_ref, seconds=time.monotonic() - t0
        )
        for i, w in enumerate(res["workers"]):
            w["iface_bytes"] = {k: after[i][k] - before[i][k] for k in ("tx", "rx")}
            if w.get("train_start_bytes") is not None:  # from the start of training on
                w["training_bytes"] = {k: after[i][k] - w["train_start_bytes"][k] for k in ("tx", "rx")}
        return summarize_run(res)


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def summarize_run(r: dict) -> dict:
    """The figures of one run (means over the workers), beside its per-worker details."""
    ws = r["workers"]
    steps = min((w["steps"] for w in ws), default=0)
    util = [w["steps"] * r["t_ref"] / w["train_seconds"] if w["train_seconds"] > 0 else 0.0 for w in ws]
    # the same without the run's last step's final sync (every fragment once more, waited for: a one-off
    # cost at the end of a run, a few seconds on a slow link, that a run of thousands of steps does not see)
    steady = [
        w["steps"] * r["t_ref"] / (w["train_seconds"] - fs) if w["train_seconds"] - fs > 0 else 0.0
        for w in ws
        for fs in [(w.get("summary") or {}).get("final_sync_seconds") or 0.0]
    ]
    sps = [w["steps"] / w["train_seconds"] if w["train_seconds"] > 0 else 0.0 for w in ws]

    def per_step(key: str, d: str) -> float | None:
        vals = [w[key][d] / w["steps"] for w in ws if w.get(key) and w["steps"]]
        return statistics.fmean(vals) if vals else None

    finished = r["status"] == "ok"
    r.update(
        steps=steps,
        utilization=_mean(util),
        utilization_steady=_mean(steady),
        final_sync_seconds=_mean([(w.get("summary") or {}).get("final_sync_seconds") or 0.0 for w in ws]),
        own_utilization=_mean([w["own_compute_utilization"] for w in ws]) if finished else None,
        steps_per_s=_mean(sps),
        train_seconds=_mean([w["train_seconds"] for w in ws]),
        up_bytes_per_step=per_step("training_bytes", "tx"),
        down_bytes_per_step=per_step("training_bytes", "rx"),
        up_bytes_per_step_whole_run=per_step("iface_bytes", "tx"),
        down_bytes_per_step_whole_run=per_step("iface_bytes", "rx"),
        blocked_seconds=_mean([w["blocked_seconds"] for w in ws]) if finished else None,
        eval_loss=ws[0]["eval_loss"] if finished and ws else None,
    )
    return r
