"""Scale to zero and back: `diptych serve --planner load --min-decode 0` on the simulated
engine. Idle, the planner takes the decode pool to zero; the next request is held by the
frontend (which stays ready), the planner sees it held and starts a decode worker, and
the request completes: none refused, its time to first token reported."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from tests.conftest import REPORT
from tests.e2e.serving import Server, free_port


def _pools(control: str) -> dict[str, dict[str, int]]:
    doc: dict[str, dict[str, int]] = httpx.get(control + "/pools", timeout=5).json()
    return doc


def _until(check: object, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


def test_idle_to_zero_then_the_first_request_brings_a_worker_back(tmp_path: Path) -> None:
    planner_port = free_port()
    server = Server(
        tmp_path,
        "--engine", "sim", "--profile", "fixed:20ms", "--sim-mean-output-tokens", "0",
        "--prefill-workers", "0", "--decode-workers", "1", "--drain-timeout", "5",
        "--planner", "load", "--planner-port", str(planner_port), "--planner-interval", "0.5",
        "--min-prefill", "0", "--max-prefill", "0", "--min-decode", "0",
        "--idle-timeout", "2", "--down-cooldown", "0", "--up-cooldown", "600",
    )  # fmt: skip
    try:
        control = server.manifest["control"]
        _until(lambda: _pools(control)["decode"]["running"] == 0, 90, "the idle pool at zero")
        assert httpx.get(server.url + "/ready", timeout=5).status_code == 200  # still ready
        body = {"model": "Llama-3.1-8B", "prompt": "hello there", "max_tokens": 8,
                "temperature": 0, "stream": True}  # fmt: skip
        started, first = time.monotonic(), None
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=300) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: {") and first is None:
                    first = time.monotonic() - started
        assert first is not None
        REPORT["scale from zero: first request's TTFT"] = f"{first:.1f} s (a worker's start)"
        assert _pools(control)["decode"]["running"] == 1
        state = httpx.get(f"http://127.0.0.1:{planner_port}/api/state", timeout=5).json()
        decisions = [e["text"] for e in state["events"] if e["kind"] == "decision"]
        assert any(t.startswith("1 -> 0") for t in decisions), decisions
        assert any(t.startswith("0 -> 1: requests held with no decode worker (1): one, now")
                   for t in decisions), decisions  # fmt: skip
        metrics = httpx.get(server.url + "/metrics", timeout=5).text
        ok = 'diptych_frontend_requests_total{endpoint="/v1/completions",status="200"} 1.0'
        assert ok in metrics and "status=\"503\"" not in metrics
    finally:
        assert server.stop() == 0
