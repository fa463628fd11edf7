"""Markdown tables of log.tsv (written by sweep.sh): eval loss and the gap to data-parallel at the same M,
tokens per parameter and seed (default inner lr), and to the best data-parallel lr of experiment e1."""

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


def seed(flags: str) -> str:
    return flags.split("--seed ")[1].split()[0] if "--seed" in flags else "0"


def lr(flags: str) -> str:
    return flags.split("--lr ")[1].split()[0] if "--lr" in flags else "1.5e-3"


dp = {(r[2], r[3], seed(r[5])): float(r[6]) for r in uniq if r[4] == "dp" and "--lr" not in r[5]}
dp_lr = {(r[2], r[3], seed(r[5]), lr(r[5])): float(r[6]) for r in uniq if r[4] == "dp"}
best_dp: dict[str, float] = defaultdict(lambda: 9e9)
for r in uniq:
    if r[4] == "dp" and r[3] == "20" and seed(r[5]) == "0":
        best_dp[r[2]] = min(best_dp[r[2]], float(r[6]))
for exp in sys.argv[1:] or sorted({r[0] for r in uniq}):
    print(f"\n### {exp}\n\n| run | M | tok/param | flags | eval loss | vs DP (lr 1.5e-3) ", end="")
    print("| vs DP at the same lr | vs best-lr DP |")
    print("|---|---|---|---|---|---|---|---|")
    for r in uniq:
        if r[0] != exp:
            continue
        loss, ref = float(r[6]), dp.get((r[2], r[3], seed(r[5])))
        gap = f"{100 * (loss / ref - 1):+.2f}%" if ref else ""
        ref2 = dp_lr.get((r[2], r[3], seed(r[5]), lr(r[5])))
        sgap = f"{100 * (loss / ref2 - 1):+.2f}%" if ref2 else ""
        bgap = f"{100 * (loss / best_dp[r[2]] - 1):+.2f}%" if r[3] == "20" and seed(r[5]) == "0" else ""
        flags = (
            r[5]
            .replace(
                "--fragment-sync-delay 1 --fragment-update-alpha 0.5 --uplink-codec e3m0 "
                "--downlink-codec e3m0",
                "full",
            )
            .strip()
        )
        print(f"| {r[1]} | {r[2]} | {r[3]} | `{flags or 'dp'}` | {loss:.4f} | {gap} | {sgap} | {bgap} |")
