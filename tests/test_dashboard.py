"""The run's dashboard page in a real browser: Debian's chromium, driven by Playwright, watches a run of
2 shard and 2 worker processes on loopback from shard 0's address. Every panel fills with live data, from
this machine alone: both shards (shard 0 fetches shard 1's status: --peers), each worker's step of total,
ETA and eval-loss curve, and the workers' charts over steps and tokens as well as time."""

from __future__ import annotations

from urllib.parse import urlsplit

from streamdiloco.common.ports import free_ports
from tests.support.browser import CHROMIUM, CHROMIUM_ARGS, playwright
from tests.support.procs import Cluster, http_json, wait_until

NANO = ["--model", "nano", "--sync-every", "6", "--num-fragments", "3"]
CHARTS = ("rounds", "loss", "eval", "bytes", "durations", "blocked", "members")

# What the page shows, read in the page: its test hook (window.sdDashboard) and its canvases.
READ_PAGE = """() => {
  const d = window.sdDashboard;
  const charts = {};
  for (const [name, u] of Object.entries(d.charts)) {
    const values = u.data.slice(1).map((ys) => ys.filter((v) => v != null));
    charts[name] = {
      labels: u.series.slice(1).map((s) => s.label),
      x: u.series[0].label,
      xmax: Math.max(...u.data[0]),
      points: u.data[0].length,
      values: values.map((vs) => vs.length),
      finite: values.every((vs) => vs.every(Number.isFinite)),
      max: Math.max(...values.flat()),
    };
  }
  const rows = [...document.querySelectorAll("#members tbody tr[data-worker]")].map(
    (tr) => [...tr.cells].slice(0, 2).map((td) => td.textContent));
  const cells = (selector) => [...document.querySelectorAll(selector)].map((td) => td.textContent);
  const shards = [...document.querySelectorAll("#shards tbody tr")].map(
    (tr) => [tr.dataset.shard, tr.className, tr.cells[1].textContent]);
  return {charts, rows, shards, polls: d.polls, connected: d.connected, sizes: d.sizes,
          steps: cells("#members tbody tr[data-worker] td:nth-child(3)"),
          eta: cells("#members td.eta"), evals: cells("#members td.eval"),
          run: cells("#run-stats b"),
          credits: [...document.querySelectorAll("#credits tbody tr[data-worker]")].map(
            (tr) => [tr.dataset.worker, tr.cells[2].textContent, tr.cells[3].textContent]),
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


def _wait(c: Cluster, page, what: str, pred, timeout: float):
    """wait_until, and on a timeout what the page showed and what the processes said."""
    try:
        return wait_until(what, pred, timeout=timeout, every=0.5)
    except AssertionError as e:
        logs = "\n".join(f"--- {name}:\n{c.log(name)[-1500:]}" for name in c.procs)
        raise AssertionError(f"{e}\nthe page shows: {page.evaluate(READ_PAGE)}\n{logs}") from None


def test_the_dashboard_shows_the_run_its_workers_and_live_charts_from_one_shard(tmp_path):
    sync_api = playwright()
    ports = free_ports(2)  # each shard's HTTP port, known before they start: both are each one's --peers
    peers = ",".join(f"http://127.0.0.1:{p}" for p in ports)
    shard_flags = [*NANO, "--num-shards", "2", "--min-workers", "2", "--peers", peers]
    # paced (0.1 s a step): rounds close every ~0.2 s while the browser watches, for about a minute; an
    # evaluation of the global parameters every 20 steps
    work = [*NANO, "--steps", "600", "--step-delay", "0.1", "--checkpoint-every", "0", "--log-every", "100"]
    work += ["--eval-every", "20"]
    with Cluster(tmp_path) as c, sync_api.sync_playwright() as pw:
        t0, h0 = c.shard("shard0", "--shard", "0", "--http-port", str(ports[0]), *shard_flags)
        t1, h1 = c.shard("shard1", "--shard", "1", "--http-port", str(ports[1]), *shard_flags)
        assert (h0, h1) == tuple(ports)
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
        assert page.locator("#credits td.empty").text_content() == "no contributions yet"
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
        assert first["shard"] == "run, from shard 0 of 2"
        # the run: both shards, up (shard 1's status fetched by shard 0), and the totals
        assert first["shards"] == [["0", "", "ready"], ["1", "", "ready"]]
        assert first["run"][0] == "2 / 2"
        assert first["config"].startswith("H=6 · 3 fragments (strided) · τ=1")
        status = http_json(h0)
        assert {m["name"] for m in status["members"]} == {"worker-a", "worker-b"}

        def grown():  # later polls, without reloading: more rounds, more points on every chart
            got = page.evaluate(READ_PAGE)
            charts, before = got["charts"], first["charts"]
            more = all(charts[n]["points"] > before[n]["points"] for n in CHARTS)
            return got if more and charts["rounds"]["max"] > before["rounds"]["max"] else None

        later = _wait(c, page, "the charts to grow", grown, timeout=60)

        def evaluated():  # each worker's ETA, and an eval curve of a few points (every 20 steps)
            got = page.evaluate(READ_PAGE)
            evals = got["sizes"]["evals"]
            enough = sorted(evals) == ["worker-a", "worker-b"] and all(n >= 3 for n in evals.values())
            return got if enough and all(e != "–" for e in got["eta"]) and got["eta"] else None

        later = _wait(c, page, "an ETA and eval points for both workers", evaluated, timeout=120)
        assert later["marker"] == 1 and later["polls"] > first["polls"] and later["connected"]
        # the contributors: both workers, with the tokens and rounds the shard credited them
        credits = later["credits"]
        assert sorted(w for w, _, _ in credits) == ["worker-a", "worker-b"], credits
        assert all(int(t.replace(",", "")) > 0 and int(r) > 0 for _, t, r in credits), credits
        charts = later["charts"]
        assert set(charts) == set(CHARTS)
        for name, chart in charts.items():
            assert chart["points"] > 0 and chart["finite"], (name, chart)
        assert charts["rounds"]["labels"] == ["fragment 0", "fragment 1", "fragment 2"]
        # per worker: step of the 600, an ETA (min or s), a last eval loss; and the eval curve
        assert all(s.endswith(" / 600") for s in later["steps"]), later["steps"]
        assert all(e.endswith(" s") for e in later["eta"]), later["eta"]
        assert all(0 < float(e) < 10 for e in later["evals"]), later["evals"]
        assert charts["eval"]["labels"] == ["worker-a", "worker-b"] and charts["eval"]["x"] == "time"
        assert all(n >= 3 for n in charts["eval"]["values"]) and 0 < charts["eval"]["max"] < 10
        assert charts["rounds"]["max"] >= 2
        # one loss line per worker, every point a finite loss near the start of training
        assert charts["loss"]["labels"] == ["worker-a", "worker-b"]
        assert all(n > 0 for n in charts["loss"]["values"]) and 0 < charts["loss"]["max"] < 10
        assert charts["bytes"]["max"] > 0 and charts["members"]["max"] == 2
        assert all(n > 0 for n in charts["durations"]["values"])  # every fragment closed rounds
        # and the canvases are drawn: each has lines or points in colour, beyond the grey grid and axes
        coloured = page.evaluate(COLOURED_PIXELS)
        assert all(n > 100 for n in coloured.values()), coloured

        # the workers' charts over steps, then tokens: the same points, another x-axis
        for axis, most in (("step", 600), ("tokens", 600 * 16 * 32)):
            page.check(f'input[name="xaxis"][value="{axis}"]')
            over = page.evaluate(READ_PAGE)["charts"]
            for name in ("loss", "eval", "blocked"):
                assert over[name]["x"] == axis and 0 < over[name]["xmax"] <= most, (axis, name, over[name])
            assert all(n >= 3 for n in over["eval"]["values"]), over["eval"]
            assert over["rounds"]["x"] == "time"  # the shard's own charts stay over time
        page.check('input[name="xaxis"][value="time"]')
        assert page.evaluate(READ_PAGE)["charts"]["loss"]["x"] == "time"

        assert errors == [], errors
        assert elsewhere == [], f"the page asked other hosts: {elsewhere}"

        # shard 1 goes away: the page, from shard 0, shows it down and goes on
        c.procs["shard1"].kill()
        polls = page.evaluate(READ_PAGE)["polls"]

        def shard1_down():
            got = page.evaluate(READ_PAGE)
            return got if got["shards"][1][1] == "down" and got["polls"] > polls + 1 else None

        down = _wait(c, page, "the run view to show shard 1 down", shard1_down, timeout=30)
        assert down["shards"][0] == ["0", "", "ready"] and down["run"][0] == "1 / 2" and down["connected"]

        # the shard goes away: the page says so and keeps trying
        c.procs["shard0"].kill()
        page.wait_for_function(
            "document.getElementById('conn').textContent.startsWith('disconnected')", timeout=15_000
        )
        assert page.evaluate("window.testMarker") == 1
        browser.close()
