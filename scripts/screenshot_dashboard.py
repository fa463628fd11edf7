"""Make docs/dashboard.png: start `streamdiloco launch` (2 shards, 2 workers, the tiny GPT), let it train,
and photograph the run's dashboard from shard 0 (both shards, each worker's ETA and eval-loss curve) in
Debian's chromium, driven by Playwright (no browser download).

    .venv/bin/python scripts/screenshot_dashboard.py [--seconds 60] [--eval-every 50] [--out PATH.png]
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60, help="training to watch, at least")
    ap.add_argument("--eval-every", type=int, default=50, help="the workers' steps between evaluations")
    ap.add_argument("--evals", type=int, default=4, help="eval points per worker to show")
    ap.add_argument("--out", default=str(ROOT / "docs" / "dashboard.png"))
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "launch.log"
        with open(log_path, "w") as log:
            run = ["launch", "--shards", "2", "--workers", "2", "--steps", "5000", "--log-every", "500"]
            run += ["--eval-every", str(args.eval_every)]
            launch = subprocess.Popen(
                [sys.executable, "-m", "streamdiloco", *run, "--out", str(Path(tmp) / "run")],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
        try:
            url = wait_for_dashboard(log_path, launch)
            print(f"watching {url} for {args.seconds:g} s")
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS)
                page = browser.new_page(viewport={"width": 1280, "height": 1400})
                page.goto(url)
                time.sleep(args.seconds)
                # both shards in the run view, and an eval curve of a few points for each worker
                page.wait_for_function(
                    f"""() => {{
                      const d = window.sdDashboard;
                      const evals = d && Object.values(d.sizes.evals);
                      return d.lastRun && d.lastRun.totals.shards_up === 2 && evals.length === 2 &&
                        evals.every((n) => n >= {args.evals}) &&
                        [...document.querySelectorAll("#members td.eta")].filter(
                          (td) => td.textContent !== "–").length === 2;
                    }}""",
                    timeout=300_000,
                    polling=1000,
                )
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=args.out, full_page=True)
                browser.close()
            print(f"wrote {args.out}")
        finally:
            launch.send_signal(signal.SIGTERM)  # stops workers, then shards
            launch.wait(60)


def wait_for_dashboard(log_path: Path, launch: subprocess.Popen, timeout: float = 120) -> str:
    """Shard 0's dashboard URL, from launch's line `dashboards: http://...`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(r"dashboards: (http://[^,;\s]+)", log_path.read_text())
        if found:
            return found.group(1)
        if launch.poll() is not None:
            sys.exit(f"launch exited with {launch.returncode}:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.2)
    sys.exit(f"no dashboard after {timeout:g} s:\n{log_path.read_text()[-3000:]}")


if __name__ == "__main__":
    main()
