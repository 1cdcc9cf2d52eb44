"""The planner's loop: real HTTP metrics endpoints found through the real embedded
discovery, a recording connector, and the failures it must ride out."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import start_http_server

from decode_worker.metrics import DecodeMetrics
from frontend.metrics import FrontendMetrics
from planner import Limits, LoadPolicy, Planner, PoolLimits
from planner.connectors import RecordingConnector
from planner.observation import Slo
from planner.service import PlannerService
from planner.source import MetricsSource, Round, ScrapeError
from runtime.discovery import DiscoveryOptions, EmbeddedDiscovery
from runtime.worker_info import WorkerInfo


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _planner() -> Planner:
    limits = Limits(PoolLimits(1, 4), PoolLimits(1, 4), up_cooldown_s=0, down_cooldown_s=0)
    return Planner(LoadPolicy(), limits)


def _serve(metrics: object) -> tuple[str, object]:
    registry = metrics.registry  # type: ignore[attr-defined]
    server, _ = start_http_server(0, "127.0.0.1", registry=registry)
    return f"127.0.0.1:{server.server_port}", server


async def test_scrape_through_discovery_then_scale(tmp_path: Path) -> None:
    front, dec = FrontendMetrics(), DecodeMetrics()
    front_addr, s1 = _serve(front)
    dec_addr, s2 = _serve(dec)
    try:
        async with EmbeddedDiscovery(tmp_path, DiscoveryOptions(ttl=5)) as discovery:
            await _scrape_and_scale(discovery, front, dec, front_addr, dec_addr)
    finally:
        s1.shutdown()  # type: ignore[attr-defined]
        s2.shutdown()  # type: ignore[attr-defined]


async def _scrape_and_scale(
    discovery: EmbeddedDiscovery, front: FrontendMetrics, dec: DecodeMetrics,
    front_addr: str, dec_addr: str,
) -> None:  # fmt: skip
    info = WorkerInfo("decode-0", "decode", "m", metrics_address=dec_addr)
    reg = await discovery.register(info)
    source = MetricsSource(discovery, [f"http://{front_addr}"])
    clock, connector = Clock(), RecordingConnector()
    svc = PlannerService(_planner(), source, connector, interval_s=10, clock=clock)
    assert await svc.tick_once() is None  # the baseline round
    dec.kv_used_blocks.set(90)
    dec.kv_total_blocks.set(100)  # KV 90 % full: decode grows
    for _ in range(10):
        front.arrivals.inc()
        front.e2e.observe(1.0)
    clock.t = 10.0
    result = await svc.tick_once()
    assert result is not None
    assert result.observation.request_rate == pytest.approx(1.0)
    assert result.observation.ready == {"prefill": 0, "decode": 1}
    assert connector.targets == {"prefill": 1, "decode": 2}
    await reg.close()
    await source.close()


class Flaky:
    """Rounds of an idle fleet; fails when told to."""

    def __init__(self) -> None:
        self.fail = False
        self.front = FrontendMetrics()

    async def scrape(self) -> Round:
        if self.fail:
            raise ScrapeError("frontend metrics at http://x unreadable")
        from prometheus_client import generate_latest

        from planner.scrape import Snapshot

        return Round(Snapshot.parse(generate_latest(self.front.registry).decode()))


class Broken(RecordingConnector):
    async def scale(self, pool: str, replicas: int) -> None:
        await super().scale(pool, replicas)
        raise RuntimeError("the API server said no")


async def test_a_source_that_disappears_and_a_connector_that_fails_are_ridden_out() -> None:
    source, connector, clock = Flaky(), Broken(), Clock()
    svc = PlannerService(_planner(), source, connector, interval_s=10, clock=clock)
    await svc.tick_once()
    source.fail = True
    clock.t = 10
    assert await svc.tick_once() is None  # skipped, not acted on
    source.fail = False
    clock.t = 20
    assert await svc.tick_once() is not None
    clock.t = 30
    assert await svc.tick_once() is not None
    errors = {s.labels["kind"]: s.value for s in svc.metrics.errors.collect()[0].samples
              if s.name.endswith("_total") and s.value}  # fmt: skip
    assert errors == {"scrape": 1.0, "scale": 4.0}  # two pools x two ticks
    assert connector.calls[-2:] == [("prefill", 1), ("decode", 1)]  # asked again each tick


async def test_the_loop_keeps_ticking_on_a_scaled_clock() -> None:
    source, connector = Flaky(), RecordingConnector()
    svc = PlannerService(_planner(), source, connector, interval_s=10, time_scale=1000)
    task = asyncio.create_task(svc.run())
    await asyncio.sleep(0.1)  # ~10 ticks of 10 simulated seconds
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(svc.history) >= 3


async def test_the_first_tick_keeps_the_sizes_the_connector_runs_and_logs_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """2P2D launched (workers still starting: none ready), an idle first interval whose
    policy would shrink: the planner starts from 2 and 2, and logs its first decisions."""
    source, connector, clock = Flaky(), RecordingConnector(), Clock()
    connector.targets = {"prefill": 2, "decode": 2}
    svc = PlannerService(_planner(), source, connector, interval_s=10, clock=clock)
    await svc.tick_once()
    clock.t = 10
    with caplog.at_level("INFO", logger="planner.service"):
        result = await svc.tick_once()
    assert result is not None and result.observation.ready == {"prefill": 0, "decode": 0}
    assert connector.calls == [("prefill", 2), ("decode", 2)]
    first = [e.text for e in svc.events if e.kind == "decision"]
    assert len(first) == 2 and all("started from 2 (2 running on recording)" in t for t in first)
    assert sum("started from 2" in r.getMessage() for r in caplog.records) == 2


class Steady(Flaky):
    """One prefill and two decode workers that always answer; requests all within SLO."""

    async def scrape(self) -> Round:
        from prometheus_client import generate_latest

        from planner.scrape import Snapshot

        def snap(m: object) -> Snapshot:
            return Snapshot.parse(generate_latest(m.registry).decode())  # type: ignore[attr-defined]

        self.front.ttft.observe(0.1)
        dec = snap(DecodeMetrics())
        return Round(snap(self.front), {"prefill": {"p0": dec}, "decode": {"d0": dec, "d1": dec}})


async def test_accelerator_hours_add_up_the_ready_workers_and_attainment_uses_the_slo() -> None:
    limits = Limits(PoolLimits(1, 4, cost=1), PoolLimits(1, 4, cost=2))
    clock = Clock()
    svc = PlannerService(Planner(LoadPolicy(), limits), Steady(), None, interval_s=1800,
                         clock=clock, slo=Slo(ttft_s=0.5, itl_s=0.05))  # fmt: skip
    for t in (0, 1800, 3600):  # a baseline, then two half hours of 1 + 2 x 2 accelerators
        clock.t = t
        await svc.tick_once()
    assert [t.accelerator_hours for t in svc.history] == [2.5, 5.0]
    assert svc.history[-1].result.observation.ttft_attainment == 1.0
