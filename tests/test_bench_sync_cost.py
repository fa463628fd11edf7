"""The sync-cost benchmark (benchmarks/sync_cost.py) runs end to end in its --quick form (real shard
processes, a worker process through connect()) and its tables and raw results add up."""

import importlib
import json
import re
import subprocess
import sys

import pytest

import benchmarks.sync_cost
from tests.support.procs import ROOT


def _module():
    return benchmarks.sync_cost


def _table(md: str, header: str) -> list[list[str]]:
    """The rows (cells) of the markdown table that starts with `header`; checks every row's width."""
    lines = md.splitlines()
    start = lines.index(header)
    width = header.count("|") - 1
    assert set(lines[start + 1].replace("|", "").replace("-", "").replace(":", "")) == set()
    assert lines[start + 1].count("|") - 1 == width
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == width, line
        rows.append(cells)
    return rows


def test_every_benchmark_is_a_module_of_the_package_benchmarks_and_none_edits_sys_path():
    """`python -m benchmarks.NAME` from the root: each (a module, or a package with a __main__) imports the
    shared harness (the package benchmarks/harness/) as a module, never another benchmark's file through
    sys.path; the installed package never imports them."""
    folder = ROOT / "benchmarks"
    files = sorted(p for p in folder.rglob("*.py") if "results" not in p.relative_to(folder).parts)
    top = {p.relative_to(folder).parts[0].removesuffix(".py") for p in files} - {"__init__"}
    assert {"harness", "wire", "wan", "sync_cost"} <= top
    for package in (folder / name for name in top if (folder / name).is_dir()):
        assert (package / "__init__.py").exists(), package
    for path in files:
        source = path.read_text()
        assert "sys.path" not in source, path
        assert not re.search(
            r"^\s*(from|import) (wire|wan|elastic|sync_cost|codecs|harness)\b", source, re.M
        ), path
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] != "__main__":  # `python -m benchmarks.wire`'s entry: running it would run the benchmark
            importlib.import_module(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    for package in ("cli", "common", "server", "worker", "sim", "protos"):
        for path in (ROOT / package).rglob("*.py"):
            assert not re.search(r"^\s*(from|import) benchmarks\b", path.read_text(), re.M), path


def test_the_synthetic_model_has_the_asked_size_and_a_block_list():
    mod = _module()
    for size in ("1M", "10M", "100M"):
        n = mod.parse_size(size)
        w = mod.width_for(n)
        count = mod.BLOCKS * (w * w + w) + 2 * mod.VOCAB * w + mod.VOCAB
        assert abs(count - n) / n < 0.03, (size, count)
        m = mod.SyntheticModel(w) if n <= 10**7 else None
        if m is not None:
            assert sum(p.numel() for p in m.parameters()) == count
            assert len(m.blocks) == mod.BLOCKS  # an nn.ModuleList: the fragments' blocks


@pytest.mark.slow  # a benchmark's whole quick grid: in `make test-slow`
def test_quick_run_end_to_end(tmp_path):
    mod = _module()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.sync_cost",
            "--quick",
            "--parts",
            "sync,codecs",  # the ingest part is wire.py's (tests/test_bench_wire.py)
            "--out",
            str(tmp_path),
            "--json",
            str(tmp_path / "raw.json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "EMULATED" in r.stdout and "utilization" in r.stdout  # progress while it runs
    results = json.loads((tmp_path / "raw.json").read_text())
    assert json.loads((tmp_path / "results.json").read_text())["cases"] == results["cases"]
    md = (tmp_path / "results.md").read_text()

    # the utilization table: one row per case, in order, with sane values
    cases = results["cases"]
    assert [(c["case"]["step_ms"], c["case"]["tau"], c["case"]["shards"]) for c in cases] == [
        (ms, tau, s) for _, ms, tau, s in mod.QUICK_CASES
    ]
    rows = _table(md, mod.UTIL_HEADER)
    assert len(rows) == len(cases)
    for row, c in zip(rows, cases, strict=True):
        assert c["status"] == "ok", c
        assert 0 < c["utilization"] <= 1
        assert 0 < c["cycle_min"] <= c["cycle_max"] <= 1
        assert float(row[4].strip("*").split()[0]) == round(c["utilization"], 3)
        assert row[1] == f"{c['case']['step_ms']} ms" and row[3] == str(c["case"]["shards"])
        assert c["measured_steps"] == 30  # 2 cycles of H=30, the first one warm-up
        # 5 fragments sent and merged per cycle; the training thread's time in them is measured
        run = next(x for x in results["runs"] if x["case"] == c["case"])
        assert run["in_step"]["send"]["n"] == 5 and run["in_step"]["merge"]["n"] == 5
        assert c["send_median_ms"] > 0 and c["merge_median_ms"] >= 0
        assert c["send_p90_ms"] >= c["send_median_ms"]
        assert 0 <= c["blocked_seconds"] < run["wall_seconds"]
        assert run["compute_seconds"] == 30 * c["case"]["step_ms"] / 1e3
        assert run["wall_seconds"] >= run["compute_seconds"]
        # RSS: above the parameters' bytes (Python and torch alone are hundreds of MB)
        assert c["worker_peak_rss"] > 4 * c["params"] and c["worker_rss_ratio"] > 1
        assert len(c["shard_peak_rss"]) == c["case"]["shards"]
        assert all(x > 4 * c["params"] for x in c["shard_peak_rss"])
        assert run["loadavg_before"] and run["others_cpu_cores"] >= 0
    rss = _table(md, mod.RSS_HEADER)
    assert len(rss) == len({(c["params"], c["case"]["shards"]) for c in cases})
    assert "Code under test" in md and results["machine"]["cpus"] >= 1
    # the codecs' table against a memcpy, measured in the same run
    assert results["codecs"]["status"] == "ok", results["codecs"]
    raw = results["codecs"]["raw"]
    assert raw["memcpy"] > 0 and [r["codec"] for r in raw["rows"]] == ["e3m0", "int8", "bf16", "fp32"]
    assert all(v > 0 for r in raw["rows"] for v in r["compiled"].values())
    assert "| e3m0 |" in md and "memcpy" in md
    assert "ingest" not in results
