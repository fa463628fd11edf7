"""Tables and plots of simulator results: used by `streamdiloco compare`, the demo and the benchmarks."""

from __future__ import annotations

from pathlib import Path


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def comparison_rows(results: list[tuple[str, dict]]) -> list[dict]:
    """One row per run, with loss and traffic relative to the data-parallel run of the same M."""
    dp = {r["workers"]: r for _, r in results if r["method"] == "dp"}
    rows = []
    for label, r in results:
        ref = dp.get(r["workers"])
        moved = r["bytes_sent_per_worker"] + r["bytes_received_per_worker"]
        ref_moved = ref["bytes_sent_per_worker"] + ref["bytes_received_per_worker"] if ref else None
        rows.append(
            {
                "label": label,
                "M": r["workers"],
                "eval_loss": r["eval_loss"],
                "vs_dp_pct": 100 * (r["eval_loss"] / ref["eval_loss"] - 1) if ref else None,
                "sent": r["bytes_sent_per_worker"],
                "received": r["bytes_received_per_worker"],
                "fewer_bytes_x": ref_moved / moved if ref_moved and moved else None,
                "peak_sync": r["peak_sync_bytes"],
                "peak_vs_dp_x": ref["peak_sync_bytes"] / r["peak_sync_bytes"] if ref else None,
                "tokens": r["tokens"],
                "wall_s": r["wall_seconds"],
            }
        )
    return rows


def format_table(rows: list[dict], markdown: bool = False) -> str:
    head = [
        "method",
        "M",
        "eval loss",
        "vs DP",
        "sent/worker",
        "recv/worker",
        "DP bytes ÷ this",
        "peak sync",
        "DP peak ÷ this",
        "tokens",
        "wall",
    ]
    body = []
    for r in rows:
        body.append(
            [
                r["label"],
                str(r["M"]),
                f"{r['eval_loss']:.4f}",
                "—" if r["vs_dp_pct"] is None else f"{r['vs_dp_pct']:+.2f}%",
                fmt_bytes(r["sent"]),
                fmt_bytes(r["received"]),
                "—" if r["fewer_bytes_x"] is None else f"{r['fewer_bytes_x']:.0f}×",
                fmt_bytes(r["peak_sync"]),
                "—" if r["peak_vs_dp_x"] is None else f"{r['peak_vs_dp_x']:.1f}×",
                f"{r['tokens']:,}",
                f"{r['wall_s']:.0f}s",
            ]
        )
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(b) + " |" for b in body]
        return "\n".join(lines)
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join(
        [fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*b) for b in body]
    )


def plot_curves(results: list[tuple[str, dict]], path: str | Path, title: str = "") -> Path:
    """Eval loss of the global parameters against tokens, one line per run (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    for label, r in results:
        pts = [(c["tokens"], c["eval_loss"]) for c in r["curve"] if c["step"] > 0]
        style = "--" if r["method"] == "dp" else "-"
        ax.plot(
            [p[0] for p in pts], [p[1] for p in pts], style, marker=".", label=f"{label} (M={r['workers']})"
        )
    ax.set_xlabel("tokens (all workers)")
    ax.set_ylabel("eval loss of the global parameters (nats/byte)")
    ax.set_title(title or "Streaming DiLoCo vs data-parallel")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
