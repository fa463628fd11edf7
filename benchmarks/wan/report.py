"""The WAN benchmark's report: a run's line, the runs' table and its note, the self-checks' table, the plot
of compute utilization against bandwidth (with the event model's prediction, sim/utilization.py), and the
two commands that need no network: `combine` (one table and plot from several runs' results.json) and
`pings` (how long HTTP/2 pings waited for their acks, from gRPC's trace in kept logs).

Pure reading and writing of figures: it starts no process and touches no network.
"""

from __future__ import annotations

import json
import re
import shlex
import statistics
from collections.abc import Iterable
from pathlib import Path

from benchmarks.wan.testbed import QUEUE, tbf_params


def rate_label(rate: float | None) -> str:
    return "unlimited" if rate is None else f"{rate:g} Mbit/s"


TABLE_NOTE = """\
Compute utilization: steps × t_ref ÷ wall time of the training loop, where t_ref is the step time of the
same loop without communication, measured at the same point with every worker process running at once.
Without the final sync: the same with the wall time of the run's last step's sync taken out (every fragment
sent and merged once more, waited for: once per run, seconds on a slow link; its own column). DDP has none.
Own (workers): streamdiloco's compute_utilization (its compute time ÷ its training time). KB/step: bytes
through the worker's interface during training (tx up, rx down; Ethernet, IP and TCP headers included),
mean over the workers; results.json has the whole runs too (with the shard's Fetch of the masters, DDP's
first broadcast). A run stopped at its time bound reports the steps it did (its bytes include those of the
step it was in); its eval loss is "—"."""


# --- output -------------------------------------------------------------------------------------------------
def _f(x, fmt: str, none: str = "—") -> str:
    return none if x is None else format(x, fmt)


def _pct(x: float | None, digits: int = 1) -> str:
    return "—" if x is None else f"{100 * x:.{digits}f}%"


def _kb(x: float | None) -> str:
    return "—" if x is None else f"{x / 1e3:.1f}"


def run_line(r: dict) -> str:
    return (
        f"{r['system']:>3} {rate_label(r['rate_mbit']):>13} {r['delay_ms']:g} ms: {r['status']}, "
        f"{r['steps']} steps in {_f(r['train_seconds'], '.1f')} s ({_f(r['steps_per_s'], '.2f')} steps/s), "
        f"utilization {_pct(r['utilization'], 0)} "
        f"(without the final sync {_pct(r['utilization_steady'], 0)}; "
        f"own {_pct(r['own_utilization'], 0)}), "
        f"KB/step up {_kb(r['up_bytes_per_step'])} down {_kb(r['down_bytes_per_step'])}, "
        f"blocked {_f(r['blocked_seconds'], '.1f')} s, eval loss {_f(r['eval_loss'], '.4f')} "
        f"({r['seconds']:.0f} s)"
    )


def results_table(runs: list[dict]) -> str:
    head = (
        "| system | Mbit/s each way | one-way delay | steps | compute utilization | without the final sync "
        "| own (workers) | steps/s | KB/step up | KB/step down | blocked s | final sync s | eval loss "
        "| status |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        cells = [
            "streamdiloco" if r["system"] == "sdl" else "DDP (gloo)",
            rate_cell(r["rate_mbit"]),
            f"{r['delay_ms']:g} ms",
            str(r["steps"]),
            _pct(r["utilization"]),
            _pct(r.get("utilization_steady")),
            _pct(r["own_utilization"]),
            _f(r["steps_per_s"], ".2f"),
            _kb(r["up_bytes_per_step"]),
            _kb(r["down_bytes_per_step"]),
            _f(r["blocked_seconds"], ".1f"),
            _f(r.get("final_sync_seconds") if r["system"] == "sdl" else None, ".1f"),
            _f(r["eval_loss"], ".4f"),
            r["status"],
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def check_line(rate: float | None, delay_ms: float, c: dict, queue: float = QUEUE) -> str:
    expect = ""
    if rate:
        burst, limit = tbf_params(rate, queue)
        expect = (
            f" (expected ~{0.956 * rate:.3g} Mbit/s of TCP payload; tbf burst {burst} B, limit {limit} B)"
        )
    return (
        f"[{rate_label(rate)}, {delay_ms:g} ms] self-check: round trip to the shard "
        + ", ".join(f"w{i} {x:.1f} ms" for i, x in enumerate(c["rtt_ms"]))
        + (f", w0→w1 {c['rtt_peer_ms']:.1f} ms" if c["rtt_peer_ms"] is not None else "")
        + f" (expected {2 * delay_ms:g}); bulk {c['bulk_bytes'] / 1e6:.2f} MB: "
        f"up {c['up_mbit']:.3g} Mbit/s, down {c['down_mbit']:.3g} Mbit/s{expect}"
    )


def rate_cell(rate: float | None) -> str:
    return "unlimited" if rate is None else format(rate, "g")


def checks_table(points: list[dict]) -> str:
    lines = [
        "| Mbit/s each way | one-way delay | round trip worker→shard (ms) | worker 0→1 (ms) "
        "| up Mbit/s (payload) | down Mbit/s | t_ref (ms/step) |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in points:
        c = p["check"]
        lines.append(
            f"| {rate_cell(p['rate_mbit'])} | {p['delay_ms']:g} ms "
            f"| {', '.join(f'{x:.1f}' for x in c['rtt_ms'])} | {_f(c['rtt_peer_ms'], '.1f')} "
            f"| {c['up_mbit']:.3g} | {c['down_mbit']:.3g} "
            f"| {_f(p.get('reference') and 1e3 * p['reference']['step_seconds'], '.1f')} |"
        )
    return "\n".join(lines)


def series_label(r: dict) -> str:
    """A run's curve: its system, and the streamdiloco flags it ran with beyond the defaults."""
    base = "streamdiloco" if r["system"] == "sdl" else "DDP (gloo)"
    flags = r.get("sdl_flags") if r["system"] == "sdl" else ""
    return f"{base} {flags}" if flags else base


def plot(
    runs: list[dict], path: Path, workers: int, predicted: dict[str, list[tuple[float, float]]] | None = None
) -> Path:
    """Compute utilization against bandwidth (log x; unlimited at the right), per system (and flags) and
    delay; open markers: runs stopped at their time bound. `predicted`: curves of the event model
    (sim/utilization.py), label -> [(Mbit/s or inf, utilization)], drawn thin and dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = sorted({r["rate_mbit"] for r in runs if r["rate_mbit"] is not None})
    x_inf = 4 * finite[-1] if finite else 1.0

    def x(r: dict) -> float:
        return x_inf if r["rate_mbit"] is None else r["rate_mbit"]

    fig, ax = plt.subplots(figsize=(8, 4.8))
    delays = sorted({r["delay_ms"] for r in runs})
    labels = sorted({series_label(r) for r in runs}, key=lambda t: (not t.startswith("streamdiloco"), t))
    colors = ["tab:blue", "tab:green", "tab:purple", "tab:orange"]
    for i, label in enumerate(labels):
        ddp = label.startswith("DDP")
        color, marker = ("tab:red", "s") if ddp else (colors[i % len(colors)], "o")
        for k, delay in enumerate(delays):
            mine = sorted((r for r in runs if series_label(r) == label and r["delay_ms"] == delay), key=x)
            if not mine:
                continue
            ys = [100 * (r["utilization"] or 0.0) for r in mine]
            ax.plot(
                [x(r) for r in mine],
                ys,
                color=color,
                marker=marker,
                linestyle=["-", "--", ":", "-."][k % 4],
                label=f"{label}, {delay:g} ms one-way",
            )
            cut = [(x(r), y) for r, y in zip(mine, ys, strict=True) if r["status"] != "ok"]
            if cut:
                ax.scatter(*zip(*cut, strict=True), marker=marker, color="white", edgecolors=color, zorder=3)
    for j, (label, pts) in enumerate((predicted or {}).items()):
        xs = [x_inf if b == float("inf") else b for b, _ in pts]
        ax.plot(
            xs,
            [100 * u for _, u in pts],
            color="black",
            linewidth=0.8,
            linestyle=["--", ":"][j % 2],
            label=label,
        )
    ax.axhline(95, color="gray", linewidth=1, linestyle=":", label="95%")
    ax.set_xscale("log")
    ax.minorticks_off()
    ticks = finite + [x_inf]
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{t:g}" for t in finite] + ["unlimited"], rotation=45)
    ax.set_xlabel("bandwidth each way (Mbit/s); open markers: stopped early (time bound or failure)")
    ax.set_ylabel("compute utilization (%)")
    ax.set_ylim(0, 105)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=7)
    ax.set_title(f"Compute utilization across emulated WAN links ({workers} workers)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def predict_runs(runs: list[dict], settings: dict, policy: str) -> list[tuple[float, float]]:
    """The event model's utilization for streamdiloco's measured points at 25 ms (their t_ref, the model's
    real layout, a whole run of the measured length with its final sync, as the measurement counts it)."""
    from streamdiloco.common.fragments import build_layout
    from streamdiloco.common.modelspec import build_model
    from streamdiloco.sim.eventmodel import RunModel, simulate

    mine = [r for r in runs if r["system"] == "sdl"]
    if not mine:
        return []
    model = build_model(settings["model"], settings["seed"], settings["block_size"])
    layout = build_layout(model, settings["num_fragments"], "strided")
    values = tuple(f.numel for f in layout.fragments)
    codecs = _codec_flags(settings.get("sdl_flags", ""))
    out = []
    for r in sorted(mine, key=lambda r: r["rate_mbit"] or float("inf")):
        bps = float("inf") if r["rate_mbit"] is None else r["rate_mbit"] * 1e6 * 0.956  # TCP payload of tbf
        m = RunModel(
            values,
            r["t_ref"],
            sync_every=settings["sync_every"],
            policy=policy,
            workers=settings["workers"],
            uplink_bps=bps,
            downlink_bps=bps,
            latency=r["delay_ms"] / 1e3,
            steps=settings["steps"],
            final_sync=True,
            **codecs,
        )
        out.append((float("inf") if r["rate_mbit"] is None else r["rate_mbit"], simulate(m).utilization))
    return out


def _codec_flags(flags: str) -> dict:
    """The codec settings that --sdl-flags gives the run (RunModel's fields), so that the event model counts
    the bytes the run sent: `--uplink-codec sq2 --codec-block-size=1024` -> {uplink_codec: sq2, ...}."""
    names = {
        "--uplink-codec": "uplink_codec",
        "--downlink-codec": "downlink_codec",
        "--codec-block-size": None,
    }
    out: dict = {}
    words = shlex.split(flags or "")
    for i, w in enumerate(words):
        flag, eq, value = w.partition("=")
        if flag not in names:
            continue
        if not eq:
            if i + 1 >= len(words):
                continue
            value = words[i + 1]
        if names[flag] is None:
            out["codec_block_size"] = int(value)
        else:
            out[names[flag]] = value
    return out


_PING = re.compile(  # grpc-core's http2_ping trace: a ping sent, or its ack received, by a client or server
    r"^I\d{4} (\d\d):(\d\d):(\d\d\.\d+) .* (CLIENT|SERVER)\[\w+\]: "
    r"(?:Ping (\d+) sent|received ping ack (\d+))"
)


def ping_answers(lines: Iterable[str]) -> dict[str, list[float]]:
    """Seconds from each HTTP/2 ping sent to its ack, by end (CLIENT: a worker, SERVER: a shard), read from
    grpc-core's trace (a process run with GRPC_TRACE=http2_ping GRPC_VERBOSITY=debug); a ping never
    answered is left out."""
    sent: dict[tuple[str, str], float] = {}
    out: dict[str, list[float]] = {}
    for line in lines:
        m = _PING.match(line)
        if m is None:
            continue
        h, mi, s, end, ping, ack = m.groups()
        t = int(h) * 3600 + int(mi) * 60 + float(s)
        if ping is not None:
            sent[(end, ping)] = t
        elif (end, ack) in sent:
            out.setdefault(end, []).append((t - sent.pop((end, ack))) % 86400)
    return out


def pings(logs: list[Path]) -> int:
    """`python -m benchmarks.wan pings LOG ...`: how long each process's pings waited for their answers."""
    for log in logs:
        with open(log, errors="replace") as f:
            answers = ping_answers(f)
        if not answers:
            print(f"{log}: no ping answered (none sent, or run without GRPC_TRACE=http2_ping)")
        for end, xs in sorted(answers.items()):
            print(
                f"{log} ({end.lower()}): {len(xs)} pings answered in {min(xs):.2f}-{max(xs):.2f} s "
                f"(median {statistics.median(xs):.2f} s)"
            )
    return 0


def combine(dirs: list[Path], out: Path) -> int:
    """One table and one plot from several runs of this script (their results.json), with the event model's
    prediction beside streamdiloco's measured points."""
    runs, settings = [], None
    for d in dirs:
        res = json.loads((d / "results.json").read_text())
        settings = settings or res["settings"]
        for r in res["runs"]:
            runs.append({**r, "sdl_flags": res["settings"].get("sdl_flags", ""), "source": str(d)})
    assert settings is not None
    predicted = {}
    base = [r for r in runs if r["system"] == "sdl" and not r["sdl_flags"] and r["delay_ms"] == 25]
    for policy in ("adaptive", "fixed"):
        pts = predict_runs(base, settings, policy)
        if pts:
            predicted[f"event model, {policy}, 25 ms"] = pts
    out.mkdir(parents=True, exist_ok=True)
    png = plot(runs, out / "utilization.png", settings["workers"], predicted)
    lines = [
        "| series | Mbit/s each way | one-way delay | utilization | without the final sync | event model "
        "| steps/s | KB/step up | KB/step down | final sync s | eval loss | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(runs, key=lambda r: (series_label(r), r["delay_ms"], r["rate_mbit"] or float("inf"))):
        pred = ""
        if r in base:
            pred = _pct(dict(predicted["event model, adaptive, 25 ms"]).get(r["rate_mbit"] or float("inf")))
        elif r["system"] == "sdl" and "fixed" in r["sdl_flags"] and r["delay_ms"] == 25:
            pred = _pct(predict_runs([r], settings, "fixed")[0][1])
        lines.append(
            "| "
            + " | ".join(
                [
                    series_label(r),
                    rate_cell(r["rate_mbit"]),
                    f"{r['delay_ms']:g} ms",
                    _pct(r["utilization"]),
                    _pct(r.get("utilization_steady")),
                    pred,
                    _f(r["steps_per_s"], ".2f"),
                    _kb(r["up_bytes_per_step"]),
                    _kb(r["down_bytes_per_step"]),
                    _f(r.get("final_sync_seconds") if r["system"] == "sdl" else None, ".1f"),
                    _f(r["eval_loss"], ".4f"),
                    r["status"],
                ]
            )
            + " |"
        )
    table = "\n".join(lines)
    (out / "combined.md").write_text(table + "\n")
    print(table)
    print(f"wrote {out / 'combined.md'}, {png}")
    return 0
