/* The run's live dashboard. Polls api/run (every shard of the run: this shard fetches its peers), api/status
   and api/series on this origin (series: only the points after the previous answer's `now`), keeps bounded
   arrays of what came, and draws them with uPlot (vendored next to this file). The workers' charts plot
   over wall time, steps or tokens (a toggle). Everything the shards send is shown with textContent, never
   as HTML: worker names come from the workers. Read-only hook for tests and the console:
   window.sdDashboard. */
(() => {
  "use strict";

  const POLL_MS = 1500; // the next poll starts this long after the previous answer
  const RETRY_MS = 2000; // while the shard does not answer
  const CREDIT_ROWS = 25; // contributors listed, the most tokens first (the rest: one "others" line)
  const FETCH_TIMEOUT_MS = 5000;
  const WINDOW_S = 900; // points older than this are dropped: the shard keeps 15 minutes of samples too
  const MAX_SAMPLES = 1800; // the shard samples once a second, and each poll adds the moment's values
  const MAX_ROUNDS = 5000;
  const MAX_WORKER_POINTS = 600; // per worker, as many as the shard keeps
  const MAX_EVAL_POINTS = 200; // per worker, as many as the shard keeps
  const MAX_WORKERS = 64; // workers charted (the shard keeps as many); the table shows every member
  const MAX_GAP_S = 5; // no byte rate across a gap in the samples (the shard was down or restarted)
  const CHART_HEIGHT = 210;
  // the shard's read token, when it has one: the page was opened as /?token=..., and the API takes it as
  // a header only (a token in a URL ends up in logs)
  const READ_TOKEN = new URLSearchParams(location.search).get("token");
  if (READ_TOKEN !== null) {
    // ... and out of the address bar and the history as soon as it is read (what is copied or shared of
    // the address, or seen over a shoulder, no longer carries it)
    const clean = new URL(location.href);
    clean.searchParams.delete("token");
    history.replaceState(history.state, "", clean.pathname + clean.search + clean.hash);
  }
  const HEADERS = READ_TOKEN ? { Authorization: `Bearer ${READ_TOKEN}` } : {};
  const PALETTE = [
    "#0969da", "#cf222e", "#1a7f37", "#8250df", "#bc4c00",
    "#0a7f8c", "#bf3989", "#57606a", "#9a6700", "#4d2d00",
  ];

  const store = {
    since: 0, // the shard's `now` in its last answer: the next poll asks for what is newer
    now: null,
    samples: [], // {t, bytes_in, bytes_out, members, passive}, cumulative counters
    rounds: [], // closed rounds {closed_at, fragment, round, seconds, mean_loss, why, contributors}
    workers: new Map(), // name -> [{t, step, loss, blocked_seconds, tokens, utilization}]
    evals: new Map(), // name -> [{t, step, tokens, eval_loss}]: the global parameters' eval loss
  };
  const X_AXES = { time: "t", step: "step", tokens: "tokens" }; // the workers' charts' x: a point's key
  let xAxis = "time";
  const charts = {}; // name -> uPlot
  const signatures = {}; // name -> the series set a chart was built for
  const colors = new Map(); // worker name -> colour, the same in the table and every chart
  const conn = { up: false, phase: "connecting", error: null, lastAnswer: null, polls: 0 };
  let lastStatus = null;
  let lastRun = null;

  window.sdDashboard = Object.freeze({
    charts,
    get lastStatus() { return lastStatus; },
    get lastRun() { return lastRun; },
    get xAxis() { return xAxis; },
    get connected() { return conn.up; },
    get phase() { return conn.phase; },
    get polls() { return conn.polls; },
    get sizes() {
      const workers = {};
      for (const [name, points] of store.workers) workers[name] = points.length;
      const evals = {};
      for (const [name, points] of store.evals) evals[name] = points.length;
      return { samples: store.samples.length, rounds: store.rounds.length, workers, evals };
    },
  });

  // --- polling -----------------------------------------------------------------------------------------

  class HttpError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status; // 0: no answer at all
    }
  }

  async function getJSON(path) {
    const abort = new AbortController();
    const timer = setTimeout(() => abort.abort(), FETCH_TIMEOUT_MS);
    try {
      let r;
      try {
        r = await fetch(path, { signal: abort.signal, cache: "no-store", headers: HEADERS });
      } catch (e) {
        throw new HttpError(0, e.name === "AbortError" ? "no answer in time" : "no answer");
      }
      const body = await r.json().catch(() => null);
      if (!r.ok) throw new HttpError(r.status, (body && body.detail) || r.statusText);
      return body;
    } finally {
      clearTimeout(timer);
    }
  }

  async function poll() {
    try {
      const [status, series, run] = await Promise.all([
        getJSON(`api/status?rounds=0&hashes=0&credits=${CREDIT_ROWS}`),
        getJSON(`api/series?since=${store.since}`),
        getJSON("api/run"),
      ]);
      lastRun = run;
      Object.assign(conn, { up: true, phase: status.ready ? "ready" : "not ready", error: null });
      conn.lastAnswer = Date.now();
      conn.polls += 1;
      lastStatus = status;
      absorb(series);
      render(status, run);
    } catch (err) {
      if (err instanceof HttpError) {
        conn.up = err.status !== 0; // a 503 while the shard loads or stops
        conn.phase = conn.up ? "answers" : "disconnected";
      } else {
        console.error(err); // a bug in this page, not the shard's
        conn.phase = "page error";
      }
      conn.error = err.message;
      renderConnection();
    } finally {
      setTimeout(poll, conn.up ? POLL_MS : RETRY_MS);
    }
  }

  function absorb(series) {
    store.now = series.now;
    store.since = Math.max(store.since, series.now);
    const oldest = series.now - WINDOW_S;
    append(store.samples, series.samples, MAX_SAMPLES, oldest, (s) => s.t);
    append(store.rounds, series.rounds, MAX_ROUNDS, oldest, (r) => r.closed_at);
    for (const [name, points] of Object.entries(series.workers)) {
      if (points.length && !store.workers.has(name)) store.workers.set(name, []);
    }
    for (const [name, mine] of store.workers) {
      append(mine, (Object.hasOwn(series.workers, name) ? series.workers[name] : []), MAX_WORKER_POINTS, oldest, (p) => p.t);
      if (!mine.length) store.workers.delete(name); // silent for the whole window: off the charts
    }
    // eval points are few and slow to come: kept as long as their worker is on the charts
    for (const [name, points] of Object.entries(series.evals || {})) {
      if (!store.workers.has(name)) continue;
      if (!store.evals.has(name)) store.evals.set(name, []);
      append(store.evals.get(name), points, MAX_EVAL_POINTS, -Infinity, (p) => p.t);
    }
    for (const name of store.evals.keys()) if (!store.workers.has(name)) store.evals.delete(name);
  }

  /** Append `more` to `list`, then drop from the front what is older than `oldest` or beyond `max`. */
  function append(list, more, max, oldest, time) {
    for (const x of more) list.push(x);
    let drop = Math.max(0, list.length - max);
    while (drop < list.length && time(list[drop]) < oldest) drop += 1;
    if (drop) list.splice(0, drop);
  }

  // --- the page around the charts -------------------------------------------------------------------

  function render(status, run) {
    renderConnection();
    renderHeader(status);
    renderRun(run);
    renderStats(status);
    renderMembers(status);
    renderCredits(status.credits);
    renderCharts(status);
  }

  function renderConnection() {
    const pill = byId("conn");
    const bad = conn.phase === "disconnected" || conn.phase === "page error";
    pill.className = `pill ${conn.phase === "ready" ? "ok" : bad ? "bad" : "wait"}`;
    if (conn.phase === "disconnected") {
      pill.textContent = "disconnected, retrying";
    } else if (conn.phase === "page error") {
      pill.textContent = `page error: ${conn.error}`;
    } else if (conn.phase === "answers") {
      pill.textContent = conn.error; // "the shard is loading", "... stopping"
    } else {
      pill.textContent = conn.phase;
    }
    if (!conn.up && conn.lastAnswer) {
      const ago = (Date.now() - conn.lastAnswer) / 1000;
      byId("uptime").textContent = `last answer ${fmtDuration(ago)} ago`;
    } else if (!conn.up) {
      byId("uptime").textContent = conn.error || "";
    }
  }

  function renderHeader(s) {
    const c = s.config;
    byId("shard").textContent = `run, from shard ${s.shard} of ${s.num_shards}`;
    byId("this-shard").textContent = `${s.shard} of ${s.num_shards}`;
    document.title = `run (shard ${s.shard}/${s.num_shards}) · streamdiloco`;
    byId("uptime").textContent = `up ${fmtDuration(s.uptime_seconds)}`;
    byId("config").textContent = [
      `H=${c.sync_every}`,
      `${c.num_fragments} fragments (${c.fragment_pattern})`,
      `τ=${c.fragment_sync_delay}`,
      `α=${c.fragment_update_alpha}`,
      `codecs ${c.uplink_codec} up, ${c.downlink_codec} down`,
      c.outer_variant === "sparseloco"
        ? `outer lr ${c.outer_lr}, SparseLoCo (no outer momentum: the uplink's error feedback)`
        : `outer lr ${c.outer_lr}, momentum ${c.outer_momentum}${c.outer_nesterov ? " (Nesterov)" : ""}`,
      `min workers ${s.min_workers}`,
      `round timeout ${s.round_timeout} s`,
    ].join(" · ");
  }

  function renderRun(run) {
    const t = run.totals;
    const missing = t.num_shards != null && t.shards < t.num_shards;
    byId("shard-count").textContent = `${t.shards_up} of ${t.shards} shards answer` +
      (missing ? ` (the run has ${t.num_shards}: start the shards with --peers naming every one)` : "");
    byId("run-stats").replaceChildren(
      ...[
        ["shards up", `${t.shards_up} / ${t.shards}`, t.shards_up < t.shards],
        ["rounds closed, all shards", fmtInt(t.rounds_closed)],
        ["pushes accepted", fmtInt(t.pushes_accepted)],
        ["pushes refused", fmtInt(t.pushes_refused), t.pushes_refused > 0],
        ["bytes in", fmtBytes(t.bytes_in)],
        ["bytes out", fmtBytes(t.bytes_out)],
        ["round s, slowest shard's median", fmtSec(t.round_seconds_median)],
      ].map(([label, value, bad]) => card(label, value, bad)),
    );
    const rows = run.shards.map((x) => {
      const tr = el("tr", x.up ? "" : "down");
      tr.dataset.shard = x.up ? String(x.shard) : "";
      if (!x.up) {
        const why = el("td", "", `down: ${x.error}`);
        why.colSpan = 9;
        tr.append(el("td", "", "?"), why, el("td", "muted", x.url));
        return tr;
      }
      tr.append(
        el("td", "", `${x.shard} of ${x.num_shards}`),
        el("td", x.ready ? "" : "passive", x.ready ? "ready" : "not ready"),
        num(fmtInt(x.members)),
        num(fmtInt(x.rounds_closed)),
        el("td", "", x.rounds.map((r) => (r == null ? "–" : r)).join(" · ")),
        num(fmtInt(x.pushes_accepted)),
        num(fmtInt(x.pushes_refused)),
        num(fmtBytes(x.bytes_in)),
        num(fmtBytes(x.bytes_out)),
        num(`${fmtSec(x.round_seconds_median)} / ${fmtSec(x.round_seconds_max)}`),
        el("td", "muted", x.url == null ? "this shard" : x.url),
      );
      return tr;
    });
    document.querySelector("#shards tbody").replaceChildren(...rows);
  }

  function card(label, value, bad) {
    const c = el("div", bad ? "bad" : "");
    c.append(el("b", "", value), el("span", "", label));
    return c;
  }

  function renderStats(s) {
    const refused = Object.entries(s.pushes_refused);
    const refusedTotal = refused.reduce((n, [, k]) => n + k, 0);
    const ck = s.checkpoint;
    const cards = [
      ["rounds closed", fmtInt(s.rounds_closed)],
      ["pushes accepted", fmtInt(s.pushes_accepted)],
      [
        refused.length ? `refused: ${refused.map(([why, n]) => `${why} ${n}`).join(", ")}` : "pushes refused",
        fmtInt(refusedTotal),
        refusedTotal > 0,
      ],
      ["training loss (last round)", s.training_loss == null ? "–" : s.training_loss.toFixed(4)],
      [
        `round s, median / max of ${s.round_seconds.rounds}`,
        s.round_seconds.rounds ? `${fmtSec(s.round_seconds.median)} / ${fmtSec(s.round_seconds.max)}` : "–",
      ],
      ["bytes in", fmtBytes(s.bytes.message_bytes_in)],
      ["bytes out (updates + fetches)", fmtBytes(s.bytes.message_bytes_out + s.bytes.fetch_out)],
      ck
        ? [
          ck.errors ? `checkpoint writes / errors: ${ck.last_error}` : "checkpoint writes / errors",
          `${fmtInt(ck.writes)} / ${fmtInt(ck.errors)}`,
          ck.errors > 0,
        ]
        : ["checkpoints", "off"],
      ["bad messages", fmtInt(s.bad_messages), s.bad_messages > 0],
    ];
    const d = s.data; // shard 0: the run's data ledger
    if (d && d.bound) {
      cards.unshift([
        `data: pieces done, epoch ${fmtInt(d.epoch)}` +
          (d.eta_seconds == null ? "" : `, epoch ends in ${fmtDuration(d.eta_seconds)}`),
        `${fmtInt(d.pieces_done)} / ${fmtInt(d.pieces_total)}`,
      ]);
    }
    byId("stats").replaceChildren(...cards.map(([label, value, bad]) => card(label, value, bad)));
  }

  function renderMembers(s) {
    const passive = s.members.filter((m) => m.state !== "member").length;
    byId("member-count").textContent =
      `${s.members.length - passive} members, ${passive} passive (at least ${s.min_workers} per round)`;
    const members = [...s.members].sort((a, b) => (a.name < b.name ? -1 : 1)); // names are unique
    const rows = members.map((m) => {
      const name = el("td");
      const swatch = el("span", "swatch");
      swatch.style.background = colorOf(m.name);
      name.append(swatch, m.name);
      const receiving = el("td");
      for (const r of m.receiving) {
        const bar = el("progress");
        bar.max = r.of || 1;
        bar.value = r.values;
        receiving.append(`fragment ${r.fragment} round ${r.round}`, bar, " ");
      }
      const tr = el("tr");
      tr.dataset.worker = m.name;
      tr.append(
        name,
        el("td", m.state === "member" ? "" : "passive", m.state),
        num(m.step == null ? "–" : m.total_steps ? `${fmtInt(m.step)} / ${fmtInt(m.total_steps)}` : fmtInt(m.step)),
        num(m.eta_seconds == null ? "–" : fmtDuration(m.eta_seconds), "eta"),
        num(m.tokens_per_second == null ? "–" : fmtInt(Math.round(m.tokens_per_second))),
        num(m.compute_utilization == null ? "–" : `${(100 * m.compute_utilization).toFixed(0)}%`),
        num(m.last_loss == null ? "–" : m.last_loss.toFixed(4)),
        num(m.eval_loss == null ? "–" : m.eval_loss.toFixed(4), "eval"),
        num(fmtInt(m.pushes)),
        num(fmtInt(m.refused)),
        num(m.blocked_seconds == null ? "–" : m.blocked_seconds.toFixed(2)),
        num(fmtBytes(m.message_bytes_in)),
        num(fmtBytes(m.message_bytes_out)),
        receiving,
      );
      return tr;
    });
    fillTable("#members tbody", rows, "no workers connected", 14);
    const back = byId("returning");
    back.hidden = !s.returning.length;
    back.textContent = `Waiting for ${s.returning.length} member(s) to come back after a restart: ` +
      s.returning.join(", ");
  }

  /** The contribution ledger (server/credit.py): the most tokens first, the rest in one "others" line. */
  function renderCredits(c) {
    byId("credit-count").textContent =
      `${fmtInt(c.identities)} identities on this shard; tokens over its ${c.fragments} fragments`;
    const line = (w, name, className) => {
      const refused = Object.values(w.refused).reduce((a, b) => a + b, 0);
      const why = el("td", "num", fmtInt(refused));
      why.title = Object.entries(w.refused).map(([k, n]) => `${k}: ${n}`).join(", ");
      const tr = el("tr", className);
      tr.append(
        el("td", "", name),
        el("td", "muted", w.via || "–"),
        num(fmtInt(Math.round(w.tokens))),
        num(fmtInt(w.rounds)),
        num(fmtInt(w.pushes)),
        num(fmtInt(w.clipped)),
        num(fmtInt(w.capped)),
        num(fmtInt(w.late)),
        why,
        num(fmtDuration(w.connected_seconds)),
      );
      return tr;
    };
    const rows = c.workers.map((w) => {
      const tr = line(w, w.worker, w.connected ? "" : "muted");
      tr.dataset.worker = w.worker;
      return tr;
    });
    if (c.others.identities) rows.push(line(c.others, `${fmtInt(c.others.identities)} others`, "muted"));
    fillTable("#credits tbody", rows, "no contributions yet", 10);
  }

  // --- charts ------------------------------------------------------------------------------------------

  function renderCharts(status) {
    const P = status.config.num_fragments;
    const fragments = [...Array(P).keys()];
    const workers = [...store.workers.keys()].sort().slice(0, MAX_WORKERS);
    const fixed = (digits) => legendValue((v) => v.toFixed(digits));
    const byFragment = fragments.map((p) => ({ label: `fragment ${p}`, stroke: colorOfFragment(p) }));
    const byWorker = (digits) =>
      workers.map((w) => ({ label: w, stroke: colorOf(w), spanGaps: true, value: fixed(digits) }));
    const stepped = uPlot.paths.stepped({ align: 1 });

    draw("rounds", {
      series: byFragment.map((s) => ({ ...s, paths: stepped, value: fixed(0) })),
      data: fragmentRounds(P, status),
      fromZero: true,
    });
    const x = X_AXES[xAxis];
    draw("loss", { series: byWorker(3), data: workerSeries(workers, store.workers, "loss", x), x });
    draw("eval", {
      series: byWorker(4).map((s) => ({ ...s, points: { show: true, size: 6, fill: s.stroke } })),
      data: workerSeries(workers, store.evals, "eval_loss", x),
      x,
    });
    draw("bytes", {
      series: [
        { label: "in", stroke: PALETTE[0], fill: "#0969da22", value: legendValue((v) => `${fmtBytes(v)}/s`) },
        { label: "out", stroke: PALETTE[4], value: legendValue((v) => `${fmtBytes(v)}/s`) },
      ],
      data: byteRates(),
      fromZero: true,
      ticks: fmtBytes,
    });
    draw("durations", {
      series: byFragment.map((s) => ({
        ...s,
        value: fixed(3),
        paths: () => null, // points only: one per closed round
        points: { show: true, size: 6, fill: s.stroke },
      })),
      data: roundDurations(P),
      fromZero: true,
    });
    draw("blocked", {
      series: byWorker(2),
      data: workerSeries(workers, store.workers, "blocked_seconds", x),
      fromZero: true,
      x,
    });
    draw("members", {
      series: [
        { label: "members", stroke: PALETTE[2], paths: stepped, value: fixed(0) },
        { label: "passive", stroke: PALETTE[8], paths: stepped, value: fixed(0) },
      ],
      data: ["t", "members", "passive"].map((key) => store.samples.map((s) => s[key])),
      fromZero: true,
    });
  }

  /** Create the chart, or give it the new data; a new chart when its set of series or its x-axis changed.
      `x`: "t" (wall time), "step" or "tokens". */
  function draw(name, { series, data, fromZero = false, ticks = null, x = "t" }) {
    const fig = byId(`chart-${name}`);
    const signature = [x, ...series.map((s) => s.label)].join("\n");
    let u = charts[name];
    if (u && signatures[name] !== signature) {
      u.destroy();
      u = null;
    }
    if (u) {
      u.setData(data);
    } else {
      // uPlot's own labels keep 3 decimals: blocked times of a few ms would all read "0"
      const yAxis = { size: 64, values: (u, splits) => splits.map(ticks || ((v) => `${+v.toPrecision(6)}`)) };
      const xSeries = x === "t"
        ? { label: "time", value: timeOf }
        : { label: x === "step" ? "step" : "tokens", value: (u, v) => (v == null ? "latest" : fmtCount(v)) };
      const xAxisOpts = x === "t" ? {} : { label: x === "step" ? "steps" : "tokens", labelSize: 18,
        values: (u, splits) => splits.map(fmtCount) };
      const scales = fromZero ? { y: { range: (u, min, max) => [0, max > 0 ? max * 1.08 : 1] } } : {};
      if (x !== "t") scales.x = { time: false };
      const opts = {
        width: chartWidth(fig),
        height: CHART_HEIGHT,
        series: [xSeries, ...series],
        axes: [xAxisOpts, yAxis],
        scales,
        // no zoom: the data keeps moving; the cursor moves together on the charts with the same x-axis
        cursor: { drag: { x: false, y: false }, sync: { key: `sd-${x}` } },
      };
      charts[name] = new uPlot(opts, data, fig);
      signatures[name] = signature;
    }
    let empty = fig.querySelector(".nodata");
    if (!empty) {
      empty = el("p", "nodata", "no data yet");
      fig.append(empty);
    }
    empty.hidden = data[0].length > 0;
  }

  /** Each fragment's round after each close (its round is k+1 once round k closed), to the present. */
  function fragmentRounds(P, status) {
    const xs = [];
    const ys = Array.from({ length: P }, () => []);
    const current = new Array(P).fill(null);
    for (const r of store.rounds) {
      if (r.fragment >= P) continue;
      current[r.fragment] = r.round + 1;
      xs.push(r.closed_at);
      current.forEach((v, p) => ys[p].push(v));
    }
    if (store.now != null && (xs.length === 0 || store.now > xs[xs.length - 1])) {
      xs.push(store.now); // the line goes on to now, at the round the shard reports
      status.fragments.forEach((f) => {
        if (f.fragment < P) ys[f.fragment].push(Math.max(f.round, current[f.fragment] ?? 0));
      });
    }
    return [xs, ...ys];
  }

  function roundDurations(P) {
    const xs = store.rounds.map((r) => r.closed_at);
    const ys = Array.from({ length: P }, (_, p) =>
      store.rounds.map((r) => (r.fragment === p ? r.seconds : null)));
    return [xs, ...ys];
  }

  /** One x array for all workers (their points merged by `x`: time, step or tokens); null where a worker
      has no point. */
  function workerSeries(names, source, field, x) {
    const events = [];
    names.forEach((name, i) => {
      for (const p of source.get(name) || []) events.push([p[x], i, p[field]]);
    });
    events.sort((a, b) => a[0] - b[0]);
    const xs = events.map((e) => e[0]);
    const ys = names.map(() => new Array(events.length).fill(null));
    events.forEach(([, i, v], k) => { ys[i][k] = v; });
    return [xs, ...ys];
  }

  /** Bytes per second between consecutive samples of the shard's cumulative counters. */
  function byteRates() {
    const s = store.samples;
    const xs = [];
    const ins = [];
    const outs = [];
    for (let i = 1; i < s.length; i++) {
      const dt = s[i].t - s[i - 1].t;
      const rate = (key) => {
        const d = s[i][key] - s[i - 1][key];
        return dt > 0 && dt <= MAX_GAP_S && d >= 0 ? d / dt : null; // counters restart with the shard
      };
      xs.push(s[i].t);
      ins.push(rate("bytes_in"));
      outs.push(rate("bytes_out"));
    }
    return [xs, ins, outs];
  }

  /** Legend text: the value under the cursor, or the latest when the cursor is elsewhere; in a series with
      gaps (workers report at their own times), the latest value up to there. */
  function legendValue(format) {
    return (u, v, sidx, idx) => {
      const ys = u.data[sidx];
      for (let i = idx ?? ys.length - 1; v == null && i >= 0; i--) v = ys[i];
      return v == null ? "–" : format(v);
    };
  }

  function timeOf(u, t) {
    return t == null ? "latest" : new Date(t * 1000).toLocaleTimeString();
  }

  function chartWidth(fig) {
    return Math.max(200, fig.clientWidth - 18);
  }

  let resizing = false;
  window.addEventListener("resize", () => {
    if (resizing) return;
    resizing = true;
    requestAnimationFrame(() => {
      resizing = false;
      for (const [name, u] of Object.entries(charts)) {
        u.setSize({ width: chartWidth(byId(`chart-${name}`)), height: CHART_HEIGHT });
      }
    });
  });

  // --- small helpers -----------------------------------------------------------------------------------

  function colorOf(name) {
    if (!colors.has(name)) colors.set(name, PALETTE[colors.size % PALETTE.length]);
    return colors.get(name);
  }

  function colorOfFragment(p) {
    return PALETTE[p % PALETTE.length];
  }

  /** A table's rows, or one line saying there are none. */
  function fillTable(selector, rows, none, columns) {
    if (!rows.length) {
      const td = el("td", "empty", none);
      td.colSpan = columns;
      rows.push(el("tr"));
      rows[0].append(td);
    }
    document.querySelector(selector).replaceChildren(...rows);
  }

  function byId(id) {
    return document.getElementById(id);
  }

  function el(tag, className = "", text = null) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text != null) node.textContent = text;
    return node;
  }

  function num(text, className = "") {
    return el("td", className ? `num ${className}` : "num", text);
  }

  function fmtInt(n) {
    return n == null ? "–" : n.toLocaleString("en-US");
  }

  /** Steps and tokens on an axis: 1200, 35k, 1.2M. */
  function fmtCount(n) {
    if (n == null) return "–";
    const a = Math.abs(n);
    if (a >= 1e9) return `${+(n / 1e9).toFixed(1)}G`;
    if (a >= 1e6) return `${+(n / 1e6).toFixed(1)}M`;
    if (a >= 1e4) return `${+(n / 1e3).toFixed(1)}k`;
    return `${Math.round(n)}`;
  }

  function fmtSec(s) {
    return s == null ? "–" : `${s.toFixed(s < 10 ? 3 : 1)} s`;
  }

  function fmtBytes(n) {
    if (n == null) return "–";
    const units = ["B", "kB", "MB", "GB", "TB"];
    let i = 0;
    while (Math.abs(n) >= 1000 && i < units.length - 1) {
      n /= 1000;
      i += 1;
    }
    return `${n.toFixed(i > 0 && Math.abs(n) < 100 ? 1 : 0)} ${units[i]}`;
  }

  function fmtDuration(seconds) {
    const s = Math.floor(seconds);
    if (s < 60) return `${s} s`;
    if (s < 3600) return `${Math.floor(s / 60)} min ${s % 60} s`;
    if (s < 86400) return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
    return `${Math.floor(s / 86400)} d ${Math.floor((s % 86400) / 3600)} h`;
  }

  // the workers' charts over time, steps or tokens: drawn again at once with what is stored
  for (const input of document.querySelectorAll('input[name="xaxis"]')) {
    input.addEventListener("change", () => {
      if (!input.checked || !Object.hasOwn(X_AXES, input.value)) return;
      xAxis = input.value;
      if (lastStatus) renderCharts(lastStatus);
    });
  }

  poll();
})();
