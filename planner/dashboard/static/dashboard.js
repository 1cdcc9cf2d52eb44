// The planner dashboard: polls /api/state for what is new, redraws its charts, and
// shows the latest tick as tiles and each worker in a table.
"use strict";

const KEEP = 720; // points per chart, as many as the planner keeps
const POLL_MS = 1000;
const COLORS = { prefill: "#c2410c", decode: "#1d4ed8", predicted: "#7c3aed",
                 p50: "#15803d", p99: "#b91c1c", slo: "#6b7480", extra: "#0f766e",
                 held: "#a16207", shed: "#b91c1c", unavailable: "#6d28d9" };

const rows = [];
let since = 0;
let settings = {};
let lastTick = 0;
let workers = [];

const line = (label, stroke, extra = {}) => ({ label, stroke, width: 2, spanGaps: true, ...extra });
const dashed = (label, stroke, extra = {}) => line(label, stroke, { dash: [6, 4], ...extra });
const stepped = (label, stroke, dash) =>
  line(label, stroke, { dash, paths: uPlot.paths.stepped({ align: 1 }) });

// the time axis as a clock (uPlot's default adds the date under every tick)
const TIME_AXIS = { values: (u, ticks) => ticks.map(t => clock(t)), space: 70 };
const SECONDS_AXIS = { scale: "s", side: 1, size: 56, grid: { show: false } };

// every chart: its series and how each is read off a row
const CHARTS = {
  ttft: {
    series: [line("p50", COLORS.p50), line("p99", COLORS.p99), dashed("SLO (p99)", COLORS.slo)],
    values: r => [r.ttft_p50, r.ttft_p99, settings.ttft_slo_s ?? null],
  },
  // beside TTFT: where the requests it waits on are
  queue: {
    series: [
      line("decode queue", COLORS.decode), line("prefill queue", COLORS.prefill),
      line("held", COLORS.held), dashed("oldest prefill (s)", COLORS.extra, { scale: "s" }),
    ],
    values: r => [r.decode_waiting, r.queue_depth, r.held, r.queue_age],
    axes: [TIME_AXIS, { size: 64 }, SECONDS_AXIS],
  },
  refused: {
    series: [line("429 shed", COLORS.shed), line("503 unavailable", COLORS.unavailable)],
    values: r => [r.refused_429, r.refused_503],
  },
  sla: {
    series: [line("TTFT within SLO", COLORS.prefill), line("ITL within SLO", COLORS.decode)],
    values: r => [pct(r.ttft_attainment), pct(r.itl_attainment)],
    scales: { y: { range: [0, 100] } },
  },
  itl: {
    series: [line("p50", COLORS.p50), line("p99", COLORS.p99), dashed("SLO (p99)", COLORS.slo)],
    values: r => [ms(r.itl_p50), ms(r.itl_p99), ms(settings.itl_slo_s)],
  },
  rate: {
    series: [line("observed", COLORS.decode), dashed("predicted", COLORS.predicted)],
    values: r => [r.rate, r.rate_predicted],
  },
  replicas: {
    series: [
      stepped("prefill ready", COLORS.prefill), stepped("prefill desired", COLORS.prefill, [6, 4]),
      stepped("decode ready", COLORS.decode), stepped("decode desired", COLORS.decode, [6, 4]),
    ],
    values: r => [r.ready_prefill, r.desired_prefill, r.ready_decode, r.desired_decode],
    height: 220,
  },
  prompt: {
    series: [line("observed", COLORS.prefill), dashed("predicted", COLORS.predicted)],
    values: r => [r.prompt_tps, r.prompt_tps_predicted],
  },
  kv: {
    series: [line("decode", COLORS.decode), line("prefill", COLORS.prefill)],
    values: r => [pct(r.kv_decode), pct(r.kv_prefill)],
  },
};

function ms(x) { return x == null ? null : x * 1000; }
function pct(x) { return x == null ? null : x * 100; }
function fixed(x, digits) { return x == null ? null : x.toFixed(digits); }
// three significant digits: a few accelerator-seconds still read as more than nothing
function sig(x) { return x == null ? null : x === 0 || x >= 100 ? x.toFixed(0) : x.toPrecision(3); }

// the latest tick at a glance: [id, label, value (text or null), unit, why (tooltip),
// bad (highlight)]; null shows as a dash (nothing measured in the last interval)
const TILES = [
  ["ttft", "TTFT p99", r => fixed(r.ttft_p99, 2), "s",
   "the last interval's 99th percentile time to first token, from the frontend's histogram",
   r => r.ttft_p99 != null && r.ttft_p99 > settings.ttft_slo_s],
  ["itl", "TPOT / ITL p99", r => fixed(ms(r.itl_p99), 0), "ms",
   "the last interval's 99th percentile gap between tokens",
   r => r.itl_p99 != null && r.itl_p99 > settings.itl_slo_s],
  ["sla", "SLA attainment", r => attained(r), r => attainedEach(r),
   "the lower of: the share of the last interval's requests with TTFT within the target, " +
   "and of its token gaps with ITL within the target; counted from the frontend's " +
   "histogram buckets up to the largest bound not above the target (a lower bound when " +
   "the target falls inside a bucket)",
   r => (r.ttft_attainment ?? 1) < 0.99 || (r.itl_attainment ?? 1) < 0.99],
  ["rate", "Requests", r => fixed(r.rate, 1), "/s", "requests admitted per second", () => false],
  ["refused", "Refused", r => fixed((r.refused_429 ?? 0) + (r.refused_503 ?? 0), 1), "/s",
   "requests per second the frontends answered 429 (shed: the decode pool saturated) " +
   "or 503 (no worker to serve, or too many held)",
   r => (r.refused_429 ?? 0) + (r.refused_503 ?? 0) > 0],
  ["decode-queue", "Decode queue", r => String(r.decode_waiting), "requests",
   "requests queued in the decode workers for a batch slot", () => false],
  ["prefill-queue", "Prefill queue", r => String(r.queue_depth), "requests",
   "remote prefills waiting for a prefill worker", () => false],
  ["held", "Held", r => String(r.held), "requests",
   "requests the frontends hold for a decode worker to join (the pool has none)",
   r => r.held > 0],
  ["workers", "Workers ready", r => `${r.ready_prefill} P · ${r.ready_decode} D`,
   r => `desired ${r.desired_prefill ?? "?"} P · ${r.desired_decode ?? "?"} D`,
   "workers that answered the last two scrapes, per pool", () => false],
  ["accelerator-hours", "Accelerator-hours", r => sig(r.accelerator_hours), "so far",
   "ready workers x their accelerators, integrated over the planner's ticks " +
   "(the planner's clock: simulated hours under a time scale)", () => false],
  ["ready", "Time to ready", () => newestReady(), "s, newest worker",
   "seconds from the newest worker's process start to its registration in discovery",
   () => false],
];

// a share as a percentage: whole at the ends, one decimal where 99 and 99.9 differ
function share(x) { return x == null ? "–" : (100 * x).toFixed(x >= 0.999 || x < 0.1 ? 0 : 1); }

function attained(r) {
  const known = [r.ttft_attainment, r.itl_attainment].filter(x => x != null);
  return known.length ? share(Math.min(...known)) : null;
}

function attainedEach(r) { return `% · TTFT ${share(r.ttft_attainment)} · ITL ${share(r.itl_attainment)}`; }

function newestReady() {
  const up = workers.filter(w => w.ready_s != null);
  if (!up.length) return null;
  const newest = up.reduce((a, b) => ((b.started ?? 0) > (a.started ?? 0) ? b : a));
  return newest.ready_s.toFixed(1);
}

function makeTiles() {
  const box = document.getElementById("tiles");
  for (const [id, label, , , why] of TILES) {
    const el = document.createElement("div");
    el.className = "tile";
    el.id = `tile-${id}`;
    el.title = why;
    el.innerHTML = '<div class="label"></div><div class="value">–</div><div class="unit"></div>';
    el.querySelector(".label").textContent = label;
    box.appendChild(el);
  }
}

function showTiles(r) {
  for (const [id, , value, unit, , bad] of TILES) {
    const el = document.getElementById(`tile-${id}`);
    const v = value(r);
    el.querySelector(".value").textContent = v ?? "–";
    el.querySelector(".unit").textContent = typeof unit === "function" ? unit(r) : unit;
    el.classList.toggle("bad", Boolean(bad(r)));
  }
}

function workerState(w) {
  if (w.ready_s == null) return "starting";
  if (w.waiting > 0) return "queueing";
  return w.running > 0 ? "serving" : "idle";
}

function showWorkers() {
  const body = document.querySelector("#workers tbody");
  body.replaceChildren();
  for (const w of workers) {
    const tr = document.createElement("tr");
    const cells = [
      [w.id, ""], [w.pool, ""], [workerState(w), `state ${workerState(w)}`],
      [String(w.running), "num"], [String(w.waiting), "num"],
      [w.kv == null ? "–" : `${(100 * w.kv).toFixed(0)} %`, "num"],
      [w.started == null ? "–" : clock(w.started), ""],
      [w.ready_s == null ? "–" : `${w.ready_s.toFixed(1)} s`, "num"],
    ];
    for (const [text, cls] of cells) {
      const td = document.createElement("td");
      td.textContent = text;
      if (cls) td.className = cls;
      tr.appendChild(td);
    }
    body.appendChild(tr);
  }
}

const charts = {};

function width(el) { return Math.max(320, el.parentElement.clientWidth - 24); }

function makeCharts() {
  for (const [name, c] of Object.entries(CHARTS)) {
    const el = document.getElementById(`chart-${name}`);
    const opts = {
      width: width(el),
      height: c.height || 180,
      series: [{}, ...c.series],
      scales: { x: { time: true }, ...(c.scales || {}) },
      axes: c.axes || [TIME_AXIS, { size: 64 }],
      legend: { live: true },
      cursor: { sync: { key: "planner" } }, // one moment across every chart
    };
    const empty = [[], ...c.series.map(() => [])];
    charts[name] = new uPlot(opts, empty, el);
  }
  window.addEventListener("resize", () => {
    for (const [name, chart] of Object.entries(charts)) {
      const el = document.getElementById(`chart-${name}`);
      chart.setSize({ width: width(el), height: chart.height });
    }
  });
}

function redraw() {
  const xs = rows.map(r => r.wall);
  for (const [name, c] of Object.entries(CHARTS)) {
    const columns = c.series.map(() => []);
    for (const r of rows) {
      c.values(r).forEach((v, i) => columns[i].push(v ?? null));
    }
    charts[name].setData([xs, ...columns]);
  }
}

function clock(wall) {
  return new Date(wall * 1000).toLocaleTimeString([], { hour12: false });
}

function addEvents(events) {
  const body = document.querySelector("#log tbody");
  for (const e of events) {
    const tr = document.createElement("tr");
    if (e.kind !== "decision") tr.className = "error";
    for (const [text, cls] of [[clock(e.wall), ""], [e.pool || e.kind, "pool"], [e.text, ""]]) {
      const td = document.createElement("td");
      td.textContent = text;
      if (cls) td.className = cls;
      tr.appendChild(td);
    }
    body.insertBefore(tr, body.firstChild);
  }
  while (body.children.length > KEEP) body.removeChild(body.lastChild);
}

function describe(state) {
  const s = state.settings;
  const pools = `prefill ${s.min_prefill}-${s.max_prefill}, decode ${s.min_decode}-${s.max_decode}`;
  const slo = `TTFT p99 < ${s.ttft_slo_s} s, ITL p99 < ${ms(s.itl_slo_s)} ms`;
  const mode = s.dry_run ? " · dry run" : "";
  return `${s.policy} policy · ${slo} · ${pools} · every ${s.interval_s} s · ` +
         `${s.predictor} predictor · ${state.connector} connector${mode}`;
}

function showStatus(state) {
  const el = document.getElementById("status");
  const t = state.targets;
  const age = lastTick ? Math.round(Date.now() / 1000 - lastTick) : null;
  const wall = (settings.interval_s || 10) / (settings.time_scale || 1);
  el.textContent = `targets: prefill ${t.prefill}, decode ${t.decode}` +
                   (age == null ? " · waiting for the first tick" : ` · last tick ${age} s ago`);
  el.classList.toggle("stale", age != null && age > 3 * wall + 5);
}

async function poll() {
  try {
    const r = await fetch(`/api/state?since=${since}`, { cache: "no-store" });
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    const state = await r.json();
    settings = state.settings;
    document.getElementById("summary").textContent = describe(state);
    if (state.ticks.length) {
      rows.push(...state.ticks);
      rows.splice(0, Math.max(0, rows.length - KEEP));
      lastTick = rows[rows.length - 1].wall;
      workers = state.workers;
      redraw();
      showWorkers();
      showTiles(rows[rows.length - 1]);
    }
    addEvents(state.events);
    since = state.seq;
    showStatus(state);
  } catch (err) {
    const el = document.getElementById("status");
    el.textContent = `planner unreachable: ${err.message}`;
    el.classList.add("stale");
  }
}

// for tests and the curious: the charts, how many points each shows, the tiles' text
window.dashboard = {
  charts,
  points: name => charts[name].data.slice(1).map(s => s.filter(v => v != null).length),
  ticks: () => rows.length,
  tiles: () => Object.fromEntries(TILES.map(([id]) =>
    [id, document.querySelector(`#tile-${id} .value`).textContent])),
};

makeTiles();
makeCharts();
poll();
setInterval(poll, POLL_MS);
