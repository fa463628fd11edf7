"""Markdown tables of log.tsv (written by sweep.sh): each run's eval loss and its gap to data-parallel in the
same setting (M, tokens per parameter, seed, text, batch): DP at the default inner lr, DP at the run's lr,
and the best DP of every lr the log has for that setting."""

import csv
import sys
from collections import defaultdict
from pathlib import Path

rows = list(csv.reader(open(Path(__file__).with_name("log.tsv")), delimiter="\t"))
seen, uniq = set(), []
for r in rows:
    if (r[0], r[1]) not in seen:
        seen.add((r[0], r[1]))
        uniq.append(r)


def flag(flags: str, name: str, default: str) -> str:
    return flags.split(f"--{name} ")[1].split()[0] if f"--{name} " in flags else default


def setting(r: list[str]) -> tuple:
    """What a DP reference must share with a run: M, tokens/param, seed, text, batch."""
    text = "fortunes" if "--data" in r[5] else "plays"
    return r[2], r[3], flag(r[5], "seed", "0"), text, "4" if "-b4" in r[1] else "16"


dp_at: dict[tuple, float] = {}
best_dp: dict[tuple, float] = defaultdict(lambda: 9e9)
for r in uniq:
    if r[4] == "dp":
        dp_at[(*setting(r), flag(r[5], "lr", "1.5e-3"))] = float(r[6])
        best_dp[setting(r)] = min(best_dp[setting(r)], float(r[6]))


def gap(loss: float, ref: float | None) -> str:
    return f"{100 * (loss / ref - 1):+.2f}%" if ref else ""


FULL = "--fragment-sync-delay 1 --fragment-update-alpha 0.5 --uplink-codec e3m0 --downlink-codec e3m0"
for exp in sys.argv[1:] or sorted({r[0] for r in uniq}, key=lambda e: int(e[1:])):
    print(f"\n### {exp}\n\n| run | M | tok/param | flags | eval loss | vs DP (lr 1.5e-3) ", end="")
    print("| vs DP at the same lr | vs best-lr DP |")
    print("|---|---|---|---|---|---|---|---|")
    for r in uniq:
        if r[0] != exp:
            continue
        loss, s = float(r[6]), setting(r)
        same = gap(loss, dp_at.get((*s, flag(r[5], "lr", "1.5e-3"))))
        best = gap(loss, best_dp.get(s))
        flags = r[5].replace(FULL, "full").replace("--data benchmarks/results/quality-long/runs/", "--data ")
        print(
            f"| {r[1]} | {r[2]} | {r[3]} | `{flags.strip() or 'dp'}` | {loss:.4f} "
            f"| {gap(loss, dp_at.get((*s, '1.5e-3')))} | {same} | {best} |"
        )
