"""The hot path before and after a change: the quick wire and sync-cost benchmarks at a base commit and at
the current working tree, in the same run, one after the other (base, current, for each benchmark), with
both tables printed and the timings side by side.

    python -m benchmarks.before_after                   # base 5dacd78 (before issue 36), ~20 min
    python -m benchmarks.before_after --base HEAD~3     # any commit
    python -m benchmarks.before_after --smoke           # a check that it works: one small point each, ~5 min

The commands it runs, in each tree (its root the working directory, OUT/base or OUT/current as OUT):

    python -m benchmarks.wire --quick --max-wait 30 --out OUT/wire
    python -m benchmarks.sync_cost --quick --max-wait 30 --out OUT/sync_cost

and with --smoke:

    python -m benchmarks.wire --quick --parts b --b-shards 1 --no-pipeline --b-rounds 1 --b-repeats 1 \\
        --max-wait 0 --out OUT/wire
    python -m benchmarks.sync_cost --quick --parts sync --max-wait 0 --out OUT/sync_cost

The base is a `git worktree` (detached) under /tmp, removed at the end unless --keep. Each tree runs its own
code, benchmarks and package alike: the package is imported from a tree of symlinks to that tree's folders
(build/typecheck's layout, pyproject's package-dir) put first on PYTHONPATH, ahead of the editable install;
the benchmark says which code it ran ("code" in its results.json). Both use this interpreter and its
packages. The machine must be the same and as quiet as it can be: the figures are timings.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the [tomli] dependency
    import tomli as tomllib

from benchmarks.harness import ROOT

BASE = "5dacd78"  # the commit before issue 36 (the restructuring)
QUICK = {
    "wire": ["--quick", "--max-wait", "30"],
    "sync_cost": ["--quick", "--max-wait", "30"],
}
SMOKE = {
    "wire": ["--quick", "--parts", "b", "--b-shards", "1", "--no-pipeline", "--b-rounds", "1"]
    + ["--b-repeats", "1", "--max-wait", "0"],
    "sync_cost": ["--quick", "--parts", "sync", "--max-wait", "0"],
}


def package_tree(root: Path, dest: Path) -> Path:
    """dest/streamdiloco/: symlinks to `root`'s files of the package, by its pyproject's package-dir (the
    root package's files one by one, each sub-package's folder whole). Returns dest, for PYTHONPATH."""
    with open(root / "pyproject.toml", "rb") as f:
        mapping = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    shutil.rmtree(dest, ignore_errors=True)
    pkg = dest / "streamdiloco"
    pkg.mkdir(parents=True)
    for entry in sorted((root / mapping["streamdiloco"]).iterdir()):
        if entry.is_file() and entry.suffix in (".py", ".pyi"):
            (pkg / entry.name).symlink_to(entry)
    for name, folder in mapping.items():
        if name != "streamdiloco":
            (pkg / name.split(".", 1)[1]).symlink_to(root / folder, target_is_directory=True)
    return dest


def run(tree: Path, pkg: Path, module: str, flags: list[str], out: Path, log: Path) -> int:
    """`python -m benchmarks.MODULE FLAGS --out OUT` in `tree` with its package; its output to `log` and,
    line by line, here."""
    argv = [sys.executable, "-m", f"benchmarks.{module}", *flags, "--out", str(out)]
    print(f"\n$ (cd {tree} && PYTHONPATH={pkg} python {' '.join(argv[1:])})", flush=True)
    env = {**os.environ, "PYTHONPATH": str(pkg), "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as f:
        p = subprocess.Popen(
            argv, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert p.stdout is not None
        for line in p.stdout:
            f.write(line)
            print(f"  {line}", end="", flush=True)
        return p.wait()


def figures(module: str, out: Path) -> dict[str, float]:
    """The timings to compare, by name, from a run's results.json (none if it wrote none)."""
    path = out / "results.json"
    if not path.exists():
        return {}
    res = json.loads(path.read_text())
    got: dict[str, float] = {}
    if module == "wire":
        for r in (res.get("b") or {}).get("rows", []):
            got[f"(b) {r['transport']} / {r['receiver']}: MB/s"] = r["median_mb_s"]
        for key, run_ in (res.get("c") or {}).items():
            if isinstance(run_, dict) and "workers" in run_:
                for w in run_["workers"]:
                    got[f"(c) {key} {w['worker']}: compute utilization"] = w["compute_utilization"]
    else:
        for c in res.get("cases", []):
            case = c["case"]
            label = f"{case['size']} {case['step_ms']} ms tau={case['tau']} S={case['shards']}"
            if c.get("status") == "ok":
                got[f"{label}: utilization"] = c["utilization"]
                got[f"{label}: send step ms (median)"] = c["send_median_ms"]
                got[f"{label}: merge step ms (median)"] = c["merge_median_ms"]
    return got


def compare(module: str, base: Path, current: Path) -> list[str]:
    """The two runs' timings side by side (current ÷ base)."""
    b, c = figures(module, base), figures(module, current)
    lines = [f"| {module} | base | current | current ÷ base |", "|---|---:|---:|---:|"]
    for key in [*b, *(k for k in c if k not in b)]:
        x, y = b.get(key), c.get(key)
        ratio = f"{y / x:.3f}" if x and y is not None else "-"
        cells = ["-" if v is None else f"{v:.3f}" for v in (x, y)]
        lines.append(f"| {key} | {cells[0]} | {cells[1]} | {ratio} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default=BASE, help="the commit to compare with (default %(default)s)")
    p.add_argument("--out", default=None, help="where both runs write (default: a new folder under /tmp)")
    p.add_argument("--smoke", action="store_true", help="one small point of each: that it works, not figures")
    p.add_argument("--keep", action="store_true", help="keep the base's worktree and the package trees")
    a = p.parse_args(argv)
    sha = subprocess.run(
        ["git", "rev-parse", "--short", a.base], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    scratch = Path(tempfile.mkdtemp(prefix=f"before-after-{sha}-"))
    out = Path(a.out) if a.out else scratch / "out"
    worktree = scratch / "base"
    subprocess.run(["git", "worktree", "add", "--detach", str(worktree), sha], cwd=ROOT, check=True)
    trees = {"base": (worktree, package_tree(worktree, scratch / "pkg-base"))}
    trees["current"] = (ROOT, package_tree(ROOT, scratch / "pkg-current"))
    flags = SMOKE if a.smoke else QUICK
    status = 0
    try:
        for module in ("wire", "sync_cost"):
            for which, (tree, pkg) in trees.items():
                (out / which).mkdir(parents=True, exist_ok=True)
                log = out / which / f"{module}.log"
                status = run(tree, pkg, module, flags[module], out / which / module, log) or status
        for module in ("wire", "sync_cost"):
            for which in trees:
                md = out / which / module / "results.md"
                print(f"\n===== {module}, {which} ({sha if which == 'base' else 'working tree'}) =====\n")
                print(md.read_text() if md.exists() else f"(no results: see {out / which / f'{module}.log'})")
            print("\n".join(["", *compare(module, out / "base" / module, out / "current" / module)]))
    finally:
        if not a.keep:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=ROOT, check=False)
            shutil.rmtree(scratch / "pkg-base", ignore_errors=True)
            shutil.rmtree(scratch / "pkg-current", ignore_errors=True)
    print(f"\nresults under {out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
