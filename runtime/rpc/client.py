"""The frontend's client of one decode worker: Generate streams, Abort, Events, Health.

One client holds one HTTP/2 connection and multiplexes every request over it. Errors
arrive as :class:`GenerateError` with an :class:`ErrorCode`, whether the worker reported
them in the stream or the call failed (a dead worker gives UNAVAILABLE, which is
``retryable``: migrate the request).

With a deployment secret and the ``worker_id`` it means to call (from the worker's
discovery record), a client checks every answer's proof (``auth.py``) before it takes
the first message or the unary result: an answer from any other server (a hijacked or
reused address) fails the call as UNAVAILABLE, ``retryable`` like a dead worker, and is
reported to ``on_proof_failure``.

Cancelling: ``stream.cancel()``, leaving an ``async with`` block early, or cancelling the
task that iterates all cancel the RPC, and the worker aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio

from runtime.errors import BackendUnavailable
from runtime.proto import diptych_runtime_pb2 as pb
from runtime.rpc import auth
from runtime.rpc import types as wire
from runtime.rpc.auth import answer_verified, call_metadata, client_channel, token_nonce
from runtime.rpc.limits import ClientOptions
from runtime.rpc.server import SERVICE, TRACEPARENT_KEY, EventSequencer, Verdict
from runtime.rpc.types import (
    ErrorCode,
    GenerateChunk,
    GenerateError,
    GenerateRequest,
    HealthReport,
    KvSnapshot,
    WorkerEvent,
)

log = logging.getLogger(__name__)


# Resubscribing cannot help: an old worker, one at its subscriber limit, or one that
# refuses this process (another deployment's cluster secret).
_FINAL = (
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAUTHENTICATED,
)


def _error(e: grpc.aio.AioRpcError) -> GenerateError:
    return GenerateError(ErrorCode.from_grpc(e.code()), e.details() or e.code().name)


class GenerateStream:
    """The chunks of one request; iterate it, ideally inside ``async with``."""

    def __init__(
        self, call: Any, request_id: str, verify: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        self.request_id = request_id
        self._call = call
        self._verify = verify  # who answered, checked once the first message is here
        self._cancelled = False
        self.finished = False

    def __aiter__(self) -> GenerateStream:
        return self

    async def __anext__(self) -> GenerateChunk:
        if self.finished:
            raise StopAsyncIteration
        try:
            msg = await self._call.read()
        except grpc.aio.AioRpcError as e:
            self.finished = True
            raise _error(e) from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            being_cancelled = task is not None and getattr(task, "cancelling", lambda: 1)() > 0
            if self._cancelled and not being_cancelled:  # cancel() while another task reads
                raise GenerateError(ErrorCode.CANCELLED, "cancelled by this client") from None
            self._call.cancel()
            raise
        if msg is grpc.aio.EOF:
            self.finished = True
            raise GenerateError(ErrorCode.INTERNAL, "the stream ended without a finish reason")
        if self._verify is not None:
            verify, self._verify = self._verify, None
            try:
                await verify()  # the initial metadata came with (or before) this message
            except GenerateError:
                self.finished = True
                raise
        result = wire.chunk_from_pb(msg)
        if isinstance(result, tuple):
            self.finished = True
            self._call.cancel()
            raise GenerateError(*result)
        if result.finished:
            self.finished = True
        return result

    def cancel(self) -> None:
        """Stop the request; the worker aborts it. Safe to call at any time."""
        if not self._call.done():
            self._cancelled = True
            self._call.cancel()
        self.finished = True

    async def __aenter__(self) -> GenerateStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()


class DecodeWorkerClient:
    """A client of the worker at ``address``; ``worker_id`` (its discovery id) makes it
    accept only that worker's answers when a deployment secret is set, and
    ``on_proof_failure`` hears of each answer refused for that."""

    def __init__(
        self,
        address: str,
        options: ClientOptions | None = None,
        worker_id: str | None = None,
        on_proof_failure: Callable[[], None] | None = None,
    ) -> None:
        self.address = address
        self.options = options or ClientOptions()
        self.worker_id = worker_id
        self.on_proof_failure = on_proof_failure
        self._channel: grpc.aio.Channel | None = None
        self._generate: Any = None
        self._abort: Any = None
        self._health: Any = None
        self._events: Any = None
        self._call_key: bytes | None = None  # the request plane's key, read at connect

    async def connect(self, wait: bool = True) -> None:
        """Open the channel; with ``wait``, fail with BackendUnavailable if the worker is not
        reachable within ``connect_timeout_s``."""
        if self._channel is None:
            ch = client_channel(self.address, self.options.channel_options())  # TLS if set
            ident = _identity
            self._generate = ch.unary_stream(
                f"/{SERVICE}/Generate", ident, pb.GenerateResponse.FromString
            )
            self._abort = ch.unary_unary(f"/{SERVICE}/Abort", ident, pb.AbortResponse.FromString)
            self._health = ch.unary_unary(f"/{SERVICE}/Health", ident, pb.HealthResponse.FromString)
            self._events = ch.unary_stream(f"/{SERVICE}/Events", ident, pb.WorkerEvent.FromString)
            self._call_key = auth.call_key()  # None without a deployment secret: calls unsigned
            self._channel = ch
        if wait:
            try:
                await asyncio.wait_for(
                    self._channel.channel_ready(), self.options.connect_timeout_s
                )
            except asyncio.TimeoutError:
                raise BackendUnavailable(f"decode worker {self.address} is not reachable") from None

    async def close(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close()

    async def __aenter__(self) -> DecodeWorkerClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _require(self) -> None:
        if self._channel is None:
            raise BackendUnavailable(f"client of {self.address} is not connected")

    def _signed(
        self, method: str
    ) -> tuple[tuple[tuple[str, str], ...] | None, tuple[str, str] | None]:
        """A call's metadata (its one-use token) and the (method, nonce) its answer is
        checked against; None for what there is not (no secret, or no worker named)."""
        if self._call_key is None:
            return None, None
        metadata = call_metadata(self._call_key, method)
        nonce = token_nonce(metadata)
        return metadata, None if nonce is None or self.worker_id is None else (method, nonce)

    async def _verify(self, call: Any, expected: tuple[str, str] | None) -> None:
        """Raise (UNAVAILABLE) unless the worker this client means answered ``call``."""
        if expected is None or self.worker_id is None:
            return
        method, nonce = expected
        if answer_verified(await call.initial_metadata(), method, self.worker_id, nonce):
            return
        call.cancel()
        if self.on_proof_failure is not None:
            self.on_proof_failure()
        log.warning("%s answered %s without the proof of worker %s: refused (another "
                    "server at its address)", self.address, method, self.worker_id)  # fmt: skip
        raise GenerateError(
            ErrorCode.UNAVAILABLE,
            f"the server at {self.address} did not prove it is worker {self.worker_id} "
            f"(another server at that address, or no cluster secret): its answer is refused",
        )

    def generate(
        self,
        request: GenerateRequest,
        timeout: float | None = None,
        wait_for_ready: bool = False,
        traceparent: str = "",
    ) -> GenerateStream:
        """Start a request. ``timeout`` bounds the whole stream; ``wait_for_ready`` queues
        the call while the worker is unreachable instead of failing at once;
        ``traceparent`` (W3C trace context, runtime/tracing.py) goes in the call's metadata."""
        self._require()
        method = f"/{SERVICE}/Generate"
        metadata, expected = self._signed(method)
        if traceparent:
            metadata = (*(metadata or ()), (TRACEPARENT_KEY, traceparent))
        call = self._generate(
            wire.request_to_bytes(request), timeout=timeout, wait_for_ready=wait_for_ready,
            metadata=metadata,
        )  # fmt: skip
        verify = None if expected is None else functools.partial(self._verify, call, expected)
        return GenerateStream(call, request.request_id, verify)

    async def abort(self, request_id: str, timeout: float = 5.0) -> None:
        """Abort a running request by id; NOT_FOUND if the worker has no such request."""
        self._require()
        method = f"/{SERVICE}/Abort"
        metadata, expected = self._signed(method)
        call = self._abort(
            pb.AbortRequest(request_id=request_id).SerializeToString(), timeout=timeout,
            metadata=metadata,
        )  # fmt: skip
        try:
            await call
        except grpc.aio.AioRpcError as e:
            raise _error(e) from None
        await self._verify(call, expected)

    async def health(self, timeout: float = 5.0) -> HealthReport:
        self._require()
        method = f"/{SERVICE}/Health"
        metadata, expected = self._signed(method)
        call = self._health(pb.HealthRequest().SerializeToString(), timeout=timeout,
                            metadata=metadata)  # fmt: skip
        try:
            msg = await call
        except grpc.aio.AioRpcError as e:
            raise _error(e) from None
        await self._verify(call, expected)
        return wire.health_from_pb(msg)

    async def events(
        self, subscriber: str = "", retry_s: float = 0.2
    ) -> AsyncIterator[WorkerEvent]:
        """Worker events, resubscribing forever: every (re)subscription starts with a
        :class:`KvSnapshot`, which replaces whatever the caller knew about this worker. A
        gap in sequence numbers or a new incarnation also forces a resubscription. An
        answer not from this client's worker ends it (GenerateError, UNAVAILABLE)."""
        self._require()
        method = f"/{SERVICE}/Events"
        request = pb.EventsRequest(subscriber=subscriber).SerializeToString()
        delay = retry_s
        while True:
            metadata, expected = self._signed(method)
            call = self._events(request, wait_for_ready=True, metadata=metadata)
            try:
                async with contextlib.aclosing(self._read_events(call, expected)) as events:
                    async for event in events:
                        delay = retry_s
                        yield event
            except grpc.aio.AioRpcError as e:
                if e.code() in _FINAL:
                    raise _error(e) from None
                log.info(
                    "events from %s interrupted (%s); resubscribing", self.address, e.code().name
                )
            finally:
                call.cancel()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    async def _read_events(
        self, call: Any, expected: tuple[str, str] | None
    ) -> AsyncGenerator[WorkerEvent, None]:
        parts: list[int] = []
        lower: dict[int, int] = {}
        sequencer = EventSequencer()
        async for msg in call:
            if expected is not None:  # the first message: its initial metadata is here
                await self._verify(call, expected)
                expected = None
            event: WorkerEvent | None
            if msg.WhichOneof("kind") == "snapshot":
                parts.extend(msg.snapshot.block_hashes)
                lower.update(zip(msg.snapshot.lower_hashes, msg.snapshot.lower_tiers,
                                 strict=False))  # fmt: skip
                if not msg.snapshot.last:
                    continue
                event = KvSnapshot(msg.incarnation_id, msg.sequence, frozenset(parts), lower)
                parts, lower = [], {}
            else:
                event = wire.event_from_pb(msg)
                if event is None:
                    continue  # an event kind this client does not know
            verdict = sequencer.check(event)
            if verdict is Verdict.RESYNC:
                log.warning("events from %s out of step (%s %d after %d, incarnation %s); "
                            "resubscribing for a snapshot", self.address, type(event).__name__,
                            event.sequence, sequencer.last, event.incarnation_id)  # fmt: skip
                return
            if verdict is Verdict.APPLY:
                yield event


async def follow_events(
    client: DecodeWorkerClient,
    worker_id: str,
    on_event: Callable[[str, WorkerEvent], None],
    *,
    subscriber: str,
    what: str = "worker",
) -> None:
    """Feed a worker's Events stream to ``on_event(worker_id, event)`` until cancelled
    (resubscribing as :meth:`DecodeWorkerClient.events` does). A worker that serves no
    events is logged once and left alone."""
    try:
        async for event in client.events(subscriber=subscriber):
            on_event(worker_id, event)
    except GenerateError as e:
        log.info("%s %s sends no events (%s)", what, worker_id, e)
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("following the events of %s %s failed", what, worker_id)


def _identity(data: bytes) -> bytes:
    return data


@contextlib.asynccontextmanager
async def connect_worker(
    address: str, options: ClientOptions | None = None, worker_id: str | None = None
) -> AsyncIterator[DecodeWorkerClient]:
    """``async with connect_worker(addr) as client:`` opens and closes a client."""
    client = DecodeWorkerClient(address, options, worker_id)
    await client.connect()
    try:
        yield client
    finally:
        await client.close()
