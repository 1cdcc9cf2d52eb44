"""A worker's gRPC server: Health and Events over any worker's handler, and Generate and
Abort over a decode worker's.

A decode worker implements :class:`GenerateHandler` on top of its engine and runs it with
:class:`DecodeWorkerServer`; a prefill worker serves a :class:`WorkerHandler` (its events
and health) with the same server, which then has no Generate (a call is UNIMPLEMENTED).
`Servicer` is the protocol between gRPC and the handler: parsing and validation
(malformed or invalid requests get INVALID_ARGUMENT with the reason), the in-flight cap,
duplicate request ids, cancellation, abort, error reporting and the snapshot-splitting
of events. A handler's exception never takes the server down: it ends that one stream
with an INTERNAL error. The limits and their reasons live in ``limits.py``.

The Events stream it serves is at the end: the worker's side (`KvEventPublisher`: the
set of cached blocks and a fan-out to routers) and the subscriber's check that it is in
step (`EventSequencer`).

A worker reports what its prefix cache does (``stored``, ``removed``, ``cleared``; after
each engine step, ``publish`` with what the step stored and evicted) and its load
(``update_load``); each router subscribed over gRPC gets a snapshot, then the changes in
order. These methods are thread-safe, so an engine stepping in a worker thread may call
them directly.

Slow subscribers never grow memory without bound: each has a queue of at most
``max_queue`` events; on overflow the queue is dropped and the subscriber gets a fresh
snapshot instead (it is behind anyway). Load reports are coalesced: a subscriber that has
not read the previous one gets only the latest.

The subscriber's side: a worker numbers its KV events 1, 2, 3... per incarnation; a
snapshot carries the number of the last event it includes and a load report the number
of the last KV event sent before it. So a router can tell, from any event, whether it
missed or reordered one: then what it knows of that worker may be wrong, and only a
fresh snapshot (a dump) puts it right. :class:`EventSequencer` is that check, with no
I/O: the gRPC client uses it to resubscribe, the fleet simulator to ask its simulated
worker for a dump.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio

from protocol.kv_layout import KvTier
from protocol.outcomes import FinishReason
from runtime.errors import InvalidInput
from runtime.proto import diptych_runtime_pb2 as pb
from runtime.rpc import types as wire
from runtime.rpc.auth import server_credentials, server_interceptors
from runtime.rpc.handler import GenerateHandler, WorkerHandler
from runtime.rpc.limits import ServerLimits
from runtime.rpc.types import (
    ErrorCode,
    GenerateChunk,
    GenerateError,
    HealthReport,
    ServingStatus,
    Usage,
)
from runtime.tracing import NO_SPAN, NO_TRACER, Span, Tracer

log = logging.getLogger(__name__)

SERVICE = "diptych.runtime.v1.DecodeWorker"
TRACEPARENT_KEY = "traceparent"  # the W3C trace context in a call's metadata


def _traceparent(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == TRACEPARENT_KEY and isinstance(value, str):
            return value
    return ""


def _usage_attributes(span: Span, usage: Usage | None, produced: int) -> None:
    span.set("diptych.completion_tokens", produced)
    if usage is not None:
        span.set("diptych.cached_tokens", usage.cached_tokens)
        span.set("diptych.remote_prefill", usage.remote_prefill)


@dataclass
class _InFlight:
    task: asyncio.Task[Any] | None
    aborted: bool = False  # Abort RPC received
    in_handler: bool = False  # awaiting the handler (not gRPC's send)
    cut_off: bool = False  # the watchdog interrupted the handler
    watchdog: asyncio.TimerHandle | None = None


class Servicer:
    def __init__(
        self,
        handler: WorkerHandler,
        limits: ServerLimits,
        tracer: Tracer = NO_TRACER,
        worker_id: str | None = None,
    ) -> None:
        self.handler = handler
        # the request plane, where the worker serves one (a decode worker)
        self.generator = handler if isinstance(handler, GenerateHandler) else None
        self.limits = limits
        self.tracer = tracer
        self.worker_id = worker_id
        self.in_flight: dict[str, _InFlight] = {}
        self.subscribers = 0

    async def generate(
        self, data: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        span = NO_SPAN  # the call's, under the caller's; the handler's spans go under it
        if self.tracer.on:
            span = self.tracer.start("generate", _traceparent(context), kind="server")
        refusal: tuple[grpc.StatusCode, str] | None = None
        try:
            req = wire.request_from_bytes(data, span.traceparent)
            refusal = self._refusal(req)
        except InvalidInput as e:
            refusal = (grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if refusal is not None:
            span.error(refusal[1])
            span.end()
            await context.abort(*refusal)
        if span.recording:
            span.set("diptych.request_id", req.request_id)
            span.set("diptych.worker_id", self.worker_id or "")
            span.set("diptych.prompt_tokens", len(req.prompt_token_ids))
        entry = _InFlight(asyncio.current_task())
        self.in_flight[req.request_id] = entry
        stream: AsyncIterator[GenerateChunk] | None = None
        prompt, produced = len(req.prompt_token_ids), 0
        clean = False  # the handler finished the request itself
        usage: Usage | None = None
        try:
            assert self.generator is not None  # Generate is registered only with one
            stream = aiter(self.generator.generate(req))
            while not entry.aborted:
                chunk = await self._next_chunk(stream, entry)
                if chunk is None:
                    break
                msg = self._check_chunk(chunk)
                produced += len(chunk.token_ids)
                clean = chunk.finish_reason is not None
                if clean:
                    usage = chunk.usage or Usage(prompt, produced)
                    if chunk.usage is None:
                        msg.usage.CopyFrom(wire.usage_to_pb(usage))
                yield msg.SerializeToString()
                if clean:
                    break
            if not clean:
                if not entry.aborted:
                    raise GenerateError(
                        ErrorCode.INTERNAL, "the stream ended without a finish reason"
                    )
                final = GenerateChunk(
                    finish_reason=FinishReason.ABORT, usage=Usage(prompt, produced)
                )
                yield wire.chunk_to_pb(final).SerializeToString()
        except GenerateError as e:
            span.error(e.message)
            yield wire.error_to_pb(e.code, e.message, Usage(prompt, produced)).SerializeToString()
        except (asyncio.CancelledError, GeneratorExit):
            # after the finish chunk went out the caller may close the call before this
            # generator resumes (a loaded machine): the request finished, not cancelled
            if not clean:
                span.error("cancelled")
            raise
        except Exception as e:
            log.exception("Generate handler failed for %s", req.request_id)
            text = f"the worker failed on this request: {type(e).__name__}: {e}"
            span.error(text)
            yield wire.error_to_pb(
                ErrorCode.INTERNAL, text, Usage(prompt, produced)
            ).SerializeToString()
        finally:
            if span.recording:
                _usage_attributes(span, usage, produced)
                span.end()
            del self.in_flight[req.request_id]
            if entry.watchdog is not None:
                entry.watchdog.cancel()
            # Whatever the end (error, cancel, disconnect), the engine is told once, unless
            # it finished the request itself or the Abort RPC already told it.
            await self._cleanup(req.request_id, stream, notify=not clean and not entry.aborted)

    def _refusal(self, req: wire.GenerateRequest) -> tuple[grpc.StatusCode, str] | None:
        """Why a well-formed request is refused before it reaches the handler, if it is."""
        if len(req.prompt_token_ids) > self.limits.max_prompt_tokens:
            return (
                grpc.StatusCode.INVALID_ARGUMENT,
                f"prompt of {len(req.prompt_token_ids)} tokens exceeds this worker's "
                f"max_prompt_tokens ({self.limits.max_prompt_tokens})",
            )
        if req.request_id in self.in_flight:
            return (
                grpc.StatusCode.ALREADY_EXISTS,
                f"request {req.request_id!r} is already running",
            )
        return None

    async def _next_chunk(
        self, stream: AsyncIterator[GenerateChunk], entry: _InFlight
    ) -> GenerateChunk | None:
        """The handler's next chunk; None when it ends or is cut off after an ignored abort."""
        entry.in_handler = True
        try:
            return await anext(stream)
        except StopAsyncIteration:
            return None
        except asyncio.CancelledError:
            if not entry.cut_off:
                raise  # the client went away: gRPC cancelled the call
            # Our own watchdog: the handler ignored abort(). Finish the call cleanly.
            task = asyncio.current_task()
            if task is not None and hasattr(task, "uncancel"):
                task.uncancel()
            return None
        finally:
            entry.in_handler = False

    def _cut_off(self, request_id: str) -> None:
        """Abort grace is over: interrupt the handler if it is the one we are waiting on."""
        entry = self.in_flight.get(request_id)
        if entry is None or entry.task is None:
            return
        if entry.in_handler:
            entry.cut_off = True
            entry.task.cancel()
        else:  # blocked sending to a slow client; the loop stops after that send
            entry.watchdog = asyncio.get_running_loop().call_later(
                self.limits.abort_grace_s, self._cut_off, request_id
            )

    def _check_chunk(self, chunk: object) -> pb.GenerateResponse:
        if not isinstance(chunk, GenerateChunk):
            raise GenerateError(ErrorCode.INTERNAL, f"handler yielded {type(chunk).__name__}")
        if chunk.logprobs and len(chunk.logprobs) != len(chunk.token_ids):
            raise GenerateError(ErrorCode.INTERNAL, "handler yielded logprobs not matching tokens")
        if chunk.finish_reason is FinishReason.ERROR:
            raise GenerateError(
                ErrorCode.INTERNAL, "handlers report errors by raising GenerateError"
            )
        return wire.chunk_to_pb(chunk)

    async def _cleanup(
        self, request_id: str, stream: AsyncIterator[GenerateChunk] | None, notify: bool
    ) -> None:
        # Shielded: this runs while the stream's task is being cancelled.
        async def close() -> None:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
            if notify and self.generator is not None:
                try:
                    await self.generator.abort(request_id)
                except Exception:
                    log.exception("handler.abort(%r) failed", request_id)

        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(close())

    async def abort(self, data: bytes, context: grpc.aio.ServicerContext) -> bytes:
        msg = pb.AbortRequest()
        try:
            msg.ParseFromString(data)
        except Exception as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed AbortRequest: {e}")
        entry = self.in_flight.get(msg.request_id)
        if entry is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"no request {msg.request_id!r} is running on this worker",
            )
            return b""  # not reached: abort() raises
        if not entry.aborted and self.generator is not None:
            entry.aborted = True
            await self.generator.abort(msg.request_id)
            # A handler that ignores abort is cut off after the grace period.
            entry.watchdog = asyncio.get_running_loop().call_later(
                self.limits.abort_grace_s, self._cut_off, msg.request_id
            )
        return b""

    async def health(self, data: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            report = await asyncio.wait_for(self.handler.health(), self.limits.health_timeout_s)
        except Exception as e:  # a health check must answer, whatever the handler does
            report = HealthReport(ServingStatus.NOT_SERVING, message=f"health check failed: {e!r}")
        return wire.health_to_pb(report, len(self.in_flight)).SerializeToString()

    async def events(self, data: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        try:
            source = self.handler.events()
        except NotImplementedError:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this worker publishes no events")
        if self.subscribers >= self.limits.max_event_subscribers:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.subscribers} event subscribers already (max_event_subscribers)",
            )
        self.subscribers += 1
        try:
            async for event in source:
                for msg in wire.event_to_pb(event, self.limits.snapshot_part_hashes):
                    yield msg.SerializeToString()
        finally:
            self.subscribers -= 1
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()


__all__ = ["SERVICE", "DecodeWorkerServer", "GenerateHandler", "WorkerHandler"]


def _identity(data: bytes) -> bytes:
    return data


class DecodeWorkerServer:
    """Serve a worker's handler. ``address`` may use port 0; see :attr:`address`.
    ``worker_id`` is the worker's discovery id, which its answers prove (``auth.py``)."""

    def __init__(
        self,
        handler: WorkerHandler,
        address: str = "127.0.0.1:0",
        limits: ServerLimits | None = None,
        worker_id: str | None = None,
        tracer: Tracer = NO_TRACER,
    ) -> None:
        self.limits = limits or ServerLimits()
        self.worker_id = worker_id  # proven in every answer when a secret is set
        self._servicer = Servicer(handler, self.limits, tracer, worker_id)
        self._requested = address
        self._server: grpc.aio.Server | None = None
        self.address = address

    @property
    def requests_in_flight(self) -> int:
        return len(self._servicer.in_flight)

    async def start(self) -> str:
        """Bind and start serving; returns ``host:port`` with the port actually bound."""
        s = self._servicer
        handlers = {
            "Health": grpc.unary_unary_rpc_method_handler(s.health, _identity, _identity),
            "Events": grpc.unary_stream_rpc_method_handler(s.events, _identity, _identity),
        }
        if s.generator is not None:  # the request plane: a decode worker's
            handlers["Generate"] = grpc.unary_stream_rpc_method_handler(
                s.generate, _identity, _identity
            )
            handlers["Abort"] = grpc.unary_unary_rpc_method_handler(s.abort, _identity, _identity)
        server = grpc.aio.server(
            options=self.limits.server_options(),
            maximum_concurrent_rpcs=self.limits.max_concurrent_rpcs,
            interceptors=server_interceptors(self.worker_id),  # the cluster secret, if set
        )
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        try:
            creds = server_credentials()
            if creds is None:
                port = server.add_insecure_port(self._requested)
            else:
                port = server.add_secure_port(self._requested, creds)
        except RuntimeError:
            port = 0
        if port == 0:
            raise OSError(f"cannot bind the gRPC server to {self._requested} (port in use?)")
        await server.start()
        self._server = server
        host = self._requested.rpartition(":")[0]
        self.address = f"{host}:{port}"
        return self.address

    async def stop(self, grace: float | None = 5.0) -> None:
        """Refuse new calls, give running ones ``grace`` seconds, then cancel them."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace)

    async def wait(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()


# -- the Events stream ----------------------------------------------------------------------
class _Subscriber:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: deque[wire.WorkerEvent] = deque()
        self.needs_snapshot = True
        self.load: wire.LoadReport | None = None
        self.wake = asyncio.Event()
        self.resyncs = 0

    def notify(self) -> None:
        try:
            in_loop = asyncio.get_running_loop() is self.loop
        except RuntimeError:
            in_loop = False
        if in_loop:
            self.wake.set()
        else:
            self.loop.call_soon_threadsafe(self.wake.set)


class KvEventPublisher:
    def __init__(self, incarnation_id: str, max_queue: int = 4096) -> None:
        self.incarnation_id = incarnation_id
        self.max_queue = max_queue
        self._lock = threading.Lock()
        self._blocks: dict[int, int] = {}  # hash -> its tier (protocol.KvTier), of every held block
        self._sequence = 0
        self._load = wire.LoadReport()
        self._subscribers: set[_Subscriber] = set()

    @property
    def sequence(self) -> int:
        return self._sequence

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    def cached_hashes(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._blocks)

    def stored(
        self, block_hashes: Iterable[int], parent_hash: int | None = None, tier: int = 0
    ) -> None:
        """Blocks held now, their nearest copy in `tier` (a block stored again moves)."""
        hashes = tuple(block_hashes)
        if not hashes:
            return
        with self._lock:
            self._blocks.update(dict.fromkeys(hashes, tier))
            self._emit(
                wire.KvStored(self.incarnation_id, self._next(), hashes, parent_hash, tier)
            )

    def removed(self, block_hashes: Iterable[int]) -> None:
        hashes = tuple(block_hashes)
        if not hashes:
            return
        with self._lock:
            for h in hashes:
                self._blocks.pop(h, None)
            self._emit(wire.KvRemoved(self.incarnation_id, self._next(), hashes))

    def publish(self, changes: Iterable[tuple[str, Iterable[int]]]) -> None:
        """What a prefix cache stored, moved and evicted, in order: ``("stored" | "host"
        | "disk" | "removed", block hashes)`` pairs, as ``EngineCore.drain_kv_events``
        returns them after a step ("host", "disk": held now only in that tier)."""
        for kind, hashes in changes:
            if kind == "removed":
                self.removed(hashes)
            else:
                self.stored(hashes, tier=0 if kind == "stored" else KvTier[kind.upper()])

    def cleared(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._emit(wire.KvCleared(self.incarnation_id, self._next()))

    def update_load(self, load: wire.LoadReport) -> None:
        with self._lock:
            self._load = load
            for sub in self._subscribers:
                sub.load = load
                sub.notify()

    def _next(self) -> int:
        self._sequence += 1
        return self._sequence

    def _emit(self, event: wire.WorkerEvent) -> None:
        for sub in self._subscribers:
            if sub.needs_snapshot:
                continue  # the snapshot it is about to get includes this event
            if len(sub.queue) >= self.max_queue:
                sub.queue.clear()
                sub.needs_snapshot = True
                sub.resyncs += 1
            else:
                sub.queue.append(event)
            sub.notify()

    async def subscribe(self) -> AsyncIterator[wire.WorkerEvent]:
        """A snapshot and the current load, then every change; ends when closed."""
        sub = _Subscriber(asyncio.get_running_loop())
        with self._lock:
            self._subscribers.add(sub)
            sub.load = self._load
        try:
            while True:
                batch: list[wire.WorkerEvent] = []
                with self._lock:
                    if sub.needs_snapshot:
                        sub.needs_snapshot = False
                        blocks = frozenset(self._blocks)
                        lower = {h: t for h, t in self._blocks.items() if t}
                        batch.append(wire.KvSnapshot(self.incarnation_id, self._sequence,
                                                     blocks, lower))  # fmt: skip
                    batch.extend(sub.queue)
                    sub.queue.clear()
                    if sub.load is not None:
                        batch.append(wire.LoadUpdate(self.incarnation_id, self._sequence, sub.load))
                        sub.load = None
                    sub.wake.clear()
                if not batch:
                    await sub.wake.wait()
                    continue
                for event in batch:
                    yield event
        finally:
            with self._lock:
                self._subscribers.discard(sub)


class Verdict(enum.Enum):
    APPLY = "apply"  # in step: use it
    SKIP = "skip"  # nothing to go on yet (no snapshot since the (re)subscription)
    RESYNC = "resync"  # out of step: discard what is known, get a snapshot


class EventSequencer:
    def __init__(self) -> None:
        self.incarnation: str | None = None
        self.last = -1  # the sequence of the last KV event applied; -1: no snapshot yet

    def reset(self) -> None:
        """A new subscription: wait for its snapshot."""
        self.incarnation, self.last = None, -1

    def check(self, event: wire.WorkerEvent) -> Verdict:
        if isinstance(event, wire.KvSnapshot):
            self.incarnation, self.last = event.incarnation_id, event.sequence
            return Verdict.APPLY
        if self.last < 0:
            return Verdict.SKIP
        if event.incarnation_id != self.incarnation:
            return Verdict.RESYNC  # the worker restarted: its cache is another one
        if isinstance(event, wire.LoadUpdate):
            # it names the last KV event sent before it: any other number is a gap
            return Verdict.APPLY if event.sequence == self.last else Verdict.RESYNC
        if event.sequence != self.last + 1:
            return Verdict.RESYNC
        self.last = event.sequence
        return Verdict.APPLY
