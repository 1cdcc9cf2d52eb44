// The planner dashboard: polls /api/state for what is new and redraws its charts.
"use strict";

const KEEP = 720; // points per chart, as many as the planner keeps
const POLL_MS = 1000;
const COLORS = { prefill: "#c2410c", decode: "#1d4ed8", predicted: "#7c3aed",
                 p50: "#15803d", p99: "#b91c1c", slo: "#6b7480", extra: "#0f766e" };

const rows = [];
let since = 0;
let settings = {};
let lastTick = 0;

const line = (label, stroke, extra = {}) => ({ label, stroke, width: 2, spanGaps: true, ...extra });
const dashed = (label, stroke) => line(label, stroke, { dash: [6, 4] });
const stepped = (label, stroke, dash) =>
  line(label, stroke, { dash, paths: uPlot.paths.stepped({ align: 1 }) });

// the time axis as a clock (uPlot's default adds the date under every tick)
const TIME_AXIS = { values: (u, ticks) => ticks.map(t => clock(t)), space: 70 };

// every chart: its series and how each is read off a row
const CHARTS = {
  replicas: {
    series: [
      stepped("prefill ready", COLORS.prefill), stepped("prefill desired", COLORS.prefill, [6, 4]),
      stepped("decode ready", COLORS.decode), stepped("decode desired", COLORS.decode, [6, 4]),
    ],
    values: r => [r.ready_prefill, r.desired_prefill, r.ready_decode, r.desired_decode],
    height: 220,
  },
  rate: {
    series: [line("observed", COLORS.decode), dashed("predicted", COLORS.predicted)],
    values: r => [r.rate, r.rate_predicted],
  },
  prompt: {
    series: [line("observed", COLORS.prefill), dashed("predicted", COLORS.predicted)],
    values: r => [r.prompt_tps, r.prompt_tps_predicted],
  },
  ttft: {
    series: [line("p50", COLORS.p50), line("p99", COLORS.p99), dashed("SLO (p99)", COLORS.slo)],
    values: r => [r.ttft_p50, r.ttft_p99, settings.ttft_slo_s ?? null],
  },
  itl: {
    series: [line("p50", COLORS.p50), line("p99", COLORS.p99), dashed("SLO (p99)", COLORS.slo)],
    values: r => [ms(r.itl_p50), ms(r.itl_p99), ms(settings.itl_slo_s)],
  },
  queue: {
    series: [line("depth", COLORS.prefill), line("oldest (s)", COLORS.extra, { scale: "s" })],
    values: r => [r.queue_depth, r.queue_age],
    axes: [TIME_AXIS, { size: 64 }, { scale: "s", side: 1, size: 56, grid: { show: false } }],
  },
  kv: {
    series: [line("decode", COLORS.decode), line("prefill", COLORS.prefill)],
    values: r => [pct(r.kv_decode), pct(r.kv_prefill)],
  },
};

function ms(x) { return x == null ? null : x * 1000; }
function pct(x) { return x == null ? null : x * 100; }

const charts = {};

function width(el) { return Math.max(320, el.parentElement.clientWidth - 24); }

function makeCharts() {
  for (const [name, c] of Object.entries(CHARTS)) {
    const el = document.getElementById(`chart-${name}`);
    const opts = {
      width: width(el),
      height: c.height || 180,
      series: [{}, ...c.series],
      scales: { x: { time: true } },
      axes: c.axes || [TIME_AXIS, { size: 64 }],
      legend: { live: true },
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
      redraw();
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

// for tests and the curious: the charts and how many points each shows
window.dashboard = {
  charts,
  points: name => charts[name].data.slice(1).map(s => s.filter(v => v != null).length),
  ticks: () => rows.length,
};

makeCharts();
poll();
setInterval(poll, POLL_MS);
