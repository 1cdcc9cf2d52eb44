"""A decode worker killed with SIGKILL leaves KV-aware routing within its discovery lease:
a frontend and two decode workers as separate processes (no launcher to restart the dead
one), the simulated engine, the embedded control plane."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from runtime.discovery import DiscoveryOptions
from tests.e2e.serving import free_port, scrape

pytestmark = pytest.mark.slow

SIM = ("--engine", "sim", "--profile", "H200:Llama-3.1-70B:tp8", "--time-scale", "8")
LEASE_S = DiscoveryOptions().ttl


class Role:
    def __init__(self, *args: str) -> None:
        cmd = [sys.executable, "-m", "diptych.cli", *args]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        self.log: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line)
            if line.startswith("DIPTYCH_READY"):
                self.ready.set()

    def wait_ready(self, timeout: float = 180) -> None:
        if not self.ready.wait(timeout):
            raise RuntimeError("role did not start:\n" + "".join(self.log[-30:]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[str, list[Role]]]:
    state = ("--state-dir", str(tmp_path))
    workers = [
        Role("decode", *state, *SIM, "--worker-id", f"decode-{i}", "--no-remote-prefill")
        for i in range(2)
    ]
    port = free_port()
    roles = [*workers, Role("frontend", *state, "--port", str(port))]
    try:
        for r in roles:
            r.wait_ready()
        yield f"http://127.0.0.1:{port}", workers
    finally:
        for r in roles:
            r.stop()


def metrics(url: str) -> dict[str, float]:
    return scrape(url)


def test_killed_worker_leaves_routing_within_its_lease(fleet: tuple[str, list[Role]]) -> None:
    url, workers = fleet
    end = time.monotonic() + 30
    while metrics(url).get("diptych_frontend_decode_workers", 0) < 2:
        assert time.monotonic() < end, "the frontend did not see both workers"
        time.sleep(0.1)
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    for i in range(8):  # both workers cache prompts: the index holds blocks of each
        prompt = f"Conversation {i}: " + " ".join(f"w{i}x{j}" for j in range(120))
        r = httpx.post(url + "/v1/completions", timeout=60,
                       json={"model": model, "prompt": prompt, "max_tokens": 2})  # fmt: skip
        r.raise_for_status()
    indexed = metrics(url)["diptych_frontend_router_indexed_blocks"]
    assert indexed > 0
    workers[1].proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    while True:
        m = metrics(url)
        if m["diptych_frontend_decode_workers"] == 1:
            gone = time.monotonic() - killed
            break
        assert time.monotonic() - killed < LEASE_S + 5, "the dead worker is still routed to"
        time.sleep(0.1)
    assert gone <= LEASE_S + 1.0, gone
    # its blocks left the index with it, and requests go to the survivor only
    assert m["diptych_frontend_router_indexed_blocks"] < indexed
    for i in range(4):
        r = httpx.post(url + "/v1/completions", timeout=60,
                       json={"model": model, "prompt": f"after {i}", "max_tokens": 2})  # fmt: skip
        assert r.status_code == 200
    assert metrics(url).get('diptych_frontend_failovers_total{kind="retry"}', 0) == 0
