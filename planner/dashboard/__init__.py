"""The planner's HTTP face: the live dashboard, its data, Prometheus metrics, health.

    GET /dashboard          the page (uPlot charts, bundled in the wheel: no CDN)
    GET /dashboard/static/  its script, style and chart library
    GET /api/state?since=N  the ticks and decision-log events after sequence N, and
                            what the planner is set to (the page polls this)
    GET /metrics            diptych_planner_* for Prometheus and Grafana
    GET /health             200 while the planner runs

The page asks only for what is new since its last poll, so it stays cheap however
long it is left open; the planner keeps its last `history` ticks in memory.
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

from planner.observation import POOLS
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
        "queue_depth": obs.prefill_queue_depth,
        "queue_age": _num(obs.prefill_queue_age_s),
        "running": obs.running_requests,
    }
    for pool in POOLS:
        row[f"kv_{pool}"] = _num(obs.kv_usage.get(pool))
        row[f"ready_{pool}"] = obs.ready_in(pool)
    for d in r.decisions:
        row[f"desired_{d.pool}"] = d.target
    for p in r.proposals:
        row[f"proposed_{p.pool}"] = p.replicas
    return row


def state(service: PlannerService, settings: dict[str, Any], since: int = 0) -> dict[str, Any]:
    ticks = [tick_row(t) for t in service.history if t.seq > since]
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
