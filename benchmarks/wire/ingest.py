"""Part (b) of the wire benchmark, ingest: how fast shard processes take in pushes, against plain TCP.

8 client processes (clients.py) push the same E3M0 fragment slice every round: first over plain TCP to one
asyncio receiver that reads and discards, or decodes and sums, or also runs the outer step and replies with
the update; then to 1 and 2 `streamdiloco server` processes through worker.link.ShardLink, checkpointing
every round or not, with one or two fragments in flight. Per run: MB/s of E3M0 accepted (the median of the
repeats), the round times, the CPU of the receiver or shards by thread, of the clients and of the whole
machine over the measured rounds, and the shard's HTTP pages' latency while it ingests; then a cProfile of
one shard's event loop in a separate pass.

What (b) runs and measures; its tables and ratios are in ingest_report.py, the load in clients.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from benchmarks.harness import CpuSampler, Procs, bench, http_json, say, start_shards, wait_files, wait_quiet
from benchmarks.wire.clients import chunk_layout, ingest_plan, push_bytes, write_payload

MB = 1e6
WARMUP = 2  # rounds before the measured repeats: the shard's first closes, its pool's threads

# a client's command line, given its index, its ready file and its result file
ClientArgv = Callable[[int, Path, Path], list[str]]


class HttpProbe:
    """Asks a shard's /healthz and /api/status (with the masters' hashes) one after the other, as fast as
    they answer, while it is under load: their latencies in ms."""

    PATHS = ("/healthz", "/api/status")

    def __init__(self, port: int):
        self.port = port
        self.times: dict[str, list[float]] = {p: [] for p in self.PATHS}
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for path in self.PATHS:
                t0 = time.perf_counter()
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=30) as r:
                        r.read()
                    self.times[path].append((time.perf_counter() - t0) * 1e3)
                except OSError:
                    self.errors += 1
                self._stop.wait(0.02)

    def __enter__(self) -> HttpProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)

    def summary(self) -> dict:
        out: dict = {"errors": self.errors}
        for path, xs in self.times.items():
            ys = sorted(xs)
            out[path] = {
                "n": len(ys),
                "median": statistics.median(ys) if ys else None,
                "p99": ys[min(len(ys) - 1, int(0.99 * len(ys)))] if ys else None,
                "max": ys[-1] if ys else None,
            }
        return out


def rates(results: list[dict], push_bytes: int, per: int) -> dict:
    """The clients' timings (their result files) as MB/s per repeat of `per` rounds (the warm-up left out:
    push_bytes per client and round), the round times and the clients' CPU over the measured rounds."""
    rounds = len(results[0]["starts"])
    start = [min(r["starts"][k] for r in results) for k in range(rounds)]
    end = [max(r["ends"][k] for r in results) for k in range(rounds)]
    bytes_per_round = len(results) * push_bytes
    reps = []
    for j in range((rounds - WARMUP) // per):
        k0, k1 = WARMUP + j * per, WARMUP + (j + 1) * per - 1
        reps.append(bytes_per_round * per / (end[k1] - start[k0]) / MB)
    return {
        "push_bytes_per_client": push_bytes,
        "repeat_mb_s": reps,
        "median_mb_s": statistics.median(reps),
        "rounds_measured": rounds - WARMUP,
        "median_round_seconds": statistics.median(end[k] - start[k] for k in range(WARMUP, rounds)),
        "measured_seconds": end[-1] - start[WARMUP],
        "clients_cpu_seconds": sum(r["cpu"][-1] - r["cpu"][WARMUP - 1] for r in results),
    }


def _fmt_rate(row: dict) -> str:
    reps = ", ".join(f"{x:.1f}" for x in row["repeat_mb_s"])
    rnd = row["median_round_seconds"]
    return f"[b]   {row['median_mb_s']:.1f} MB/s (repeats: {reps}); median round {rnd:.3f}s"


class Ingest:
    """One part (b): the plan and payload every client pushes, written once to `tmp`, and the runs."""

    def __init__(self, args: argparse.Namespace, procs: Procs, tmp: Path):
        self.args, self.procs, self.tmp = args, procs, tmp
        self.plan = ingest_plan(args.b_model, 0)
        self.clients, self.per, self.reps = args.b_clients, args.b_rounds, args.b_repeats
        self.plan_file, self.payload = tmp / "b-plan.json", tmp / "b-payload.bin"
        self.plan_file.write_text(json.dumps(self.plan))
        write_payload(self.plan, self.payload)
        self.me = bench("wire")

    def run(self) -> dict:
        """Plain TCP by receiver mode, then gRPC by shard count, checkpointing and pipelining; the profile."""
        plan, a = self.plan, self.args
        say(
            f"[b] {a.b_model}, fragment 0: {plan['numel']:,} values = {plan['codec_bytes']:,} B of E3M0 per "
            f"push ({len(chunk_layout(plan))} chunks), {self.clients} clients, {WARMUP} warm-up + "
            f"{self.reps} x {self.per} rounds"
        )
        rows = [self.tcp_row(mode) for mode in a.b_tcp_modes]
        configs = [(n, ckpt, 1) for n in a.b_shards for ckpt in (True, False)]
        configs += [(n, ckpt, 2) for n in a.b_shards for ckpt in (True, False) if a.b_pipeline]
        rows += [self.grpc_row(shards, ckpt, pipe) for shards, ckpt, pipe in configs]
        return {
            **{k: v for k, v in plan.items() if k != "fingerprint"},
            "clients": self.clients,
            "warmup_rounds": WARMUP,
            "repeats": self.reps,
            "rows": rows,
            "profile": self.profile() if a.b_profile else None,
        }

    def _files(self, role: str) -> list[str]:
        """A client role's arguments that name the plan and the payload."""
        return [role, "--plan", str(self.plan_file), "--payload", str(self.payload)]

    def clients_run(
        self, tag: str, argv: ClientArgv, servers: list[tuple[str, subprocess.Popen]], nbytes: int, per: int
    ) -> tuple[list[dict], dict]:
        """Start the clients, wait until all are ready, say go, wait for them; their results, and the rates
        with the CPU of the servers (by thread, all of them together) and of the machine."""
        cl = []
        for i in range(self.clients):
            ready, result = self.tmp / f"{tag}-c{i}.ready", self.tmp / f"{tag}-c{i}.json"
            for f in (ready, result):
                f.unlink(missing_ok=True)
            name = f"{tag}-c{i}"
            cl.append((name, self.procs.start(name, argv(i, ready, result), stdin=True), ready))
        wait_files(self.procs, [c[2] for c in cl], [(c[0], c[1]) for c in cl] + servers, timeout=180)
        with CpuSampler([sp.pid for _, sp in servers]) as sampler:
            for _, p, _ in cl:
                assert p.stdin is not None  # started with stdin=True
                p.stdin.write("go\n")
                p.stdin.flush()
            self._wait_clients([(name, p) for name, p, _ in cl])
            time.sleep(0.05)
        results = [json.loads((self.tmp / f"{tag}-c{i}.json").read_text()) for i in range(self.clients)]
        out = rates(results, nbytes, per)
        t0 = min(r["starts"][WARMUP] for r in results)
        server_cpu, span = sampler.between(t0, t0 + out["measured_seconds"])
        machine_cpu = server_cpu.pop("ALL", 0.0)
        out |= {
            "server_cpu_seconds": sum(server_cpu.values()),
            "server_cpu_by_thread": {
                k: round(v, 2) for k, v in sorted(server_cpu.items(), key=lambda x: -x[1])
            },
            "machine_cpu_seconds": machine_cpu,  # every process on the machine, this one and the others
            "sampled_seconds": span,  # the span over which server and machine CPU were read (>= measured)
        }
        return results, out

    def _wait_clients(self, cl: list[tuple[str, subprocess.Popen]]) -> None:
        deadline = time.monotonic() + 600
        for name, p in cl:
            try:
                p.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"{name} did not finish:\n{self.procs.tail(name)}") from None
            if p.returncode:
                raise RuntimeError(f"{name} exited with status {p.returncode}:\n{self.procs.tail(name)}")

    def tcp_row(self, mode: str) -> dict:
        """The same bytes over plain TCP to one receiver that does `mode` (discard, decode, full)."""
        # reading and discarding is so fast that a repeat of `per` rounds lasts a few ms: give it more rounds
        per = self.per * 5 if mode == "discard" else self.per
        rounds = WARMUP + per * self.reps
        say(f"[b] plain TCP, receiver: {mode} ({WARMUP} + {self.reps} x {per} rounds) ...")
        busy = wait_quiet("b", self.args.max_wait)
        port_file = self.tmp / f"b-tcp-{mode}.port"
        port_file.unlink(missing_ok=True)
        rname = f"b-tcp-{mode}-receiver"
        recv = self.procs.start(
            rname,
            self.me + ["_tcp-receiver", "--plan", str(self.plan_file), "--mode", mode]
            + ["--senders", str(self.clients), "--rounds", str(rounds), "--port-file", str(port_file)],
        )  # fmt: skip
        try:
            wait_files(self.procs, [port_file], [(rname, recv)], timeout=60)
            port = int(port_file.read_text())

            def argv(i: int, ready: Path, result: Path) -> list[str]:
                return self.me + self._files("_tcp-sender") + [
                    "--mode", mode, "--port", str(port), "--rounds", str(rounds), "--ready", str(ready),
                    "--result", str(result)]  # fmt: skip

            _, r = self.clients_run(f"b-tcp-{mode}", argv, [(rname, recv)], self.plan["codec_bytes"], per)
        finally:
            self.procs.stop(recv)
        row = {"transport": "plain TCP", "receiver": mode, "rounds_per_repeat": per, **r, "busy_before": busy}
        say(_fmt_rate(row))
        return row

    def grpc_run(
        self, tag: str, wrap: list[str] | None, rounds: int, shards: int, ckpt: bool, pipe: int
    ) -> tuple[list[dict], dict, list[dict]]:
        """The clients against `shards` shard processes (run under `wrap`, e.g. cProfile): their results,
        the rates and the shards' statuses at the end."""
        flags = ["--min-workers", str(self.clients), "--round-timeout", "600", "--model", self.args.b_model]
        flags += ["--max-sessions-per-peer", str(max(8, self.clients))]  # every client comes from 127.0.0.1
        started = start_shards(self.procs, self.tmp, tag, shards, flags, wrap=wrap, checkpoint=ckpt)
        try:
            targets = ",".join(f"127.0.0.1:{info['grpc_port']}" for _, _, info in started)

            def argv(i: int, ready: Path, result: Path) -> list[str]:
                return self.me + self._files("_grpc-client") + [
                    "--target", targets, "--name", f"client-{i}", "--rounds", str(rounds),
                    "--pipeline", str(pipe), "--ready", str(ready), "--result", str(result)]  # fmt: skip

            servers = [(n, p) for n, p, _ in started]  # CPU by thread: all shards' (p0 = shard 0, ...)
            nbytes = push_bytes(self.plan, shards)  # per client and round, summed over the shards' slices
            with HttpProbe(started[0][2]["http_port"]) as probe:  # health and status while it ingests
                results, r = self.clients_run(tag, argv, servers, nbytes, self.per)
            r["http_ms"] = probe.summary()
            statuses = [http_json(info["http_port"]) for _, _, info in started]
        finally:
            for _, p, _ in started:
                self.procs.stop(p, timeout=30)
        return results, r, statuses

    def grpc_row(self, shards: int, ckpt: bool, pipe: int) -> dict:
        """One gRPC setting: `shards` shards, checkpointing every round or not, `pipe` fragments in flight."""
        what = f"{shards} shard{'s' if shards > 1 else ''}, " + (
            "checkpoint every round" if ckpt else "--no-checkpoint"
        )
        if pipe > 1:
            what += f", {pipe} fragments in flight"
        rounds = WARMUP + self.per * self.reps
        say(
            f"[b] gRPC: {what}, --min-workers {self.clients} ({WARMUP} + {self.reps} x {self.per} rounds) ..."
        )
        busy = wait_quiet("b", self.args.max_wait)
        tag = f"b-grpc-s{shards}-{'ckpt' if ckpt else 'nockpt'}-p{pipe}"
        results, r, statuses = self.grpc_run(tag, None, rounds, shards, ckpt, pipe)
        closes = [h["seconds"] for h in statuses[0]["recent_rounds"]][WARMUP:]
        row = {
            "transport": f"gRPC, {what}",
            "receiver": "full",
            "shards": shards,
            "checkpoint": ckpt,
            "pipeline": pipe,
            "rounds_per_repeat": self.per,
            **r,
            "refused": sum(len(x["refused"]) for x in results),
            "shard_pushes_accepted": sum(st["pushes_accepted"] for st in statuses),
            "shard_codec_in": sum(st["bytes"]["codec_in"] for st in statuses),
            # what the rate counts: every client's slices of every round (warm-up included)
            "shard_codec_in_expected": self.clients * rounds * r["push_bytes_per_client"],
            "shard_wire_in": sum(st["bytes"]["message_bytes_in"] for st in statuses),
            "shard_first_push_to_close_seconds": closes,
            "median_shard_first_push_to_close": statistics.median(closes) if closes else None,
            "busy_before": busy,
        }
        say(_fmt_rate(row))
        if row["shard_codec_in"] != row["shard_codec_in_expected"]:
            say(
                f"[b]   warning: the shards counted {row['shard_codec_in']:,} B of codec in, "
                f"the clients pushed {row['shard_codec_in_expected']:,} B"
            )
        return row

    def profile(self) -> dict | None:
        """One shard again under cProfile, a warm-up and one repeat: where its main thread's time goes."""
        say(f"[b] the gRPC shard again under cProfile (its main thread), {WARMUP} + {self.per} rounds ...")
        prof = self.tmp / "b-shard.prof"
        wrap = [sys.executable, "-m", "cProfile", "-o", str(prof)]
        self.grpc_run("b-prof", wrap, WARMUP + self.per, 1, True, 1)
        return profile_rows(prof, WARMUP + self.per) if prof.exists() else None


# (file name, function, what it is): the shard's main-thread work, by cumulative time in cProfile
PROFILE_ROWS = [
    ("intake.py", "read", "receiving pushes: everything the loop does per incoming message"),
    ("intake.py", "_on_push", "  handling one chunk (below, and closing the round after the last push)"),
    ("wire.py", "from_chunk", "    protobuf bytes to tensors (copies)"),
    ("state.py", "push_chunk", "    validation, staging, dequantize + fp64 sum"),
    ("staging.py", "_check", "      validation"),
    ("codecs.py", "decode", "      E3M0 decode (pushes and the update)"),
    ("runner.py", "close_due", "    closing rounds"),
    ("outer.py", "step", "      outer Nesterov step, E3M0 encode + decode of the update"),
    ("wire.py", "to_chunks", "      update to protobuf chunks"),
    ("service.py", "Session", "sending: the session's writer (queue, ByteSize)"),
]


def profile_rows(path: Path, rounds: int) -> dict:
    """Cumulative main-thread seconds of the shard's steps (PROFILE_ROWS), per round, from a cProfile file
    of the whole process (start-up included; these rows are all from the serving part)."""
    import pstats

    st = pstats.Stats(str(path))
    stats = st.stats  # type: ignore[attr-defined]  # not in typeshed's pstats
    rows = []
    for fname, fn, what in PROFILE_ROWS:
        mine = [v for (file, _line, func), v in stats.items() if func == fn and Path(file).name == fname]
        ct, calls = sum(v[3] for v in mine), sum(v[1] for v in mine)
        rows.append({"function": f"{fname}:{fn}", "what": what, "calls": calls, "seconds": ct,
                     "per_round": ct / rounds})  # fmt: skip
    return {"rounds": rounds, "total_seconds": st.total_tt, "rows": rows}  # type: ignore[attr-defined]  # as above
