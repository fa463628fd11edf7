"""Part (b)'s report: the ingest table (every run beside plain TCP reading and discarding), the ratios of
each gRPC setting to the TCP references and of S shards to one, and where a shard's main thread spends its
time. Pure: it reads part (b)'s results (ingest.py) and adds the ratios to them; it starts nothing.
"""

from __future__ import annotations

from benchmarks.harness import say


def table_b(b: dict) -> str:
    ref = b["rows"][0]["median_mb_s"]
    lines = [
        "| transport | receiver does | MB/s of E3M0 accepted (median) | repeats (MB/s) | median round | "
        "÷ plain TCP, discard | receiver CPU | clients' CPU | machine CPU (all processes) |",
        "|" + "---|" * 9,
    ]
    what = {
        "discard": "read, discard",
        "decode": "read, decode, fp64 sum",
        "full": "decode, fp64 sum, outer step, E3M0 update to all",
    }
    for r in b["rows"]:
        lines.append(
            f"| {r['transport']} | {what[r['receiver']]} | **{r['median_mb_s']:.1f}** | "
            f"{', '.join(f'{x:.1f}' for x in r['repeat_mb_s'])} | {r['median_round_seconds']:.3f}s | "
            f"{r['median_mb_s'] / ref:.3f}× | {r['server_cpu_seconds'] / r['sampled_seconds']:.2f} cores | "
            f"{r['clients_cpu_seconds'] / r['measured_seconds']:.2f} cores | "
            f"{r['machine_cpu_seconds'] / r['sampled_seconds']:.2f} cores |"
        )
    return "\n".join(lines)


def shards_summary(b: dict) -> list[dict]:
    """For each gRPC setting (checkpointing, fragments in flight): plain TCP read-and-discard, 1 shard and
    the other shard counts, MB/s of E3M0 accepted (over all shards), and the ratios."""
    tcp = next((r for r in b["rows"] if r["transport"] == "plain TCP" and r["receiver"] == "discard"), None)
    grpc_rows = [r for r in b["rows"] if r["transport"] != "plain TCP"]
    out = []
    for pipe in sorted({g["pipeline"] for g in grpc_rows}):
        for ckpt in (True, False):
            by = {g["shards"]: g for g in grpc_rows if (g["checkpoint"], g["pipeline"]) == (ckpt, pipe)}
            if not by:
                continue
            one = by.get(1)
            row = {
                "checkpoint": ckpt,
                "pipeline": pipe,
                "tcp_discard_mb_s": tcp["median_mb_s"] if tcp else None,
                "mb_s": {n: g["median_mb_s"] for n, g in sorted(by.items())},
                "one_shard_over_tcp_discard": one["median_mb_s"] / tcp["median_mb_s"]
                if one and tcp
                else None,
                "over_one_shard": {
                    n: g["median_mb_s"] / one["median_mb_s"] for n, g in sorted(by.items()) if one and n > 1
                },
            }
            out.append(row)
    return out


def table_b_shards(summary: list[dict]) -> str:
    counts = sorted({n for r in summary for n in r["mb_s"]})
    more = [n for n in counts if n > 1]
    head = "| gRPC setting | plain TCP, discard (MB/s) | "
    head += " | ".join(f"gRPC, {n} shard{'s' if n > 1 else ''} (MB/s)" for n in counts)
    head += " | gRPC 1 shard / TCP discard | " + " | ".join(f"{n} shards / 1 shard" for n in more) + " |"
    lines = [head, "|" + "---|" * (3 + len(counts) + len(more))]

    def f(x, fmt):
        return "n/a" if x is None else format(x, fmt)

    for r in summary:
        what = ("checkpoint every round" if r["checkpoint"] else "--no-checkpoint") + (
            f", {r['pipeline']} fragments in flight" if r["pipeline"] > 1 else ""
        )
        cells = [what, f(r["tcp_discard_mb_s"], ".1f")]
        cells += [f"**{r['mb_s'][n]:.1f}**" if n in r["mb_s"] else "n/a" for n in counts]
        cells += [f(r["one_shard_over_tcp_discard"], ".3f") + "×"]
        cells += [f(r["over_one_shard"].get(n), ".2f") + "×" for n in more]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report_b(b: dict, shard_counts: list[int]) -> list[str]:
    """Say part (b)'s tables and ratios (added to `b`: "ratios", "shards_summary"); results.md's section."""
    lines = [table_b(b), "", *_ratio_lines(b)]
    b["shards_summary"] = shards_summary(b)
    if b["shards_summary"]:
        lines += [
            "",
            "1 shard against plain TCP reading and discarding the same bytes, and S shards "
            "(MB/s summed over the shards) against 1 shard:",
            "",
            table_b_shards(b["shards_summary"]),
        ]
    if b["profile"]:
        lines += _profile_lines(b["profile"])
    counts = " and ".join(str(n) for n in shard_counts)
    say(f"\n(b) Ingest: {counts} shard(s), {b['clients']} concurrent pushers of E3M0 payload\n")
    for ln in lines:
        say(ln)
    return ["## (b) Ingest rate", "", *lines, ""]


def _ratio_lines(b: dict) -> list[str]:
    """Each gRPC row against the TCP references, and S shards against 1 (into b["ratios"])."""
    tcp = {r["receiver"]: r for r in b["rows"] if r["transport"] == "plain TCP"}
    grpc_rows = [r for r in b["rows"] if r["transport"] != "plain TCP"]
    lines = []
    b["ratios"] = {}
    for g in grpc_rows:
        over = {m: g["median_mb_s"] / r["median_mb_s"] for m, r in tcp.items()}
        b["ratios"][g["transport"]] = {"over_tcp": over}
        lines.append(_grpc_line(g, over, b["clients"]))
    for ckpt, pipe in [(c, q) for q in (1, 2) for c in (True, False)]:
        by = {g["shards"]: g for g in grpc_rows if (g["checkpoint"], g["pipeline"]) == (ckpt, pipe)}
        if 1 in by and len(by) > 1:
            for n, g in sorted(by.items()):
                if n > 1:
                    x = g["median_mb_s"] / by[1]["median_mb_s"]
                    b["ratios"][g["transport"]]["over_one_shard"] = x
                    lines.append(f"- {g['transport']} ÷ 1 shard: {x:.2f}×")
    return lines


def _grpc_line(g: dict, over: dict[str, float], clients: int) -> str:
    return (
        f"- {g['transport']}: ÷ plain TCP by what its receiver does: "
        + ", ".join(f"{m} {v:.3f}×" for m, v in over.items())
        + f"; {g['refused']} pushes refused, {g['shard_pushes_accepted']} accepted; "
        "shard 0's time from a round's first whole push to its close (median) "
        f"{g['median_shard_first_push_to_close']:.3f}s "
        f"of a {g['median_round_seconds']:.3f}s round; CPU over the measured rounds "
        f"({g['sampled_seconds']:.2f}s): "
        + ("shard" if g["shards"] == 1 else "shards (p0 = shard 0, ...)")
        + f" by thread {g['server_cpu_by_thread']}, "
        f"the {clients} clients {g['clients_cpu_seconds']:.2f}, "
        f"the whole machine {g['machine_cpu_seconds']:.2f}; while it ran, shard 0 answered "
        + ", ".join(
            f"{path} in {h['median']:.1f} ms median, {h['p99']:.1f} p99, {h['max']:.1f} max ({h['n']} asked)"
            for path, h in g["http_ms"].items()
            if path != "errors" and h["n"]
        )
        + f" ({g['http_ms']['errors']} errors)"
    )


def _profile_lines(pr: dict) -> list[str]:
    lines = [
        "",
        "Where the shard's main thread (the event loop) spends its time: cProfile, a separate "
        f"pass of {pr['rounds']} rounds (profiling slows it), cumulative seconds per round:",
        "",
        "| function | what | calls | s per round |",
        "|---|---|---|---|",
    ]
    return lines + [
        f"| `{r['function']}` | {r['what'].strip()} | {r['calls']} | {r['per_round']:.3f} |"
        for r in pr["rows"]
    ]
