"""Decode workers killed one after another under streaming load, down to one: every
stream ends complete or with a clear error event, none hangs. `diptych serve` over the
simulated engine, three decode workers, SIGKILL to two of them a second apart (serve
restarts them, later)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.serving import Server, scrape

pytestmark = pytest.mark.slow

STREAMS = 6
MAX_TOKENS = 150


@pytest.fixture
def trio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(
        tmp_path_factory.mktemp("trio"),
        "--engine", "sim", "--profile", "H200:Llama-3.1-70B:tp8", "--time-scale", "1",
        "--prefill-workers", "0", "--decode-workers", "3",
    )  # fmt: skip
    yield server
    assert server.stop() == 0


def test_killing_all_decode_workers_but_one_ends_every_stream(trio: Server) -> None:
    model = httpx.get(trio.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    outcomes: list[tuple[str, int]] = []  # ("done" | "error: ..." | "cut", tokens)
    lock = threading.Lock()
    streaming = threading.Semaphore(0)

    def stream(i: int) -> None:
        body = {
            "model": model, "prompt": f"story {i} " + "once " * 40, "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
        }  # fmt: skip
        outcome, tokens, first = "cut", 0, True
        with httpx.Client(timeout=120) as c, c.stream(
            "POST", trio.url + "/v1/completions", json=body
        ) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if first:
                    streaming.release()
                    first = False
                if line == "data: [DONE]":
                    outcome = "done" if outcome == "cut" else outcome
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    outcome = f"error: {event['error'].get('message', '')}"
                elif event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
        with lock:
            outcomes.append((outcome, tokens))

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    for _ in range(STREAMS):
        assert streaming.acquire(timeout=60)
    for victim in ("decode-0", "decode-1"):
        os.kill(trio.manifest[victim]["pid"], signal.SIGKILL)
        time.sleep(1.0)
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a stream hung"
    assert len(outcomes) == STREAMS
    for outcome, tokens in outcomes:
        assert (outcome == "done" and tokens == MAX_TOKENS) or outcome.startswith("error: ")
    assert sum(o == "done" for o, _ in outcomes) >= STREAMS - 1, outcomes
    front = scrape(trio.url)
    assert front['diptych_frontend_failovers_total{kind="migration"}'] >= 2
