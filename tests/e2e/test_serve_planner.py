"""`diptych serve --planner --engine sim`: the planner child, its dashboard and
metrics, and the launcher's pools scaled through the local connector's endpoint,
with streams running across every scale-down (none may fail or be cut short).

The planner runs in dry-run mode here so the test, not the policy, drives the pools
(benchmarks/planner_live.py shows the policy driving them under load).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.serving import Server, free_port

pytestmark = pytest.mark.slow

PROMPT = " ".join(f"word{i}" for i in range(200))  # remote prefill (over 128 tokens)


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> Any:
    port = free_port()
    server = Server(
        tmp_path_factory.mktemp("serve-planner"),
        "--engine", "sim", "--profile", "fixed:20ms", "--sim-mean-output-tokens", "0",
        "--prefill-workers", "1", "--decode-workers", "1", "--drain-timeout", "30",
        "--planner", "--dry-run", "--planner-interval", "1", "--planner-port", str(port),
    )  # fmt: skip
    yield server, f"http://127.0.0.1:{port}"
    assert server.stop() == 0


def _pools(control: str) -> dict[str, Any]:
    doc: dict[str, Any] = httpx.get(control + "/pools", timeout=5).json()
    return doc


def _until(check: Any, timeout: float, what: str) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = check()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


async def _stream(client: httpx.AsyncClient, n: int) -> tuple[int, str | None]:
    body = {"model": "Llama-3.1-8B", "prompt": PROMPT, "max_tokens": n, "stream": True,
            "temperature": 0, "stream_options": {"include_usage": True}}  # fmt: skip
    tokens, finish = 0, None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            doc = json.loads(line[6:])
            if doc.get("usage"):
                tokens = doc["usage"]["completion_tokens"]
            for choice in doc.get("choices", []):
                finish = choice.get("finish_reason") or finish
    return tokens, finish


async def _streams_while(url: str, action: Any, count: int, n: int) -> list[tuple[int, Any]]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        tasks = [asyncio.create_task(_stream(client, n)) for _ in range(count)]
        await asyncio.sleep(1.0)  # every stream is under way
        await asyncio.to_thread(action)
        return await asyncio.gather(*tasks)


def test_scale_up_then_down_under_running_streams_fails_nothing(planned: Any) -> None:
    server, _ = planned
    control = server.manifest["control"]
    assert {p: s["running"] for p, s in _pools(control).items()} == {"prefill": 1, "decode": 1}
    httpx.put(control + "/pools/decode", json={"replicas": 2}, timeout=5).raise_for_status()
    httpx.put(control + "/pools/prefill", json={"replicas": 2}, timeout=5).raise_for_status()
    _until(lambda: all(s["ready"] == 2 for s in _pools(control).values()), 120, "2 + 2 ready")
    assert {"decode-1", "prefill-1"} <= set(server.manifest)

    def scale_down() -> None:
        for pool in ("decode", "prefill"):
            r = httpx.put(control + f"/pools/{pool}", json={"replicas": 1}, timeout=5)
            r.raise_for_status()

    # 16 streams of 150 tokens at 20 ms a step (3 s) over both decode workers; the
    # newest of each pool drains while they run
    results = asyncio.run(_streams_while(server.url, scale_down, 16, 150))
    assert results == [(150, "length")] * 16

    def drained() -> bool:
        return all(s["running"] == 1 and len(s["workers"]) == 1 for s in _pools(control).values())

    _until(drained, 60, "the drained workers gone")
    log = "".join(server.log)
    assert "draining decode-1 (scale-down)" in log and "decode-1 drained and stopped" in log
    assert "draining prefill-1 (scale-down)" in log
    # a bad request to the endpoint is refused with the reason, nothing changes
    bad = httpx.put(control + "/pools/decode", json={"replicas": -1}, timeout=5)
    assert bad.status_code == 400 and "decode replicas must be in" in bad.json()["error"]
    assert httpx.put(control + "/pools/gpu", json={"replicas": 1}, timeout=5).status_code == 400


def test_the_planner_child_serves_its_dashboard_state_and_metrics(planned: Any) -> None:
    server, planner = planned
    assert "Planner (sla policy): http://" in "".join(server.log)
    doc = _until(lambda: httpx.get(planner + "/api/state", timeout=5).json()["ticks"], 30,
                 "planner ticks")  # fmt: skip
    assert doc[-1]["ready_decode"] >= 1
    state = httpx.get(planner + "/api/state", timeout=5).json()
    assert state["settings"]["dry_run"] is True and state["connector"] == "local"
    # fixed:20ms is a timing the SLA policy can size with: no fallback to the load policy
    assert state["settings"]["policy"] == "sla"
    metrics = httpx.get(planner + "/metrics", timeout=5).text
    assert 'diptych_planner_ready_replicas{pool="decode"}' in metrics
    assert httpx.get(planner + "/dashboard", timeout=5).status_code == 200
    assert "planner" in server.manifest


def test_a_killed_planner_is_restarted_and_keeps_serving(planned: Any, tmp_path: Path) -> None:
    server, planner = planned
    import os
    import signal

    pid = int(server.manifest["planner"]["pid"])
    os.kill(pid, signal.SIGKILL)
    _until(lambda: int(server.manifest["planner"]["pid"]) != pid, 60, "a new planner")
    _until(lambda: _ok(planner + "/health"), 60, "the new planner's health")


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
