"""Helpers shared by the control-plane tests (import them from ``tests.runtime.rt_helpers``)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Callable

from protocol.sampling import SamplingParams
from runtime.config import make_discovery, make_prefill_queue
from runtime.discovery import Discovery, DiscoveryEvent, DiscoveryOptions, EventKind
from runtime.queue import (
    DeadLetter,
    EmbeddedPrefillQueue,
    PrefillQueue,
    QueueOptions,
    RemotePrefillRequest,
)
from runtime.rpc import (
    DecodeWorkerClient,
    DecodeWorkerServer,
    ErrorCode,
    FinishReason,
    GenerateChunk,
    GenerateError,
    GenerateHandler,
    GenerateRequest,
    HealthReport,
    KvEventPublisher,
    LoadReport,
    ServerLimits,
    ServingStatus,
    TokenLogprob,
    TopLogprob,
    Usage,
    WorkerEvent,
    WorkerHandler,
)
from runtime.worker_info import KvLayout, TransferInfo, WorkerInfo


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- discovery ----------------------------------------------------------------------------
TTL = 2.0  # etcd's shortest lease


def worker(worker_id: str, role: str = "decode", **kw: object) -> WorkerInfo:
    # the hash is the engine's to compute (engine.kv_cache.layout); here it is opaque
    layout = KvLayout(
        num_blocks=64, num_layers=2, block_size=16, num_kv_heads=2, head_dim=64, dtype="bfloat16"
    )
    return WorkerInfo(
        worker_id, role, "m", grpc_address="127.0.0.1:5000", metrics_address="127.0.0.1:9000",
        transfer=TransferInfo("tcp", f"agent-{worker_id}", b"\x00meta\xff"), kv_layout=layout,
        **kw,  # type: ignore[arg-type]
    )  # fmt: skip


@contextlib.asynccontextmanager
async def discovery(url: str, namespace: str, ttl: float = TTL) -> AsyncIterator[Discovery]:
    d = make_discovery(url, DiscoveryOptions(namespace=namespace, ttl=ttl, poll_interval=0.02))
    async with d:
        yield d


class Watcher:
    """Collects a watch stream in the background."""

    def __init__(self, d: Discovery, role: str = "decode") -> None:
        self.events: list[tuple[float, DiscoveryEvent]] = []
        self._changed = asyncio.Event()
        self._task = asyncio.create_task(self._run(d, role))

    async def _run(self, d: Discovery, role: str) -> None:
        async for event in d.watch(role):
            self.events.append((time.monotonic(), event))
            self._changed.set()

    def kinds(self) -> list[tuple[EventKind, str]]:
        return [(e.kind, e.worker.worker_id) for _, e in self.events]

    async def wait_for(self, kind: EventKind, worker_id: str, timeout: float = 10.0) -> float:
        end = time.monotonic() + timeout
        while True:
            for t, e in self.events:
                if e.kind == kind and e.worker.worker_id == worker_id:
                    return t
            remaining = end - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no {kind} of {worker_id} within {timeout}s: {self.kinds()}")
            self._changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


# -- prefill queue ------------------------------------------------------------------------
ACK_WAIT = 1.0


def request(
    i: int | str, worker: str = "decode-0", deadline_in: float = 60.0, tokens: int = 8
) -> RemotePrefillRequest:
    return RemotePrefillRequest(
        request_id=f"req-{i}", prompt_token_ids=tuple(range(1, tokens + 1)),
        sampling=SamplingParams(temperature=0.0, seed=7, logprobs=2),
        decode_worker_id=worker, decode_incarnation_id="inc-1", transfer_agent=f"agent-{worker}",
        dst_block_ids=(3,), num_cached_tokens=0, deadline=time.time() + deadline_in,
        kv_layout_hash="abc", cache_salt="salt",
    )  # fmt: skip


@contextlib.asynccontextmanager
async def queue(url: str, namespace: str, **kw: object) -> AsyncIterator[PrefillQueue]:
    opts = {"ack_wait": ACK_WAIT, "max_deliveries": 3, "done_ttl": 60.0, **kw}
    q = make_prefill_queue(url, QueueOptions(namespace=namespace, **opts))  # type: ignore[arg-type]
    async with q:
        yield q


class Letters:
    """Collects one decode worker's dead letters in the background."""

    def __init__(self, q: PrefillQueue, worker: str) -> None:
        self.items: list[DeadLetter] = []
        self._task = asyncio.create_task(self._run(q, worker))

    async def _run(self, q: PrefillQueue, worker: str) -> None:
        async for letter in q.dead_letters(worker):
            self.items.append(letter)

    async def wait(self, n: int = 1, timeout: float = 10.0) -> list[DeadLetter]:
        end = time.monotonic() + timeout
        while len(self.items) < n:
            assert time.monotonic() < end, f"only {len(self.items)} dead letters"
            await asyncio.sleep(0.02)
        return self.items

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


async def inject_raw(q: PrefillQueue, data: bytes) -> None:
    """Put bytes in the queue behind the library's back, as a buggy publisher would."""
    if isinstance(q, EmbeddedPrefillQueue):
        await q._store.write(
            lambda c, now: c.execute(
                "INSERT INTO messages (request_id, payload, published_at, visible_at) "
                "VALUES ('raw', ?, ?, ?)",
                (data, now, now),
            )
        )
    else:
        await q._js.publish(q.subject, data)  # type: ignore[attr-defined]


# -- request plane ------------------------------------------------------------------------
class ScriptedHandler(GenerateHandler):
    """A fake engine: tokens 100, 101, ... ``per_chunk`` at a time, ``delay`` apart.

    ``cache_salt`` selects a misbehaviour: "raise-overloaded", "raise-bug", "no-finish",
    "bad-chunk", "hang" (waits forever before the first token)."""

    def __init__(self, delay: float = 0.0, per_chunk: int = 1, incarnation: str = "inc-1") -> None:
        self.delay = delay
        self.per_chunk = per_chunk
        self.running: set[str] = set()
        self.closed: list[str] = []
        self.aborted: list[str] = []
        self.publisher = KvEventPublisher(incarnation)
        self.health_error: Exception | None = None

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        self.running.add(request.request_id)
        try:
            script = request.cache_salt
            if script == "hang":
                await asyncio.Event().wait()
            n = request.sampling.max_tokens or 4
            for start in range(0, n, self.per_chunk):
                if self.delay:
                    await asyncio.sleep(self.delay)
                if start >= 2 and script == "raise-overloaded":
                    raise GenerateError(ErrorCode.RESOURCE_EXHAUSTED, "KV cache full")
                if start >= 2 and script == "raise-bug":
                    raise RuntimeError("index out of range in the sampler")
                if script == "bad-chunk":
                    yield "not a chunk"  # type: ignore[misc]
                ids = tuple(100 + i for i in range(start, min(n, start + self.per_chunk)))
                yield GenerateChunk(ids, self._logprobs(request, ids))
            if script != "no-finish":
                cached = min(4, len(request.prompt_token_ids) - 1)
                usage = Usage(len(request.prompt_token_ids), n, cached_tokens=cached)
                yield GenerateChunk(finish_reason=FinishReason.LENGTH, usage=usage)
        finally:
            self.running.discard(request.request_id)
            self.closed.append(request.request_id)

    @staticmethod
    def _logprobs(request: GenerateRequest, ids: tuple[int, ...]) -> tuple[TokenLogprob, ...]:
        k = request.sampling.logprobs
        if k is None:
            return ()
        return tuple(
            TokenLogprob(t, -0.5, 1, tuple(TopLogprob(t + j, -0.5 - j) for j in range(k)))
            for t in ids
        )

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def health(self) -> HealthReport:
        if self.health_error is not None:
            raise self.health_error
        load = LoadReport(running_requests=len(self.running), kv_total_blocks=64)
        return HealthReport(ServingStatus.SERVING, "w0", self.publisher.incarnation_id, load=load)

    def events(self) -> AsyncIterator[WorkerEvent]:
        return self.publisher.subscribe()


@contextlib.asynccontextmanager
async def serve(
    handler: WorkerHandler, limits: ServerLimits | None = None, address: str = "127.0.0.1:0"
) -> AsyncIterator[tuple[DecodeWorkerServer, DecodeWorkerClient]]:
    server = DecodeWorkerServer(handler, address, limits)
    await server.start()
    client = DecodeWorkerClient(server.address)
    await client.connect()
    try:
        yield server, client
    finally:
        await client.close()
        await server.stop(grace=0)


async def eventually(check: Callable[[], bool], timeout: float = 5.0, what: str = "") -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, f"timed out waiting for {what or check}"
        await asyncio.sleep(0.01)
