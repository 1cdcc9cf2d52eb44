"""The planner dashboard: its JSON API and static files over HTTP, and the page in a
real headless Chromium, fed by a planner ticking on a changing synthetic load: every
chart, tile and the worker table must show what the planner measured.

The browser test needs Debian's `chromium` and `chromium-driver` and selenium
(`scripts/install --test` installs them); it fails, never skips, without them.
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import generate_latest

from benchmarks.browser import dashboard_filled, full_page_screenshot, headless_chromium, wait_for
from decode_worker.metrics import DecodeMetrics
from frontend.metrics import FrontendMetrics
from planner import Limits, LoadPolicy, Planner, PoolLimits
from planner.connectors import RecordingConnector
from planner.dashboard import app as dashboard_app
from planner.observation import Slo
from planner.scrape import Snapshot
from planner.service import PlannerService
from planner.source import Round
from prefill_worker.metrics import PrefillMetrics
from runtime.asgi_server import AsgiServer

CHARTS = ("replicas", "rate", "prompt", "ttft", "itl", "queue", "refused", "sla", "kv")
TILES = ("ttft", "itl", "sla", "rate", "refused", "decode-queue", "prefill-queue", "held",
         "workers", "accelerator-hours", "ready")  # fmt: skip


def _snap(metrics: Any) -> Snapshot:
    return Snapshot.parse(generate_latest(metrics.registry).decode())


class Wave:
    """A fleet under a load that rises and falls, one round per scrape."""

    def __init__(self) -> None:
        self.front, self.dec, self.pre = FrontendMetrics(), DecodeMetrics(), PrefillMetrics()
        self.dec.registered()
        self.pre.registered()
        self.n = 0

    async def scrape(self) -> Round:
        self.n += 1
        load = 1 + math.sin(self.n / 3)
        for _ in range(int(10 * load) + 1):
            self.front.arrivals.inc()
            self.front.prompt_length.observe(1000)
            self.front.e2e.observe(2.0)
            self.front.ttft.observe(0.2 * load + 0.05 if _ % 4 else 0.6 * load)
            self.front.itl.observe(0.02 * load + 0.01)
            self.front.prompt_tokens.inc(1000)
            self.front.generation_tokens.inc(100)
        # at the crest, the decode pool sheds and queues; the frontends hold a few
        self.front.requests.labels("/v1/completions", "200").inc(int(10 * load) + 1)
        self.front.requests.labels("/v1/completions", "429").inc(int(3 * load))
        self.front.requests.labels("/v1/chat/completions", "503").inc(self.n % 2)
        self.front.held.set(int(2 * load))
        self.dec.running.set(int(8 * load) + 1)
        self.dec.waiting.set(int(6 * load))
        self.pre.in_flight.set(1)
        self.dec.kv_used_blocks.set(90 * load / 2)
        self.dec.kv_total_blocks.set(100)
        self.dec.queue_depth.set(int(4 * load))
        self.dec.oldest_remote.set(0.5 * load)
        self.pre.kv_used_blocks.set(10)
        self.pre.kv_total_blocks.set(100)
        workers = {
            "decode": {"decode-0": _snap(self.dec)},
            "prefill": {"prefill-0": _snap(self.pre)},
        }
        return Round(_snap(self.front), workers)


def _service(interval_s: float) -> PlannerService:
    limits = Limits(PoolLimits(1, 4), PoolLimits(1, 4), up_cooldown_s=0, down_cooldown_s=0)
    planner = Planner(LoadPolicy(), limits)
    return PlannerService(planner, Wave(), RecordingConnector(), interval_s=interval_s,
                          slo=Slo(ttft_s=0.5, itl_s=0.05))  # as SETTINGS says  # fmt: skip


SETTINGS = {"policy": "load", "ttft_slo_s": 0.5, "itl_slo_s": 0.05, "interval_s": 0.3,
            "min_prefill": 1, "max_prefill": 4, "min_decode": 1, "max_decode": 4,
            "predictor": "constant", "dry_run": False, "time_scale": 1.0}  # fmt: skip


async def test_state_api_static_files_and_metrics() -> None:
    svc = _service(1.0)
    for _ in range(4):
        await svc.tick_once()
    server = AsgiServer(dashboard_app(svc, SETTINGS), "127.0.0.1", 0, name="planner")
    address = await server.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://{address}") as http:
            doc = (await http.get("/api/state")).json()
            assert len(doc["ticks"]) == 3  # the first round is the baseline
            row = doc["ticks"][-1]
            assert row["ready_decode"] == 1 and row["desired_decode"] >= 1
            assert row["rate"] > 0 and row["ttft_p99"] > 0 and row["kv_decode"] > 0
            assert 0 < row["ttft_attainment"] <= 1 and row["itl_attainment"] == 1.0
            assert row["refused_429"] > 0 and row["decode_waiting"] > 0 and row["held"] > 0
            assert row["accelerator_hours"] > doc["ticks"][0]["accelerator_hours"] > 0
            workers = {w["id"]: w for w in doc["workers"]}
            assert set(workers) == {"decode-0", "prefill-0"}
            assert workers["decode-0"]["pool"] == "decode" and workers["decode-0"]["running"] > 0
            assert workers["decode-0"]["kv"] > 0 and workers["prefill-0"]["ready_s"] > 0
            assert workers["prefill-0"]["started"] <= row["wall"]
            assert doc["settings"] == SETTINGS and doc["connector"] == "recording"
            later = (await http.get("/api/state", params={"since": doc["seq"]})).json()
            assert later["ticks"] == [] and later["events"] == []
            assert (await http.get("/api/state?since=x")).status_code == 400
            page = await http.get("/dashboard")
            assert page.status_code == 200 and "uPlot.iife.min.js" in page.text
            lib = await http.get("/dashboard/static/uPlot.iife.min.js")
            assert lib.status_code == 200 and len(lib.content) > 20_000  # bundled, no CDN
            assert "cdn" not in page.text.lower() and "https://" not in page.text
            metrics = (await http.get("/metrics")).text
            assert "diptych_planner_ticks_total 3.0" in metrics
            assert 'diptych_planner_desired_replicas{pool="decode"}' in metrics
    finally:
        await server.stop()


def _browse(url: str, shot: Path) -> dict[str, Any]:
    with headless_chromium(1400, 1300) as driver:
        driver.get(url)

        def charted() -> bool:
            points = driver.execute_script(
                "return Object.fromEntries(Object.keys(window.dashboard.charts)"
                ".map(n => [n, window.dashboard.points(n)]))"
            )
            return all(min(points[name]) >= 2 for name in CHARTS)

        wait_for(charted, 60, "data points in every series of every chart")

        def tiled() -> dict[str, str] | None:
            tiles: dict[str, str] = driver.execute_script("return window.dashboard.tiles()")
            return tiles if all(tiles[t] not in ("", "–") for t in TILES) else None

        tiles = wait_for(tiled, 30, "a value in every tile")
        assert dashboard_filled(driver)
        table = driver.execute_script(
            "return [...document.querySelectorAll('#workers tbody tr')]"
            ".map(tr => [...tr.children].map(td => td.textContent))"
        )
        first = driver.execute_script("return window.dashboard.ticks()")
        wait_for(lambda: driver.execute_script("return window.dashboard.ticks()") >= first + 3,
                 30, "the page to take in new ticks without a reload")  # fmt: skip
        rows = driver.execute_script("return document.querySelectorAll('#log tbody tr').length")
        summary = driver.execute_script("return document.getElementById('summary').textContent")
        errors = [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
        full_page_screenshot(driver, str(shot))
        return {"rows": rows, "summary": summary, "errors": errors, "first": first,
                "tiles": tiles, "table": table}  # fmt: skip


async def test_the_dashboard_renders_and_updates_in_headless_chromium(tmp_path: Path) -> None:
    svc = _service(0.3)
    server = AsgiServer(dashboard_app(svc, SETTINGS), "127.0.0.1", 0, name="planner")
    address = await server.start()
    task = asyncio.create_task(svc.run())
    try:
        shot = tmp_path / "dashboard.png"
        seen = await asyncio.to_thread(_browse, f"http://{address}/dashboard", shot)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await server.stop()
    assert seen["errors"] == []  # no script errors, no failed loads
    assert "load policy" in seen["summary"] and "recording connector" in seen["summary"]
    assert seen["rows"] >= 1  # the decision log shows the scale-ups the wave caused
    assert set(seen["tiles"]) == set(TILES)
    assert float(seen["tiles"]["ttft"]) > 0 and float(seen["tiles"]["accelerator-hours"]) > 0
    assert float(seen["tiles"]["ready"]) > 0 and "P" in seen["tiles"]["workers"]
    # worker, pool, state, running, queued, KV use, started, time to ready: all filled in
    assert sorted(r[0] for r in seen["table"]) == ["decode-0", "prefill-0"]
    for row in seen["table"]:
        assert len(row) == 8 and all(cell not in ("", "–") for cell in row), row
    assert shot.stat().st_size > 20_000 and shot.read_bytes()[:4] == b"\x89PNG"
    if os.environ.get("DIPTYCH_DASHBOARD_SHOT"):  # a look at the page as it was tested
        shutil.copyfile(shot, os.environ["DIPTYCH_DASHBOARD_SHOT"])


test_the_dashboard_renders_and_updates_in_headless_chromium.async_timeout = 150  # type: ignore[attr-defined]
