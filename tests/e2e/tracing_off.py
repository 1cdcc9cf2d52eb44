"""Serve one streamed disaggregated chat with tracing off, then name the OpenTelemetry
SDK modules this process imported (none, or tracing costs something when off).

    python -m tests.e2e.tracing_off      run by tests/e2e/test_tracing.py in a fresh process

The three roles run here on the embedded control plane with the simulated engine.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import httpx

from engine.config import EngineConfig
from engine.sim.config import SimConfig
from tests.e2e.request_path import in_process_fleet


def _engine() -> EngineConfig:
    return EngineConfig(sim=SimConfig(profile="fixed:5ms", mean_output_tokens=0))


def serve_one(state_dir: Path) -> None:
    with in_process_fleet(state_dir, _engine(), "tracing-off") as fleet:
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": " ".join(f"w{i}" for i in range(100))}],
            "max_tokens": 4,
            "stream": True,
        }
        with httpx.stream(
            "POST", f"http://{fleet.address}/v1/chat/completions", json=body, timeout=60
        ) as r:
            r.raise_for_status()
            assert "[DONE]" in "".join(r.iter_text())
        assert fleet.decode.metrics.remote_finished.labels(result="ok")._value.get() == 1


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        serve_one(Path(d))
    sdk = sorted(m for m in sys.modules if m.startswith("opentelemetry.sdk"))
    print(f"served; opentelemetry.sdk modules: {sdk}")
