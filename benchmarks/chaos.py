"""Goodput under chaos (issue 27): one shard, six workers of mixed emulated speeds on the adaptive schedule,
and during the run the faults a volunteer collective sees; against an undisturbed run in the same invocation.

The cluster  `streamdiloco server` (nano GPT, --liveness-timeout 5, checkpointing every round) and six
             `streamdiloco worker`s (one torch thread each) whose steps are EMULATED accelerator steps:
             --step-delay 0.05 to 0.2 s sleeps after the CPU step, and counts as compute, as a GPU's busy
             time would. --sync-schedule adaptive: a faster worker does more inner steps per schedule step.
The faults   in this order, each started on a condition (a round number on the shard's /api/status, a
             member gone or back, a worker's checkpoint file, its pushes accepted again), never on a sleep
             where a condition exists:
             freeze   SIGSTOP one worker for FREEZE s (a sleeping laptop: its TCP connection stays up; the
                      shard's liveness check drops it within seconds), then SIGCONT: it comes back late;
             kill     SIGKILL one worker (after its first checkpoint) and start it again at once with
                      --auto-resume: it resumes from its checkpoint;
             join     a seventh worker joins the run in progress;
             shard    SIGKILL the shard and start it again on the same port from its checkpoint: the workers
                      reconnect and send again the pushes it lost;
             link     (where `ip netns` works: root) one worker runs in a network namespace behind a veth
                      pair; its link goes down for LINK_DOWN s and comes back. Skipped, with a line, where
                      namespaces are not available (or with --no-netns).
The figures  goodput = tokens that reached the model / tokens computed, summed over every worker process
             (a killed one and its restart are two: the work it did after its last accepted push, and the
             steps its restart trains again, are computed and lost). Tokens computed: each process's
             streamdiloco_worker_tokens_total, polled from its /metrics every POLL s (its last reading
             before a kill). Tokens that reached the model: a worker's push of a fragment weighs the tokens
             it trained since that fragment's previous send, so its pushes' weights sum to its tokens once
             per fragment; the tokens of its pushes that the shard accepted into rounds that closed are its
             pushed tokens times the share of its distinct pushes that were accepted (accepted + duplicate
             - resent over all answers - resent: a push sent again after a shard restart is one push).
             That weighs each push of one worker alike (true within a few percent under the adaptive
             schedule, whose pace moves slowly). The headline figure is exact instead: the tokens the
             shard's contribution credits (server/storage/credits.py) counted into closed rounds, after the
             weight caps, over the same tokens computed; the estimate is shown beside it.
             busy share = compute seconds (the step and its emulated sleep) / wall seconds of each worker
             that no fault touched, through the freeze (from its /metrics at the freeze's start and end)
             and over its whole run (its summary).
Targets (issue 27): healthy workers >= 0.90 busy through the freeze, goodput >= 0.85 across the faults.

    python -m benchmarks.chaos            # the recorded run (BENCHMARKS.md), about 20 minutes
    python -m benchmarks.chaos --quick    # toy size: shorter faults, fewer steps (about 8 minutes)

Writes results.md, results.json and run.log under --out (default benchmarks/results/chaos). Every process it
starts is stopped at the end, on an error and on Ctrl+C; the network namespace is removed.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    Procs,
    Run,
    Session,
    bench_parser,
    free_port,
    http_json,
    loadavg,
    netns,
    say,
    sd,
    wait_quiet,
)

SPEEDS = (0.05, 0.08, 0.1, 0.13, 0.16, 0.2)  # --step-delay of w0..w5: seconds of emulated accelerator step
JOINER, JOINER_DELAY = 6, 0.1  # w6 joins mid-run
FROZEN, KILLED, DROPPED = 2, 3, 4  # the workers that the faults hit; the others are the healthy ones
POLL = 0.25  # seconds between two readings of every worker's /metrics and the shard's status
SYNC = ["--model", "nano", "--sync-every", "12", "--num-fragments", "3", "--sync-schedule", "adaptive"]
NETNS, HOST_IF, NS_IF = "sdchaos-w", "sdchaos-h", "chaos0"  # the dropped worker's namespace and veth pair
HOST_ADDR, NS_ADDR = "10.213.79.1", "10.213.79.2"  # a /30 that exists only on this veth pair
NS_EXEC = netns.in_ns(NETNS)


# --- goodput: pure ------------------------------------------------------------------------------------------
@dataclass
class Counts:
    """One worker process's counters, as its /metrics last said: tokens it trained (since it started, a
    resumed one's from its checkpoint's count), tokens it had trained at its latest accepted push, and the
    answers to its pushes by outcome, and the pushes it sent again after a reconnect."""

    tokens: float = 0.0
    tokens_pushed: float = 0.0
    accepted: int = 0
    late: int = 0
    refused: int = 0
    duplicate: int = 0
    resent: int = 0


def reached_tokens(c: Counts) -> float:
    """The tokens of this process's pushes that the shard took into rounds: its pushed tokens times the share
    of its distinct pushes accepted (a resent push is answered twice: once by the shard that lost it)."""
    answers = c.accepted + c.late + c.refused + c.duplicate
    distinct = answers - c.resent
    if distinct <= 0:
        return 0.0
    taken = max(0, c.accepted + c.duplicate - c.resent)
    return c.tokens_pushed * min(1.0, taken / distinct)


def goodput(processes: list[Counts]) -> float:
    """Tokens that reached the model over tokens computed, over every worker process (1.0: none computed)."""
    computed = sum(c.tokens for c in processes)
    return sum(reached_tokens(c) for c in processes) / computed if computed > 0 else 1.0


def ledger_goodput(credits: dict, processes: list[Counts]) -> float:
    """Goodput from the shard's contribution credits (/api/status "credits", server/storage/credits.py): the
    tokens it counted into closed rounds, every identity's and the folded rows', over the tokens computed.
    Exact where the estimate above weighs each push alike; the ledger's tokens are after the weight caps."""
    computed = sum(c.tokens for c in processes)
    reached = sum(r["tokens"] for r in credits["workers"]) + credits["others"]["tokens"]
    return reached / computed if computed > 0 else 1.0


def busy_share(start: tuple[float, float], end: tuple[float, float]) -> float | None:
    """Compute seconds over wall seconds between two (wall time, compute seconds) readings."""
    wall = end[0] - start[0]
    return (end[1] - start[1]) / wall if wall > 0 else None


# --- reading the processes ----------------------------------------------------------------------------------
METRIC = re.compile(r'^streamdiloco_worker_(\w+?)(?:\{\w+="(\w+)"\})? ([0-9.e+-]+)$', re.M)


def read_metrics(url: str, timeout: float = 1.0) -> dict[str, float] | None:
    """A worker's samples from its /metrics, by name (name.label for a labelled one: pushes_total.accepted,
    phase.training); None when it does not answer (frozen, dead, its link down, not serving yet)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            text = r.read().decode()
    except (OSError, ValueError):
        return None
    return {f"{n}.{label}" if label else n: float(v) for n, label, v in METRIC.findall(text)}


@dataclass
class Proc:
    """One worker process and what the poller read of it (a restarted worker is a second Proc)."""

    name: str
    popen: subprocess.Popen
    metrics_url: str
    resumed: bool = False
    counts: Counts = field(default_factory=Counts)
    samples: list[tuple[float, float]] = field(default_factory=list)  # (time, compute s) while training
    base: float | None = None  # tokens at its first reading in training: a resumed one's checkpoint's count

    def read(self) -> None:
        m = read_metrics(self.metrics_url)
        if m is None or m.get("phase.training", 0.0) + m.get("phase.finished", 0.0) == 0.0:
            return
        tokens = m.get("tokens_total", 0.0)
        if self.base is None:
            self.base = tokens if self.resumed else 0.0
        c = self.counts
        accepted = int(m.get("pushes_total.accepted", 0))
        if accepted > c.accepted:  # a push accepted since the last reading: what it had trained then
            c.tokens_pushed = tokens - self.base
        c.tokens, c.accepted = tokens - self.base, accepted
        c.late, c.refused = int(m.get("pushes_total.late", 0)), int(m.get("pushes_total.refused", 0))
        c.duplicate, c.resent = int(m.get("pushes_total.duplicate", 0)), int(m.get("pushes_resent_total", 0))
        self.samples.append((time.time(), m.get("compute_seconds_total", 0.0)))

    def busy(self, t0: float, t1: float) -> float | None:
        """Its busy share between t0 and t1, from the readings nearest to them."""
        if not self.samples:
            return None
        a = min(self.samples, key=lambda s: abs(s[0] - t0))
        b = min(self.samples, key=lambda s: abs(s[0] - t1))
        return busy_share(a, b)


class Poller(threading.Thread):
    """Reads every live worker's /metrics every POLL s, in the background; `procs` may grow meanwhile."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.procs: list[Proc] = []
        self.lock = threading.Lock()
        self.halt = threading.Event()

    def add(self, p: Proc) -> None:
        with self.lock:
            self.procs.append(p)

    def run(self) -> None:
        while not self.halt.is_set():
            with self.lock:
                live = [p for p in self.procs if p.popen.poll() is None]
            for p in live:
                p.read()
            self.halt.wait(POLL)


# --- the network namespace of the dropped worker ----------------------------------------------------------
def netns_down() -> None:
    netns.remove(NETNS)  # and so the veth pair


def netns_up() -> str | None:
    """A namespace with one veth pair to this one (HOST_ADDR here, NS_ADDR there); None when it works, else
    why not (not root, no iproute2, no namespaces in this container)."""
    if why := netns.missing():
        return why
    netns_down()  # an interrupted run's
    try:
        netns.add(NETNS)
        netns.add_veth(HOST_IF, NS_IF, NETNS)
        netns.address(HOST_IF, f"{HOST_ADDR}/30")
        netns.address(NS_IF, f"{NS_ADDR}/30", ns=NETNS)
    except RuntimeError as e:
        netns_down()
        return str(e)
    return None


def set_link(up: bool) -> None:
    netns.set_link(HOST_IF, up)


# --- one run ------------------------------------------------------------------------------------------------
def wait_for(what: str, pred: Callable[[], Any], timeout: float) -> Any:
    """Poll `pred` until it returns something true; its value. RuntimeError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            v = pred()
        except OSError:  # the shard restarting
            v = None
        if v:
            return v
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


@dataclass(frozen=True)
class Sizes:
    steps: int  # schedule steps of the run (about 0.23 s each: the slowest worker's step)
    freeze: float  # seconds the frozen worker stays stopped
    link_down: float  # seconds the dropped worker's link stays down
    warmup_round: int  # fragment 0's round after which the faults begin


FULL = Sizes(steps=1600, freeze=60.0, link_down=30.0, warmup_round=3)
QUICK = Sizes(steps=600, freeze=12.0, link_down=6.0, warmup_round=2)


class ChaosRun:
    """One run: the shard, the workers and the poller of their metrics; with `faults`, the faults."""

    def __init__(self, procs: Procs, tmp: Path, tag: str, sizes: Sizes, netns: bool):
        self.procs, self.tmp, self.tag, self.sizes, self.netns = procs, tmp, tag, sizes, netns
        self.run = Run(procs, tmp, tag)
        self.poller = Poller()
        self.events: list[dict] = []
        self.windows: list[tuple[str, float, float]] = []  # each fault: from its start to its recovery
        self.procs_started: list[Proc] = []
        self.t0 = time.time()
        flags = [*SYNC, "--min-workers", "1", "--liveness-timeout", "5"]
        flags += ["--checkpoint-dir", str(tmp / f"{tag}-shard-ckpt")]
        if netns:
            flags += ["--host", "0.0.0.0", "--insecure"]  # the namespaced worker: through its veth pair
        self.shard_flags = flags
        self.ports = self.run.shard(0, 1, [*flags, "--fresh"])

    def status(self) -> dict:
        return http_json(self.ports["http_port"])

    def members(self) -> set[str]:
        return {m["name"] for m in self.status()["members"] if m["state"] == "member"}

    def note(self, what: str, **extra: Any) -> None:
        t = time.time() - self.t0
        self.events.append({"t": round(t, 1), "event": what, **extra})
        say(f"  [{self.tag} {t:6.1f} s] {what}" + (f" {extra}" if extra else ""))

    def worker(self, m: int, resumed: bool = False) -> Proc:
        """Start worker m (w<m>, its step SPEEDS[m]; a restart resumes from its checkpoint)."""
        name, port = f"w{m}", free_port()
        servers, wrap, metrics_host = f"127.0.0.1:{self.ports['grpc_port']}", [], "127.0.0.1"
        if self.netns and m == DROPPED:
            servers, wrap, metrics_host = f"{HOST_ADDR}:{self.ports['grpc_port']}", NS_EXEC, NS_ADDR
        argv = ["worker", "--servers", servers, "--name", name, "--rank", str(m), *SYNC]
        argv += ["--steps", str(self.sizes.steps), "--batch-size", "8"]
        argv += ["--step-delay", str(SPEEDS[m] if m < len(SPEEDS) else JOINER_DELAY)]
        argv += ["--eval-every", "0", "--eval-batches", "1", "--log-every", "100"]
        argv += [
            "--checkpoint-every",
            "40",
            "--auto-resume",
            "--checkpoint",
            str(self.tmp / f"{self.tag}-{name}.pt"),
        ]
        argv += ["--summary", str(self.tmp / f"{self.tag}-{name}.json"), "--metrics-port", str(port)]
        if metrics_host != "127.0.0.1":
            argv += ["--metrics-host", metrics_host, "--insecure"]
        label = f"{self.tag}-{name}" + ("-restart" if resumed else "")
        p = self.procs.start(label, wrap + sd(*argv), env_extra={"OMP_NUM_THREADS": "1"})
        proc = Proc(name, p, f"http://{metrics_host}:{port}/metrics", resumed)
        self.poller.add(proc)
        self.procs_started.append(proc)
        return proc

    def pushes_again(self, proc: Proc, timeout: float = 300) -> float:
        """Wait until the shard accepts a push of proc's after now (counted from a reading of its metrics
        taken after now: the last one before a freeze or a link drop may be stale); the seconds that
        took."""
        t = time.time()
        wait_for(f"a reading of {proc.name}", lambda: proc.samples and proc.samples[-1][0] > t, timeout)
        n = proc.counts.accepted
        wait_for(f"{proc.name} to push again", lambda: proc.counts.accepted > n, timeout)
        return time.time() - t

    # --- the faults -------------------------------------------------------------------------------------
    def freeze(self, proc: Proc, others: list[Proc]) -> dict:
        t_stop = time.time()
        proc.popen.send_signal(signal.SIGSTOP)
        self.note(f"freeze {proc.name} (SIGSTOP) for {self.sizes.freeze:g} s")
        wait_for(f"the shard to drop {proc.name}", lambda: proc.name not in self.members(), 60)
        dropped = time.time() - t_stop
        self.note(f"{proc.name} dropped by the shard", seconds=round(dropped, 1))
        time.sleep(max(0.0, t_stop + self.sizes.freeze - time.time()))  # the fault's length is the fault
        t_cont = time.time()
        proc.popen.send_signal(signal.SIGCONT)
        self.note(f"thaw {proc.name} (SIGCONT)")
        back = self.pushes_again(proc)
        self.note(f"{proc.name} accepted again", seconds=round(back, 1))
        self.windows.append(("freeze", t_stop, time.time()))
        time.sleep(2 * POLL)  # a reading of every other worker after the thaw
        busy = {o.name: o.busy(t_stop, t_cont) for o in others}
        return {"dropped_after": dropped, "back_after": back, "busy": busy}

    def kill(self, proc: Proc) -> tuple[Proc, dict]:
        ckpt = self.tmp / f"{self.tag}-{proc.name}.pt"
        wait_for(f"{proc.name}'s checkpoint", ckpt.exists, 300)
        time.sleep(2 * POLL)  # a reading right before the kill
        proc.popen.send_signal(signal.SIGKILL)
        proc.popen.wait()
        t_kill = time.time()
        self.note(f"kill {proc.name} (SIGKILL); start it again with --auto-resume")
        again = self.worker(int(proc.name[1:]), resumed=True)
        wait_for(f"{proc.name}'s restart to push", lambda: again.counts.accepted > 0, 300)
        back = time.time() - t_kill
        self.note(f"{proc.name} (restarted) accepted", seconds=round(back, 1))
        self.windows.append(("kill", t_kill, time.time()))
        return again, {"back_after": back}

    def join(self) -> tuple[Proc, dict]:
        t = time.time()
        self.note(f"w{JOINER} joins")
        p = self.worker(JOINER)
        wait_for(f"w{JOINER}'s first accepted push", lambda: p.counts.accepted > 0, 300)
        self.note(f"w{JOINER} accepted", seconds=round(time.time() - t, 1))
        self.windows.append(("join", t, time.time()))
        return p, {"first_push_after": time.time() - t}

    def restart_shard(self, live: list[Proc]) -> dict:
        closed = self.status()["rounds_closed"]
        p = self.run.p[f"{self.tag}-shard0"]
        p.send_signal(signal.SIGKILL)
        p.wait()
        t_kill = time.time()
        before = {q.name: q.counts.accepted for q in live}
        self.note(f"kill the shard (SIGKILL) after {closed} rounds; start it again from its checkpoint")
        self.ports = self.run.shard(0, 1, self.shard_flags, port=self.ports["grpc_port"])
        serving = time.time() - t_kill
        wait_for(
            "every worker to push to the restarted shard",
            lambda: all(q.counts.accepted > before[q.name] for q in live if q.popen.poll() is None),
            300,
        )
        back = time.time() - t_kill
        self.note("every worker accepted again", serving_after=round(serving, 1), seconds=round(back, 1))
        self.windows.append(("shard", t_kill, time.time()))
        return {"serving_after": serving, "back_after": back}

    def drop_link(self, proc: Proc) -> dict:
        t = time.time()
        set_link(False)
        self.note(f"{proc.name}'s link down for {self.sizes.link_down:g} s")
        try:
            time.sleep(self.sizes.link_down)
        finally:
            set_link(True)
        self.note(f"{proc.name}'s link up")
        back = self.pushes_again(proc)
        self.note(f"{proc.name} accepted again", seconds=round(back, 1))
        self.windows.append(("link", t, time.time()))
        return {"back_after": back}

    # --- the whole run --------------------------------------------------------------------------------
    def execute(self, faults: bool) -> dict:
        self.poller.start()
        workers = {m: self.worker(m) for m in range(len(SPEEDS))}
        out: dict[str, Any] = {"tag": self.tag, "faults": faults, "netns": self.netns}
        warm = self.sizes.warmup_round
        wait_for(f"round {warm}", lambda: self.status()["fragments"][0]["round"] >= warm, 300)
        wait_for(
            "every worker's first accepted push",
            lambda: all(w.counts.accepted for w in workers.values()),
            300,
        )
        self.note(f"warm: fragment 0 at round {warm}, every worker pushed")
        others = [w for m, w in workers.items() if m != FROZEN]
        if faults:
            out["freeze"] = self.freeze(workers[FROZEN], others)
            _, out["kill"] = self.kill(workers[KILLED])
            _, out["join"] = self.join()
            out["shard_restart"] = self.restart_shard(
                [q for q in self.procs_started if q.popen.poll() is None]
            )
            out["link"] = self.drop_link(workers[DROPPED]) if self.netns else None
        else:  # the busy share over a window as long as the freeze, from the same point of the run
            t = time.time()
            time.sleep(self.sizes.freeze + 2 * POLL)
            out["freeze"] = {"busy": {o.name: o.busy(t, t + self.sizes.freeze) for o in others}}
        self.note("waiting for the workers to end")
        for q in self.procs_started:
            if q.popen.poll() is None and q.popen.wait(1800) != 0:
                label = f"{self.tag}-{q.name}" + ("-restart" if q.resumed else "")
                raise RuntimeError(f"{label} exited with {q.popen.returncode}:\n{self.procs.tail(label)}")
        self.poller.halt.set()
        self.poller.join()
        status = self.status()
        self.run.stop_shards()
        self.note("the workers ended")
        healthy = [w for m, w in workers.items() if m not in (FROZEN, KILLED, DROPPED)]
        summaries = {}
        for q in self.procs_started:
            if q.popen.returncode == 0:  # its summary has the final counts exactly (a killed one has none)
                s = summaries[q.name] = json.loads((self.tmp / f"{self.tag}-{q.name}.json").read_text())
                q.counts.tokens = q.counts.tokens_pushed = s["tokens"] - (q.base or 0.0)  # the final sync
        out["processes"] = [
            {
                "name": q.name,
                "restart": q.resumed,
                **asdict(q.counts),
                "reached": reached_tokens(q.counts),
                # steps it skipped to go on where the run was, after coming back whole rounds behind
                "skipped_steps": summaries[q.name].get("skipped_steps") if q.popen.returncode == 0 else None,
            }
            for q in self.procs_started
        ]
        out["goodput"] = goodput([q.counts for q in self.procs_started])
        out["goodput_ledger"] = ledger_goodput(status["credits"], [q.counts for q in self.procs_started])
        out["healthy"] = [w.name for w in healthy]
        out["busy_run"] = {w.name: summaries[w.name]["compute_utilization"] for w in healthy}
        out["windows"] = [  # what each fault cost the healthy workers: their busy share while it lasted
            {"fault": f, "seconds": t1 - t0, "busy": {w.name: w.busy(t0, t1) for w in healthy}}
            for f, t0, t1 in self.windows
        ]
        out["pushes"] = {
            k: sum(getattr(q.counts, k) for q in self.procs_started) for k in ("accepted", "late", "refused")
        }
        out["shard"] = {k: status[k] for k in ("rounds_closed", "pushes_accepted", "pushes_refused")}
        out["events"] = self.events
        out["wall_seconds"] = time.time() - self.t0
        say(
            f"  [{self.tag}] goodput {out['goodput_ledger']:.3f} (ledger; estimate {out['goodput']:.3f}); "
            "busy through the freeze "
            f"{fmt_busy(out['freeze']['busy'])}; healthy over the run {fmt_busy(out['busy_run'])}"
        )
        return out


def mean_busy(busy: dict[str, float | None]) -> float:
    known = [v for v in busy.values() if v is not None]
    return sum(known) / len(known) if known else float("nan")


def fmt_busy(busy: dict[str, float | None]) -> str:
    return ", ".join(f"{k} {v:.2f}" if v is not None else f"{k} ?" for k, v in busy.items())


# --- the report ---------------------------------------------------------------------------------------------
def table(calm: dict, chaos: dict, sizes: Sizes) -> list[str]:
    """results.md's body: the setting, goodput, the busy shares, what each fault cost, the processes."""
    return [
        *_goodput_table(calm, chaos, sizes),
        *_busy_table(calm, chaos, sizes),
        *_fault_lines(calm, chaos),
        *_process_table(chaos),
    ]


def _goodput_table(calm: dict, chaos: dict, sizes: Sizes) -> list[str]:
    lines = [
        f"One shard, workers w0-w5 at {', '.join(f'{s:g}' for s in SPEEDS)} s emulated steps (nano GPT, "
        f"H = 12, P = 3, --sync-schedule adaptive, --liveness-timeout 5), {sizes.steps} schedule steps; "
        f"faults: w{FROZEN} frozen {sizes.freeze:g} s, w{KILLED} killed and restarted, w{JOINER} joins, "
        f"the shard killed and restarted, w{DROPPED}'s link down {sizes.link_down:g} s"
        + ("" if chaos["netns"] else " (skipped: no network namespaces)")
        + ".",
        "",
        "Goodput: the tokens the shard's contribution credits counted into closed rounds (after the weight "
        "caps) over the tokens every worker process computed; beside it the estimate from each process's "
        "push answers (reached_tokens).",
        "",
        "| run | goodput (ledger) | goodput (estimate) | pushes accepted / late / refused | "
        "healthy workers busy, whole run | wall s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, r in (("undisturbed", calm), ("chaos", chaos)):
        p = r["pushes"]
        lines.append(
            f"| {label} | {r['goodput_ledger']:.3f} | {r['goodput']:.3f} | "
            f"{p['accepted']} / {p['late']} / {p['refused']} | "
            f"{mean_busy(r['busy_run']):.3f} | {r['wall_seconds']:.0f} |"
        )
    return lines


def _busy_table(calm: dict, chaos: dict, sizes: Sizes) -> list[str]:
    names = sorted(set(calm["freeze"]["busy"]) | set(chaos["freeze"]["busy"]), key=lambda n: int(n[1:]))
    healthy = set(chaos["healthy"])

    def b(run: dict, key: str, n: str) -> str:
        v = run[key].get(n) if key == "busy_run" else run["freeze"]["busy"].get(n)
        return f"{v:.3f}" if v is not None else "-"

    lines = [
        "",
        f"Busy share (compute / wall) through the {sizes.freeze:g} s freeze (from SIGSTOP to SIGCONT; the "
        "undisturbed run: as long a window from the same point), and over the whole run for the workers no "
        "fault touched:",
        "",
        "| worker | step s | freeze: undisturbed | freeze: chaos | run: undisturbed | run: chaos |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for n in names:
        mark = "" if n in healthy else " (faulted later)"
        lines.append(
            f"| {n}{mark} | {SPEEDS[int(n[1:])]:g} | {b(calm, 'freeze', n)} | {b(chaos, 'freeze', n)} | "
            + (f"{b(calm, 'busy_run', n)} | {b(chaos, 'busy_run', n)} |" if n in healthy else "- | - |")
        )
    return lines


def _fault_lines(calm: dict, f: dict) -> list[str]:
    lines = [
        "",
        "What each fault cost: the healthy workers' (w0, w1, w5) mean busy share from the fault until the "
        "worker it hit had a push accepted again (the freeze: until after the SIGCONT; undisturbed: "
        f"{mean_busy(calm['busy_run']):.3f} over the run), and their idle seconds beyond the undisturbed "
        "share:",
        "",
        "| fault | seconds | healthy busy | idle s beyond undisturbed |",
        "|---|---:|---:|---:|",
    ]
    for w in f["windows"]:
        share = mean_busy(w["busy"])
        idle = max(0.0, mean_busy(calm["busy_run"]) - share) * w["seconds"]
        lines.append(f"| {w['fault']} | {w['seconds']:.1f} | {share:.3f} | {idle:.1f} |")
    return lines + [
        "",
        "Seconds from each fault until the worker it hit pushed again:",
        "",
        f"- freeze: dropped by the shard after {f['freeze']['dropped_after']:.1f} s, accepted again "
        f"{f['freeze']['back_after']:.1f} s after SIGCONT",
        f"- kill: the restart accepted {f['kill']['back_after']:.1f} s after the SIGKILL",
        f"- join: first push accepted {f['join']['first_push_after']:.1f} s after its start",
        f"- shard: serving again {f['shard_restart']['serving_after']:.1f} s after the SIGKILL, every worker "
        f"accepted {f['shard_restart']['back_after']:.1f} s after it",
        f"- link: accepted again {f['link']['back_after']:.1f} s after the link came back"
        if f["link"]
        else "- link: skipped (no network namespaces)",
    ]


def _process_table(chaos: dict) -> list[str]:
    lines = ["", "Per process (tokens computed, and those that reached the model):", ""]
    lines += ["| process | tokens | reached | accepted | late | refused | duplicate | resent |"]
    lines += ["|---|---:|---:|---:|---:|---:|---:|---:|"]
    for p in chaos["processes"]:
        lines.append(
            f"| {p['name']}{' (restart)' if p['restart'] else ''} | {p['tokens']:,.0f} | "
            f"{p['reached']:,.0f} | {p['accepted']} | {p['late']} | {p['refused']} | {p['duplicate']} | "
            f"{p['resent']} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = bench_parser(__doc__, "chaos", quick_help="toy size: shorter faults, fewer steps", max_wait=60.0)
    ap.add_argument("--no-netns", action="store_true", help="skip the link drop (no network namespace)")
    a = ap.parse_args(argv)
    sizes = QUICK if a.quick else FULL
    md: list[str] = []
    with Session("chaos", argv, Path(a.out)) as s:
        s.results["sizes"] = asdict(sizes)
        why = "--no-netns" if a.no_netns else netns_up()
        if why is None:
            s.cleanup(netns_down)
        else:
            say(f"the link drop is skipped: {why}")
        for tag, faults in (("calm", False), ("chaos", True)):
            wait_quiet(tag, a.max_wait)
            load = loadavg()
            say(f"[{tag}] load average {load}")
            s.results[tag] = ChaosRun(s.procs, s.tmp, tag, sizes, why is None and faults).execute(faults)
            s.results[tag]["loadavg"] = [load, loadavg()]
        md += table(s.results["calm"], s.results["chaos"], sizes)
        calm_load, chaos_load = (" -> ".join(s.results[tag]["loadavg"]) for tag in ("calm", "chaos"))
        md += [
            "",
            f"Load average (1, 5, 15 min) at the start and end of each run: undisturbed {calm_load}, "
            f"chaos {chaos_load}.",
        ]
    return s.finish(md)


if __name__ == "__main__":
    sys.exit(main())
