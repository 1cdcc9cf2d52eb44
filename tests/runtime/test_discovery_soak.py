"""A live worker never flaps: 60 s with the production TTL, on both backends at once."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from runtime.discovery import EventKind
from tests.runtime.rt_helpers import Watcher, discovery, worker

SOAK_S = 60.0
PRODUCTION_TTL = 10.0


async def soak(url: str, namespace: str) -> None:
    async with (
        discovery(url, namespace, PRODUCTION_TTL) as worker_side,
        discovery(url, namespace, PRODUCTION_TTL) as router_side,
    ):
        reg = await worker_side.register(worker("steady"))
        watcher = Watcher(router_side)
        await watcher.wait_for(EventKind.JOIN, "steady")
        end = time.monotonic() + SOAK_S
        while time.monotonic() < end:
            assert [w.worker_id for w in await router_side.list("decode")] == ["steady"]
            assert reg.healthy
            await asyncio.sleep(1.0)
        await watcher.stop()
        assert watcher.kinds() == [(EventKind.JOIN, "steady")], "the worker flapped"
        assert reg.reregistrations == 0 and not reg.superseded


async def stalls() -> None:
    """Block the event loop now and then, as a long synchronous engine step would."""
    while True:
        await asyncio.sleep(6.0)
        time.sleep(1.5)


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
