"""Killing a prefill worker mid-burst, and 200 concurrent streams with disconnects.

Both run the real `diptych serve` process tree (frontend, decode and prefill workers,
queue, KV transfer) over the simulated engine (`--engine sim`): what they prove is the
fleet's bookkeeping under load (fallbacks, cancellations, every KV block returned), which
the model's arithmetic takes no part in; the real model made the 200 streams take
minutes of CPU. The KV pool is the one the real model had with `--kv-cache-memory 0.25`
(363 blocks), so the 200 streams still contend for blocks and most of them queue.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from benchmarks.servers import scrape
from tests.e2e.serving import Server, idle_metrics

pytestmark = pytest.mark.slow

# remote prefill from 32 uncached tokens, as tests.e2e.conftest.BASE_FLAGS: every prompt
# here goes to the prefill worker
SIM_FLAGS = ("--engine", "sim", "--num-blocks", "363", "--min-remote-prefill-tokens", "32")


def _prompt(i: int) -> str:
    return f"Request {i}: " + " ".join(f"word{j}" for j in range(i, i + 60)) + ". Summary:"


async def _complete(client: httpx.AsyncClient, model: str, i: int, n: int = 12) -> str:
    r = await client.post(
        "/v1/completions",
        json={"model": model, "prompt": _prompt(i), "max_tokens": n, "temperature": 0,
              "ignore_eos": True},
    )  # fmt: skip
    r.raise_for_status()
    body = r.json()
    assert body["usage"]["completion_tokens"] == n
    return str(body["choices"][0]["text"])


@pytest.fixture
def kill_server(tmp_path) -> Iterator[Server]:  # type: ignore[no-untyped-def]
    # Simulated time runs 20x slower than an H100's, so that a batch of prefills is in
    # flight for most of a second; the remote-prefill deadline is in simulated seconds:
    # 0.2 of them are the 4 s of wall time this test has always used.
    s = Server(tmp_path, *SIM_FLAGS, "--time-scale", "0.05", "--remote-prefill-timeout", "0.2")
    yield s
    s.stop()


async def test_sigkill_prefill_worker_during_a_burst(kill_server: Server) -> None:
    server = kill_server
    model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    pid = server.manifest["prefill-0"]["pid"]

    async def burst() -> list[str]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            tasks = [asyncio.create_task(_complete(c, model, i)) for i in range(24)]
            # kill once some prefills are in flight on the worker and more are queued
            # behind them: what it holds is lost with it
            while True:
                assert not all(t.done() for t in tasks), "the burst ended before the kill"
                waiting = (await asyncio.to_thread(server.metrics, "decode-0"))[
                    "diptych_worker_remote_waiting_requests"
                ]
                held = (await asyncio.to_thread(server.metrics, "prefill-0"))[
                    "diptych_worker_prefills_in_flight"
                ]
                if held >= 1 and waiting > held:
                    break
                await asyncio.sleep(0.02)
            os.kill(pid, signal.SIGKILL)
            return await asyncio.gather(*tasks)

    texts = await burst()
    assert len(texts) == 24 and all(texts)
    m = idle_metrics(server, timeout=60)
    assert m["diptych_worker_kv_usage"] == 0, m
    assert m["diptych_worker_kv_used_blocks"] == 0, m
    assert m["diptych_worker_remote_waiting_requests"] == 0
    # some prefills were lost with the worker and fell back to local prefill
    fallback = sum(
        m.get(f'diptych_worker_remote_prefills_finished_total{{result="{r}"}}', 0)
        for r in ("timeout", "dead_letter", "refused")
    )
    assert fallback >= 1, m

    # and later requests no longer try the dead pool
    async def after() -> str:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            return await _complete(c, model, 99)

    assert await after()


@pytest.fixture(scope="module")
def streams_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # 5x slower than an H100's time: the 200 streams are all in the decode worker at
    # once (running, queued for blocks or waiting for their remote prefill)
    s = Server(tmp_path_factory.mktemp("serve"), *SIM_FLAGS, "--time-scale", "0.2")
    yield s
    assert s.stop() == 0, "".join(s.log[-30:])


async def test_200_concurrent_streams_some_disconnecting(streams_server: Server) -> None:
    server = streams_server
    model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]

    async def stream(c: httpx.AsyncClient, i: int) -> tuple[str, int]:
        drop = i % 5 == 0  # every fifth client goes away mid-stream
        body = {"model": model, "prompt": _prompt(i % 40), "max_tokens": 24,
                "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
        n = 0
        async with c.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return "status", r.status_code
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return "done", n
                if '"error"' in line:
                    return "error", n
                n += 1
                if drop and n == 3:
                    return "dropped", n
        return "eof", n

    async def run() -> list[tuple[str, int]]:
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits) as c:
            return await asyncio.wait_for(
                asyncio.gather(*(stream(c, i) for i in range(200))), timeout=600
            )

    results = await run()
    kinds = [k for k, _ in results]
    assert kinds.count("dropped") == 40
    assert kinds.count("done") == 160, [r for r in results if r[0] not in ("done", "dropped")]
    m = idle_metrics(server, timeout=60)
    assert m["diptych_worker_kv_usage"] == 0 and m["diptych_worker_running_requests"] == 0, m
    assert m["diptych_worker_kv_used_blocks"] == 0, m
    assert server.metrics("prefill-0")["diptych_worker_kv_used_blocks"] == 0
    # every client that went away was seen going: its request was cancelled, not run out
    end = time.monotonic() + 30
    while (gone := scrape(server.url)["diptych_frontend_client_disconnects_total"]) < 40:
        assert time.monotonic() < end, f"{gone} of the 40 disconnects seen"
        await asyncio.sleep(0.1)


# the burst waits out remote-prefill deadlines (4 s)
test_sigkill_prefill_worker_during_a_burst.async_timeout = 300  # type: ignore[attr-defined]
test_200_concurrent_streams_some_disconnecting.async_timeout = 660  # type: ignore[attr-defined]
