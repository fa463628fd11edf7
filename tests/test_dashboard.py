"""The shard's dashboard page in a real browser: Debian's chromium, driven by Playwright, watches a run of
2 shard and 2 worker processes on loopback. Every panel fills with live data, from this machine alone."""

from __future__ import annotations

import shutil
from urllib.parse import urlsplit

import pytest
from procs import Cluster, http_json, wait_until

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
NANO = ["--model", "nano", "--sync-every", "6", "--num-fragments", "3"]
CHARTS = ("rounds", "loss", "bytes", "durations", "blocked", "members")

# What the page shows, read in the page: its test hook (window.sdDashboard) and its canvases.
READ_PAGE = """() => {
  const d = window.sdDashboard;
  const charts = {};
  for (const [name, u] of Object.entries(d.charts)) {
    const values = u.data.slice(1).map((ys) => ys.filter((v) => v != null));
    charts[name] = {
      labels: u.series.slice(1).map((s) => s.label),
      points: u.data[0].length,
      values: values.map((vs) => vs.length),
      finite: values.every((vs) => vs.every(Number.isFinite)),
      max: Math.max(...values.flat()),
    };
  }
  const rows = [...document.querySelectorAll("#members tbody tr[data-worker]")].map(
    (tr) => [...tr.cells].slice(0, 2).map((td) => td.textContent));
  return {charts, rows, polls: d.polls, connected: d.connected, sizes: d.sizes,
          shard: document.getElementById("shard").textContent,
          config: document.getElementById("config").textContent,
          marker: window.testMarker ?? null};
}"""

# Pixels in a colour (not white, grey or black: the background, grid and axes) on each chart's canvas.
COLOURED_PIXELS = """() => Object.fromEntries(Object.entries(window.sdDashboard.charts).map(([name, u]) => {
  const c = u.ctx.canvas;
  const px = u.ctx.getImageData(0, 0, c.width, c.height).data;
  let n = 0;
  for (let i = 0; i < px.length; i += 4) {
    const [r, g, b, a] = px.slice(i, i + 4);
    if (a > 0 && Math.max(r, g, b) - Math.min(r, g, b) > 60) n++;
  }
  return [name, n];
}))"""


def _playwright():
    if not shutil.which(CHROMIUM):
        pytest.skip(f"no chromium at {CHROMIUM} (Debian: apt-get install chromium)")
    return pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (pip install -e .[dev])"
    )


def _wait(c: Cluster, page, what: str, pred, timeout: float):
    """wait_until, and on a timeout what the page showed and what the processes said."""
    try:
        return wait_until(what, pred, timeout=timeout, every=0.5)
    except AssertionError as e:
        logs = "\n".join(f"--- {name}:\n{c.log(name)[-1500:]}" for name in c.procs)
        raise AssertionError(f"{e}\nthe page shows: {page.evaluate(READ_PAGE)}\n{logs}") from None


def test_the_dashboard_shows_the_workers_and_live_charts_from_the_shard_alone(tmp_path):
    sync_api = _playwright()
    shard_flags = [*NANO, "--num-shards", "2", "--min-workers", "2"]
    # paced (0.1 s a step): rounds close every ~0.2 s while the browser watches, for about a minute
    work = [*NANO, "--steps", "600", "--step-delay", "0.1", "--checkpoint-every", "0", "--log-every", "100"]
    with Cluster(tmp_path) as c, sync_api.sync_playwright() as pw:
        t0, h0 = c.shard("shard0", "--shard", "0", *shard_flags)
        t1, _ = c.shard("shard1", "--shard", "1", *shard_flags)
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1280, "height": 1400})
        errors: list[str] = []
        elsewhere: list[str] = []  # requests to anything but this machine: the page must work offline

        def request(r) -> None:
            if urlsplit(r.url).hostname != "127.0.0.1" and not r.url.startswith("data:"):
                elsewhere.append(r.url)

        page.on("request", request)
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        url = f"http://127.0.0.1:{h0}/"
        page.goto(url, timeout=30_000)
        # the page is up before any worker: no rounds yet, and it says so
        page.wait_for_function("window.sdDashboard && window.sdDashboard.polls > 0", timeout=30_000)
        page.evaluate("window.testMarker = 1")  # gone if the page reloads
        assert page.locator("#members td.empty").text_content() == "no workers connected"
        assert page.locator("#chart-loss .nodata").is_visible()
        assert page.evaluate(COLOURED_PIXELS)["loss"] == 0  # an empty chart: grid and axes, grey

        for m, name in enumerate(("worker-a", "worker-b")):
            c.worker(name, [t0, t1], *work, "--rank", str(m))

        def shown():  # both workers in the table as members, and a round of every fragment closed
            got = page.evaluate(READ_PAGE)
            rows = sorted(got["rows"])
            rounds = got["charts"].get("rounds")
            done = rows == [["worker-a", "member"], ["worker-b", "member"]] and rounds and rounds["max"] >= 1
            return (
                got if done and sorted(got["charts"]["loss"]["labels"]) == ["worker-a", "worker-b"] else None
            )

        first = _wait(c, page, "the page to show both workers and closed rounds", shown, timeout=90)
        assert first["shard"] == "shard 0 of 2"
        assert first["config"].startswith("H=6 · 3 fragments (strided) · τ=1")
        status = http_json(h0)
        assert {m["name"] for m in status["members"]} == {"worker-a", "worker-b"}

        def grown():  # later polls, without reloading: more rounds, more points on every chart
            got = page.evaluate(READ_PAGE)
            charts, before = got["charts"], first["charts"]
            more = all(charts[n]["points"] > before[n]["points"] for n in CHARTS)
            return got if more and charts["rounds"]["max"] > before["rounds"]["max"] else None

        later = _wait(c, page, "the charts to grow", grown, timeout=60)
        assert later["marker"] == 1 and later["polls"] > first["polls"] and later["connected"]
        charts = later["charts"]
        assert set(charts) == set(CHARTS)
        for name, chart in charts.items():
            assert chart["points"] > 0 and chart["finite"], (name, chart)
        assert charts["rounds"]["labels"] == ["fragment 0", "fragment 1", "fragment 2"]
        assert charts["rounds"]["max"] >= 2
        # one loss line per worker, every point a finite loss near the start of training
        assert charts["loss"]["labels"] == ["worker-a", "worker-b"]
        assert all(n > 0 for n in charts["loss"]["values"]) and 0 < charts["loss"]["max"] < 10
        assert charts["bytes"]["max"] > 0 and charts["members"]["max"] == 2
        assert all(n > 0 for n in charts["durations"]["values"])  # every fragment closed rounds
        # and the canvases are drawn: each has lines or points in colour, beyond the grey grid and axes
        coloured = page.evaluate(COLOURED_PIXELS)
        assert all(n > 100 for n in coloured.values()), coloured

        assert errors == [], errors
        assert elsewhere == [], f"the page asked other hosts: {elsewhere}"

        # the shard goes away: the page says so and keeps trying
        c.procs["shard0"].kill()
        page.wait_for_function(
            "document.getElementById('conn').textContent.startsWith('disconnected')", timeout=15_000
        )
        assert page.evaluate("window.testMarker") == 1
        browser.close()
