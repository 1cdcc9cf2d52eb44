"""The planner process under bad input. An unreadable profile stops it before it starts;
a missing profile, a metrics source that is not there or goes away, a connector that
cannot scale each give a clear log line and a metric, and the process keeps running
and never flaps."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client import start_http_server

from diptych.planner_process import PlannerProcess
from frontend.metrics import FrontendMetrics
from planner.config import PlannerConfig, PlanSettings
from runtime.errors import ConfigError


def _errors(proc: PlannerProcess) -> dict[str, float]:
    assert proc.service is not None
    return {s.labels["kind"]: s.value for s in proc.service.metrics.errors.collect()[0].samples
            if s.name.endswith("_total") and s.value}  # fmt: skip


def _config(tmp_path: Path, frontend: str, **kw: object) -> PlannerConfig:
    plan = PlanSettings(interval_s=0.2, min_prefill=1, min_decode=1)
    return PlannerConfig(plan=plan, frontend_urls=(frontend,), discovery_url=f"embedded:{tmp_path}",
                         port=0, **kw)  # type: ignore[arg-type]  # fmt: skip


async def test_a_profile_named_but_unreadable_stops_the_planner_before_it_starts(
    tmp_path: Path,
) -> None:
    """A typo must not quietly switch the policy: a ConfigError naming the profile,
    raised before discovery, the connector or the dashboard start."""
    bad = tmp_path / "profile.json"
    bad.write_text("{not json")
    for profile in (str(bad), str(tmp_path / "missing.json"), "Z80:Llama-3.1-8B",
                    "H200:Llama-3.1-70B:tp1:float9"):  # fmt: skip
        proc = PlannerProcess(_config(tmp_path, "http://127.0.0.1:9", profile=profile))
        with pytest.raises(ConfigError, match=f"profile {profile!r} is unusable"):
            await proc.start()
        assert proc.service is None and proc._http is None
        await proc.stop()


async def test_no_profile_plans_by_load_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    proc = PlannerProcess(_config(tmp_path, "http://127.0.0.1:9", profile=None))
    with caplog.at_level(logging.WARNING):
        details = await proc.start()
    try:
        assert proc.service is not None and proc.service.planner.policy.name == "load"
        assert _errors(proc) == {"profile": 1.0}
        assert any("needs a worker profile" in r.message and "planning by load" in r.message
                   for r in caplog.records)  # fmt: skip
        async with httpx.AsyncClient(base_url=details["url"]) as http:
            state = (await http.get("/api/state")).json()
            assert state["settings"]["policy"] == "load"
            assert state["events"][0]["kind"] == "profile"
    finally:
        await proc.stop()


async def test_a_frontend_that_goes_away_skips_ticks_logged_once_without_flapping(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    front = FrontendMetrics()
    http_server, _ = start_http_server(0, "127.0.0.1", registry=front.registry)
    url = f"http://127.0.0.1:{http_server.server_port}"
    proc = PlannerProcess(_config(tmp_path, url, profile="H100:Llama-3.1-8B"))
    await proc.start()
    try:
        assert proc.service is not None
        await asyncio.sleep(1.0)  # ticks on an idle fleet
        ticked = len(proc.service.history)
        assert ticked >= 2
        http_server.shutdown()
        http_server.server_close()
        with caplog.at_level(logging.WARNING):
            await asyncio.sleep(1.5)  # ~7 intervals without metrics
        assert len(proc.service.history) <= ticked + 1  # no decisions on half a picture
        assert _errors(proc).get("scrape", 0) >= 5
        lines = [r.message for r in caplog.records if "metrics unreadable" in r.message]
        assert len(lines) == 1  # said once, not every interval
        targets = {t.result.decisions[-1].target for t in proc.service.history}
        assert targets == {1}  # the minimum throughout: nothing flapped
    finally:
        await proc.stop()


@pytest.mark.parametrize("connector", ["kubernetes", "ray"])
def test_a_missing_client_library_says_what_to_install(
    connector: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from diptych.planner_process import make_connector

    monkeypatch.setitem(sys.modules, connector, None)  # as if not installed
    if connector == "ray":
        import importlib.util

        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: None if name == "ray" else real(name, *a))  # fmt: skip
    with pytest.raises(RuntimeError, match=rf"needs {connector}; install it: pip install"):
        make_connector(_config(tmp_path, "http://127.0.0.1:9", connector=connector))


def test_pools_of_different_tp_sizes_are_each_priced_at_their_own() -> None:
    """A roofline without a size is taken at each pool's size: TP 2 prefill workers take
    fewer prompt tokens a second than TP 8 ones would, TP 8 decode workers hold more
    streams than TP 2 ones; a roofline that names its size keeps it for both."""
    from diptych.planner_process import capacity_from_profile, check_profile
    from planner.capacity import PoolCapacity

    spec = "H200:Llama-3.1-70B"
    mixed = capacity_from_profile(spec, 128, None, {"prefill": 2, "decode": 8})
    assert isinstance(mixed, PoolCapacity)
    tp2 = capacity_from_profile(f"{spec}:tp2", 128, None)
    tp8 = capacity_from_profile(f"{spec}:tp8", 128, None)
    args = (0.5, 1000.0)
    assert mixed.prefill_tokens_per_s(*args) == tp2.prefill_tokens_per_s(*args)
    assert mixed.decode_streams(0.05, 2000.0) == tp8.decode_streams(0.05, 2000.0)
    assert tp8.prefill_tokens_per_s(*args) > tp2.prefill_tokens_per_s(*args)
    same = capacity_from_profile(spec, 128, None, {"prefill": 4, "decode": 4})
    assert not isinstance(same, PoolCapacity)
    named = check_profile(f"{spec}:tp8", sizes={"prefill": 2, "decode": 8})
    assert named.prefill_tokens_per_s(*args) == tp8.prefill_tokens_per_s(*args)
