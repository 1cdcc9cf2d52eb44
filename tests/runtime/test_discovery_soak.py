"""A live worker never flaps: six lease TTLs of keepalives under event-loop stalls, on
both backends at once.

The production lease (10 s, a keepalive every third of it) is scaled down to 3 s, and
with it everything timed against it: the keepalive stays at a third of the TTL (the
default), the stalls at 15 % of it every 60 % of it, and the soak at six TTLs. What the
soak proves depends on those ratios, not on seconds: a keepalive delayed by a stall
still lands with two thirds of the lease to spare, and the worker is never seen
leaving, re-registering or unhealthy.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from runtime.discovery import EventKind
from tests.runtime.rt_helpers import Watcher, discovery, worker

PRODUCTION_TTL = 10.0
TTL = 3.0  # etcd's shortest is 2 s; 3 s keeps a loaded machine's scheduling noise small
SCALE = TTL / PRODUCTION_TTL
SOAK_S = 60.0 * SCALE  # six TTLs, as 60 s were of the production TTL
STALL_S, STALL_EVERY_S = 1.5 * SCALE, 6.0 * SCALE  # a long synchronous engine step
CHECK_EVERY_S = 1.0 * SCALE


async def soak(url: str, namespace: str) -> None:
    async with (
        discovery(url, namespace, TTL) as worker_side,
        discovery(url, namespace, TTL) as router_side,
    ):
        assert worker_side.options.interval == TTL / 3  # the production ratio
        reg = await worker_side.register(worker("steady"))
        watcher = Watcher(router_side)
        await watcher.wait_for(EventKind.JOIN, "steady")
        end = time.monotonic() + SOAK_S
        while time.monotonic() < end:
            assert [w.worker_id for w in await router_side.list("decode")] == ["steady"]
            assert reg.healthy
            await asyncio.sleep(CHECK_EVERY_S)
        await watcher.stop()
        assert watcher.kinds() == [(EventKind.JOIN, "steady")], "the worker flapped"
        assert reg.reregistrations == 0 and not reg.superseded


async def stalls() -> None:
    """Block the event loop now and then, as a long synchronous engine step would."""
    while True:
        await asyncio.sleep(STALL_EVERY_S)
        time.sleep(STALL_S)


@pytest.mark.slow
async def test_live_worker_never_flaps(etcd_server, tmp_path: Path, namespace: str) -> None:  # type: ignore[no-untyped-def]
    stalling = asyncio.create_task(stalls())
    try:
        await asyncio.gather(
            soak(etcd_server.url, namespace), soak(f"embedded:{tmp_path}", namespace)
        )
    finally:
        stalling.cancel()


test_live_worker_never_flaps.async_timeout = SOAK_S + 60  # type: ignore[attr-defined]
