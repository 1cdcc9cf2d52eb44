"""The planner's HTTP face: the live dashboard, its data, Prometheus metrics, health.

    GET /dashboard          the page (uPlot charts, bundled in the wheel: no CDN)
    GET /dashboard/static/  its script, style and chart library
    GET /api/state?since=N  the ticks and decision-log events after sequence N, each
                            worker as the last tick saw it, and what the planner is
                            set to (the page polls this)
    GET /metrics            diptych_planner_* for Prometheus and Grafana
    GET /health             200 while the planner runs

The page asks only for what is new since its last poll, so it stays cheap however
long it is left open; the planner keeps its last `history` ticks in memory.

The page shows the latest tick as tiles (TTFT and ITL p99, SLA attainment, requests
and refusals per second, the decode and prefill queues, held requests, workers per
pool, accelerator-hours, the newest worker's time to ready), charts TTFT beside where
requests wait (decode queue, prefill queue, held) and what was refused (429, 503),
and lists each worker (state, running, queued, KV use, start, time to ready).
"""

from __future__ import annotations

import math
from importlib import resources
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from planner.observation import POOLS, WorkerState
from planner.service import PlannerService, Tick


def _num(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, 6)


def tick_row(tick: Tick) -> dict[str, Any]:
    """One tick as the dashboard plots it (None where nothing was measured)."""
    r = tick.result
    obs, fc = r.observation, r.forecast
    row: dict[str, Any] = {
        "seq": tick.seq,
        "wall": round(tick.wall, 3),
        "rate": _num(obs.request_rate),
        "rate_predicted": _num(fc.request_rate),
        "prompt_tps": _num(obs.prompt_tokens_per_s),
        "prompt_tps_predicted": _num(fc.prompt_tokens_per_s),
        "ttft_p50": _num(obs.ttft_p50_s),
        "ttft_p99": _num(obs.ttft_p99_s),
        "itl_p50": _num(obs.itl_p50_s),
        "itl_p99": _num(obs.itl_p99_s),
        "ttft_attainment": _num(obs.ttft_attainment),
        "itl_attainment": _num(obs.itl_attainment),
        "queue_depth": obs.prefill_queue_depth,
        "queue_age": _num(obs.prefill_queue_age_s),
        "running": obs.running_requests,
        "decode_waiting": obs.waiting_requests,
        "in_flight": obs.in_flight,
        "held": obs.held,
        "refused_429": _num(obs.refused_429_rate),
        "refused_503": _num(obs.refused_503_rate),
        "accelerator_hours": _num(tick.accelerator_hours),
    }
    for pool in POOLS:
        row[f"kv_{pool}"] = _num(obs.kv_usage.get(pool))
        row[f"ready_{pool}"] = obs.ready_in(pool)
    for d in r.decisions:
        row[f"desired_{d.pool}"] = d.target
    for p in r.proposals:
        row[f"proposed_{p.pool}"] = p.replicas
    return row


def worker_row(w: WorkerState) -> dict[str, Any]:
    return {
        "id": w.worker_id,
        "pool": w.pool,
        "running": w.running,
        "waiting": w.waiting,
        "kv": _num(w.kv_usage),
        "started": _num(w.started),
        "ready_s": _num(w.ready_s),
    }


def state(service: PlannerService, settings: dict[str, Any], since: int = 0) -> dict[str, Any]:
    ticks = [tick_row(t) for t in service.history if t.seq > since]
    last = service.history[-1] if service.history else None
    events = [
        {"seq": e.seq, "wall": round(e.wall, 3), "kind": e.kind, "pool": e.pool, "text": e.text}
        for e in service.events
        if e.seq > since
    ]
    return {
        "settings": settings,
        "seq": max([since] + [t["seq"] for t in ticks] + [e["seq"] for e in events]),
        "ticks": ticks,
        "events": events,
        "targets": {p: service.planner.target(p) for p in POOLS},
        # each worker at the last tick (the newest only: the table shows the present)
        "workers": [worker_row(w) for w in last.result.observation.workers] if last else [],
        "connector": service.connector.name if service.connector is not None else "none",
    }


def _page() -> str:
    return resources.files(__package__).joinpath("static/dashboard.html").read_text()


def app(service: PlannerService, settings: dict[str, Any]) -> Starlette:
    """The planner's ASGI app; `settings` is shown on the page as the planner's set-up."""
    page = _page()

    async def dashboard(request: Request) -> Response:
        return HTMLResponse(page)

    async def api_state(request: Request) -> Response:
        try:
            since = int(request.query_params.get("since", "0"))
        except ValueError:
            return JSONResponse({"error": "since must be an integer"}, status_code=400)
        return JSONResponse(state(service, settings, since))

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def health(request: Request) -> Response:
        return PlainTextResponse("ok")

    async def root(request: Request) -> Response:
        return HTMLResponse('<a href="/dashboard">the planner dashboard</a>')

    static = StaticFiles(packages=[(__package__, "static")])
    return Starlette(
        routes=[
            Route("/", root),
            Route("/dashboard", dashboard),
            Route("/api/state", api_state),
            Route("/metrics", metrics),
            Route("/health", health),
            Mount("/dashboard/static", static),
        ]
    )
