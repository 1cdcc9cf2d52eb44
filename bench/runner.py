"""Drives a workload against a sender: arrivals, a concurrency cap, sessions, warm-up.

Each chain (a lone request, or the turns of one session) starts at its arrival
offset; a session's later turns follow their predecessor's end plus think time. With
`max_concurrency`, a request that arrives while that many are in flight waits for a
slot: its `start_time` is when it is sent and `queue_time` how long it waited, so
latencies exclude the client's queue (as in vLLM) and `queue_time` reports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from bench.arrivals import arrival_times
from bench.metrics import RequestResult
from bench.progress import Progress
from bench.request import Request, chains

Send = Callable[[Request], Awaitable[RequestResult]]


@dataclass
class RunOutput:
    results: list[RequestResult]  # in the workload's order
    duration: float  # seconds from the first arrival slot to the last response


async def run_load(
    requests: Sequence[Request],
    send: Send,
    *,
    rate: float = float("inf"),
    burstiness: float = 1.0,
    seed: int = 0,
    max_concurrency: int | None = None,
    progress: Progress | None = None,
    time_scale: float = 1.0,
) -> RunOutput:
    """Send `requests` at `rate`; with `time_scale` s > 1 (a server whose simulated
    time runs s times faster than the wall) arrivals and think times are in simulated
    seconds, sent s times sooner, and every measured duration is reported x s."""
    groups = chains(list(requests))
    offsets = [o / time_scale for o in arrival_times(len(groups), rate, burstiness, seed)]
    slots: asyncio.Semaphore | None = (
        asyncio.Semaphore(max_concurrency) if max_concurrency else None
    )
    results: list[RequestResult | None] = [None] * len(requests)
    t0 = time.perf_counter()

    async def run_chain(chain: list[int], offset: float) -> None:
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        for k, i in enumerate(chain):
            req = requests[i]
            if k and req.think_time > 0:
                await asyncio.sleep(req.think_time / time_scale)
            arrived = time.perf_counter()
            async with slots if slots is not None else contextlib.nullcontext():
                result = await send(req)
            result.queue_time = max(0.0, result.start_time - arrived)
            results[i] = result
            if progress is not None:
                progress.update(result.success)

    await asyncio.gather(*(run_chain(c, o) for c, o in zip(groups, offsets)))
    duration = time.perf_counter() - t0
    if progress is not None:
        progress.close()
    done = [r for r in results if r is not None]
    assert len(done) == len(requests), "every request has a result"
    if time_scale != 1.0:
        for r in done:
            dilate(r, time_scale, t0)
        duration *= time_scale
    return RunOutput(done, duration)


def dilate(result: RequestResult, scale: float, t0: float) -> None:
    """A result measured in wall seconds, in the simulated seconds of a server whose
    time runs `scale` times faster (start times count from `t0`)."""
    result.ttft *= scale
    result.latency *= scale
    result.queue_time *= scale
    result.itl = [gap * scale for gap in result.itl]
    result.start_time = t0 + (result.start_time - t0) * scale


async def warm_up(
    requests: Sequence[Request], send: Send, max_concurrency: int | None
) -> list[RequestResult]:
    """Send warm-up requests (not measured), at most `max_concurrency` at once."""
    slots = asyncio.Semaphore(max_concurrency or max(1, len(requests)))

    async def one(req: Request) -> RequestResult:
        async with slots:
            return await send(req)

    return list(await asyncio.gather(*(one(r) for r in requests)))


async def wait_ready(request: Request, send: Send, timeout_s: float) -> RequestResult:
    """Send `request` until it succeeds or `timeout_s` passes; the last result."""
    end = time.monotonic() + timeout_s
    while True:
        result = await send(request)
        if result.success or time.monotonic() >= end:
            return result
        await asyncio.sleep(min(5.0, max(0.0, end - time.monotonic())))
