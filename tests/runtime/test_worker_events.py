"""Worker events: the publisher's snapshot and fan-out, and the Events stream over gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator

import pytest

from protocol.kv_layout import KvTier
from runtime.rpc import (
    DecodeWorkerClient,
    ErrorCode,
    GenerateError,
    GenerateHandler,
    GenerateRequest,
    HealthReport,
    KvCleared,
    KvEventPublisher,
    KvRemoved,
    KvSnapshot,
    KvStored,
    LoadReport,
    LoadUpdate,
    ServerLimits,
    ServingStatus,
    WorkerEvent,
    WorkerHandler,
)
from tests.runtime.rt_helpers import ScriptedHandler, serve


async def take(
    events: AsyncIterator[WorkerEvent], n: int, timeout: float = 5.0
) -> list[WorkerEvent]:
    return [await asyncio.wait_for(anext(events), timeout) for _ in range(n)]


async def test_subscriber_gets_snapshot_then_every_change_in_order() -> None:
    pub = KvEventPublisher("inc")
    pub.stored([1, 2, 3])
    sub = pub.subscribe()
    snap, load = await take(sub, 2)
    assert snap == KvSnapshot("inc", 1, frozenset({1, 2, 3}))
    assert isinstance(load, LoadUpdate) and load.sequence == 1
    pub.stored([4], parent_hash=3)
    pub.removed([1])
    pub.cleared()
    assert await take(sub, 3) == [
        KvStored("inc", 2, (4,), 3), KvRemoved("inc", 3, (1,)), KvCleared("inc", 4),
    ]  # fmt: skip
    assert pub.cached_hashes() == frozenset()
    await sub.aclose()
    assert pub.num_subscribers == 0


async def test_a_block_stored_again_moves_and_a_snapshot_says_where() -> None:
    """A pool holds one block a hash; a block stored again (restored from a tier, or let
    go of into one) is the same block moving, and one removal ends it. A new subscriber's
    snapshot names the blocks held only under the pool, with their tier."""
    pub = KvEventPublisher("inc")
    pub.publish([("stored", [7, 8]), ("host", [7]), ("disk", [8]), ("stored", [8])])
    sub = pub.subscribe()
    snap = await anext(sub)
    assert isinstance(snap, KvSnapshot) and snap.block_hashes == {7, 8}
    assert snap.lower == {7: KvTier.HOST}
    pub.publish([("removed", [7])])
    assert pub.cached_hashes() == {8}
    event = await anext(sub)
    while not isinstance(event, KvRemoved):
        event = await anext(sub)
    assert event.block_hashes == (7,)
    await sub.aclose()


async def test_slow_subscriber_is_resynced_with_a_snapshot_not_buffered_forever() -> None:
    pub = KvEventPublisher("inc", max_queue=4)
    sub = pub.subscribe()
    await take(sub, 2)  # initial snapshot and load
    for h in range(100):  # the subscriber reads nothing meanwhile
        pub.stored([h])
    [event] = await take(sub, 1)
    assert event == KvSnapshot("inc", 100, frozenset(range(100)))
    pub.removed([5])
    assert await take(sub, 1) == [KvRemoved("inc", 101, (5,))]
    await sub.aclose()


async def test_load_reports_are_coalesced() -> None:
    pub = KvEventPublisher("inc")
    sub = pub.subscribe()
    await take(sub, 2)
    for running in range(50):
        pub.update_load(LoadReport(running_requests=running))
    [event] = await take(sub, 1)
    assert isinstance(event, LoadUpdate) and event.load.running_requests == 49
    with pytest.raises(asyncio.TimeoutError):
        await take(sub, 1, timeout=0.1)
    await sub.aclose()


async def test_publishing_from_an_engine_thread() -> None:
    pub = KvEventPublisher("inc")
    sub = pub.subscribe()
    await take(sub, 2)
    thread = threading.Thread(target=lambda: [pub.stored([h]) for h in range(200)])
    thread.start()
    events = await take(sub, 200)
    thread.join()
    assert [e.sequence for e in events] == list(range(1, 201))
    await sub.aclose()


async def test_events_over_grpc() -> None:
    handler = ScriptedHandler(incarnation="inc-1")
    handler.publisher.stored(range(1, 1051))
    handler.publisher.stored(range(95, 305), tier=KvTier.HOST)  # across three parts
    limits = ServerLimits(snapshot_part_hashes=100)  # the snapshot travels in 11 parts
    async with serve(handler, limits) as (_, client):
        events = client.events("router-test")
        snap, load = await take(events, 2)
        assert snap == KvSnapshot("inc-1", 2, frozenset(range(1, 1051)))
        assert isinstance(snap, KvSnapshot) and snap.lower == dict.fromkeys(range(95, 305), 1)
        assert isinstance(load, LoadUpdate)
        handler.publisher.stored([5000, 5001], parent_hash=1050)
        handler.publisher.removed([1])
        handler.publisher.update_load(LoadReport(running_requests=3, kv_used_blocks=10))
        assert await take(events, 3) == [
            KvStored("inc-1", 3, (5000, 5001), 1050),
            KvRemoved("inc-1", 4, (1,)),
            LoadUpdate("inc-1", 4, LoadReport(running_requests=3, kv_used_blocks=10)),
        ]
        handler.publisher.stored([5000], tier=KvTier.DISK)
        assert await take(events, 1) == [KvStored("inc-1", 5, (5000,), tier=KvTier.DISK)]
        await events.aclose()  # type: ignore[attr-defined]


async def test_resubscribe_after_worker_restart_starts_with_a_fresh_snapshot() -> None:
    first = ScriptedHandler(incarnation="inc-1")
    first.publisher.stored([1, 2])
    async with serve(first) as (server, client):
        address = server.address
        events = client.events()
        assert (await take(events, 1))[0] == KvSnapshot("inc-1", 1, frozenset({1, 2}))
        await take(events, 1)
        await server.stop(grace=0)  # the worker dies; a new incarnation starts on the port
        second = ScriptedHandler(incarnation="inc-2")
        second.publisher.stored([9])
        async with serve(second, address=address):
            got = await take(events, 1, timeout=10.0)
            assert got == [KvSnapshot("inc-2", 1, frozenset({9}))]
        await events.aclose()  # type: ignore[attr-defined]


class NoEvents(GenerateHandler):
    def generate(self, request):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    async def health(self) -> HealthReport:
        return HealthReport(ServingStatus.SERVING)


async def test_events_refusals_are_clear() -> None:
    async with serve(NoEvents()) as (_, client):
        with pytest.raises(GenerateError) as err:
            await anext(client.events())
        assert err.value.code is ErrorCode.UNIMPLEMENTED
    limits = ServerLimits(max_event_subscribers=1)
    async with serve(ScriptedHandler(), limits) as (server, client):
        first = client.events()
        await take(first, 1)
        async with DecodeWorkerClient(server.address) as other:
            with pytest.raises(GenerateError, match="event subscribers") as err:
                await anext(other.events())
            assert err.value.code is ErrorCode.RESOURCE_EXHAUSTED
        with contextlib.suppress(Exception):
            await first.aclose()  # type: ignore[attr-defined]


class EventsOnly(WorkerHandler):
    """A prefill worker's handler: health and events, no request plane."""

    async def health(self) -> HealthReport:
        return HealthReport(ServingStatus.SERVING, "prefill-0")


async def test_a_worker_without_a_request_plane_has_no_generate() -> None:
    async with serve(EventsOnly()) as (_, client):
        assert (await client.health()).worker_id == "prefill-0"
        with pytest.raises(GenerateError) as err:
            await anext(aiter(client.generate(GenerateRequest("r", (1, 2)))))
        assert err.value.code is ErrorCode.UNIMPLEMENTED and not err.value.retryable
