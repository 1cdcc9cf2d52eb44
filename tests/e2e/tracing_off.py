"""Serve one streamed disaggregated chat with tracing off, then name the OpenTelemetry
SDK modules this process imported (none, or tracing costs something when off).

    python -m tests.e2e.tracing_off      run by tests/e2e/test_tracing.py in a fresh process

The three roles run here on the embedded control plane with the simulated engine.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

from decode_worker.config import DecodeWorkerConfig
from decode_worker.worker import DecodeWorker
from engine.config import EngineConfig
from engine.sim.config import SimConfig
from frontend.config import FrontendConfig
from frontend.server import FrontendServer
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.worker import PrefillWorker
from tests.e2e.request_path import _wait_for_peers
from tests.loop_thread import LoopThread


def _engine() -> EngineConfig:
    return EngineConfig(sim=SimConfig(profile="fixed:5ms", mean_output_tokens=0))


def serve_one(state_dir: Path) -> None:
    loop = LoopThread("tracing-off", timeout=120)
    url = f"embedded:{state_dir}"
    common: dict[str, Any] = {"discovery_url": url, "queue_url": url, "metrics_port": None}
    decode = DecodeWorker(
        DecodeWorkerConfig(engine=_engine(), min_remote_prefill_tokens=16, **common)
    )
    prefill = PrefillWorker(PrefillWorkerConfig(engine=_engine(), **common))
    front = FrontendServer(
        FrontendConfig(discovery_url=url, host="127.0.0.1", port=0, served_model_name="m")
    )
    try:
        loop.run(decode.start())
        loop.run(prefill.start())
        address = loop.run(front.start())
        _wait_for_peers(loop, decode, prefill)
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": " ".join(f"w{i}" for i in range(100))}],
            "max_tokens": 4,
            "stream": True,
        }
        with httpx.stream(
            "POST", f"http://{address}/v1/chat/completions", json=body, timeout=60
        ) as r:
            r.raise_for_status()
            assert "[DONE]" in "".join(r.iter_text())
        assert decode.metrics.remote_finished.labels(result="ok")._value.get() == 1
    finally:
        for stop in (front.stop, prefill.stop, decode.stop):
            loop.run(stop())
        loop.close()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        serve_one(Path(d))
    sdk = sorted(m for m in sys.modules if m.startswith("opentelemetry.sdk"))
    print(f"served; opentelemetry.sdk modules: {sdk}")
