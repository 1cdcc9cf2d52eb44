"""Lost and reordered KV events never leave the router's index wrong for longer than one
dump. A worker's real event publisher and gRPC server, with a fault injector between
them that drops, reorders and duplicates KV events on purpose; the frontend's real
client follows the stream into a KvRouter, as the worker pool does."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

from frontend.config import KvRouterConfig
from frontend.router import KvRouter
from runtime.rpc import (
    DecodeWorkerClient,
    DecodeWorkerServer,
    GenerateChunk,
    GenerateHandler,
    GenerateRequest,
    HealthReport,
    KvEventPublisher,
    KvSnapshot,
    LoadReport,
    LoadUpdate,
    ServingStatus,
    WorkerEvent,
)
from runtime.worker_info import WorkerInfo

WORKER = "decode-0"


class FaultyEvents(GenerateHandler):
    """Serves the publisher's stream with faults: each KV event is dropped, held back
    behind the next event, or sent twice, with the given probabilities."""

    def __init__(self, publisher: KvEventPublisher, seed: int, p: float) -> None:
        self.publisher = publisher
        self.rng = random.Random(seed)
        self.p = p
        self.subscriptions = 0
        self.faults = {"drop": 0, "reorder": 0, "duplicate": 0}

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        raise NotImplementedError
        yield GenerateChunk()  # pragma: no cover

    async def health(self) -> HealthReport:
        return HealthReport(ServingStatus.SERVING, WORKER, self.publisher.incarnation_id)

    async def events(self) -> AsyncIterator[WorkerEvent]:
        self.subscriptions += 1
        held: WorkerEvent | None = None
        async for event in self.publisher.subscribe():
            if not isinstance(event, (KvSnapshot, LoadUpdate)):
                r = self.rng.random()
                if r < self.p:
                    self.faults["drop"] += 1
                    continue
                if r < 2 * self.p and held is None:
                    self.faults["reorder"] += 1
                    held = event
                    continue
                if r < 3 * self.p:
                    self.faults["duplicate"] += 1
                    yield event
            yield event
            if held is not None:
                yield held
                held = None


async def scenario(ops: int, p: float, seed: int) -> tuple[FaultyEvents, list[int]]:
    publisher = KvEventPublisher("inc-1")
    handler = FaultyEvents(publisher, seed, p)
    server = DecodeWorkerServer(handler)
    await server.start()
    client = DecodeWorkerClient(server.address)
    await client.connect()
    router = KvRouter(KvRouterConfig())
    router.worker_joined(WorkerInfo(WORKER, "decode", "m", grpc_address=server.address))

    async def follow() -> None:  # what WorkerPool._follow_events does
        async for event in client.events(subscriber="test", retry_s=0.05):
            router.on_event(WORKER, event)

    follower = asyncio.create_task(follow())
    while router.loads[WORKER].report is None:  # subscribed: the first snapshot is in
        await asyncio.sleep(0.005)
    rng = random.Random(seed)
    dumps_per_op = []
    try:
        for _ in range(ops):
            before = handler.subscriptions
            held = list(publisher.cached_hashes())
            if held and rng.random() < 0.4:
                publisher.removed(rng.sample(held, rng.randint(1, min(4, len(held)))))
            else:  # an engine caches a hash once (another block with it is not cached)
                free = sorted(set(range(1, 400)) - set(held))
                publisher.stored(rng.sample(free, rng.randint(1, 5)))
            publisher.update_load(LoadReport(running_requests=rng.randrange(4)))  # a step
            for _ in range(300):  # converged: the index holds exactly what the worker holds
                await asyncio.sleep(0.005)
                if router.index.hashes(WORKER) == publisher.cached_hashes():
                    break
            else:
                raise AssertionError("the index did not converge within 1.5 s")
            dumps_per_op.append(handler.subscriptions - before)
    finally:
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
        await client.close()
        await server.stop(0)
    return handler, dumps_per_op


def test_lost_and_reordered_events_are_put_right_by_one_dump() -> None:
    handler, dumps = asyncio.run(scenario(ops=200, p=0.05, seed=3))
    assert all(handler.faults[k] >= 3 for k in handler.faults), handler.faults
    # every change converged, with at most one resubscription (one dump) after a fault,
    # and none without one
    assert max(dumps) == 1
    assert sum(dumps) >= handler.faults["drop"] // 2
    assert handler.subscriptions == 1 + sum(dumps)


def test_without_faults_no_dump_is_needed() -> None:
    handler, dumps = asyncio.run(scenario(ops=60, p=0.0, seed=4))
    assert sum(dumps) == 0 and handler.subscriptions == 1
