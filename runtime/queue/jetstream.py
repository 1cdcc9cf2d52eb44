"""The prefill queue on NATS JetStream.

Three file-backed streams per namespace ``ns``:

* ``diptych-ns-prefill`` (subject ``diptych.ns.prefill.requests``): work-queue retention,
  one durable pull consumer ``prefill-workers`` shared by all prefill workers (explicit
  ack, ``ack_wait``, ``max_deliver = max_deliveries + 1``); ``Nats-Msg-Id = request id``
  gives publish-side deduplication; ``discard=new`` at ``max_pending`` makes a full queue
  refuse work instead of dropping old requests.
* ``diptych-ns-prefill-to`` (``diptych.ns.prefill.to.<worker key>``): requests that
  prefer one prefill worker, work-queue retention too, one durable consumer per worker
  (``prefill-to-<worker key>``, removed after an hour unused) that only that worker
  pulls, before the shared one. ``release`` deletes such a message and publishes it to
  the shared subject (unless the worker's consumer has delivered it already).
* ``diptych-ns-prefill-done`` (``diptych.ns.prefill.done.<key>``): one message per
  completed request, written with ``Nats-Expected-Last-Subject-Sequence: 0`` so that only
  the first writer succeeds: the atomic claim behind exactly-once completion.
* ``diptych-ns-prefill-dead`` (``diptych.ns.prefill.dead.<decode worker id>``): dead
  letters; each decode worker reads its own subject through an ephemeral consumer that is
  recreated from the last sequence it saw after a reconnect or server restart.

The client reconnects forever (every 0.25 s); calls retry until ``publish_timeout`` so a
server restart looks like a short stall. After a reconnect the streams and the consumer
are declared again, which is a no-op unless the server lost its data.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import nats
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import api

from runtime.backend_auth import BackendAuth
from runtime.errors import BackendUnavailable, ControlPlaneError, NotConnected
from runtime.queue.base import Delivery, PrefillQueue
from runtime.queue.messages import DeadLetter
from runtime.queue.options import PublishResult, QueueDepth, QueueFull, QueueOptions, request_key

log = logging.getLogger(__name__)
T = TypeVar("T")

CONSUMER = "prefill-workers"
_SHARED_POLL_S = 0.1  # a worker's long poll on the shared queue, between its own polls
_OWN_IDLE_S = 3600.0  # a worker's own consumer is removed after this long unused
_ERR_NO_MESSAGE = (10037, 10057)  # no message found (get, delete)
_ERR_WRONG_LAST_SEQUENCE = 10071
_ERR_MAX_MESSAGES = 10077
_ERR_FULL = (_ERR_MAX_MESSAGES, 10047, 10054)  # messages, storage, bytes limit reached
_ERR_LOST = (10059, 10014)  # stream not found, consumer not found
# Errors that mean "not reachable right now": retried until the call's time budget ends.
TRANSIENT_ERRORS = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
    asyncio.TimeoutError,
    OSError,
)


_LATE_CLOSES: set[asyncio.Task[Any]] = set()  # held until done (the loop keeps weak refs)


def _close_late_connection(attempt: asyncio.Future[Any]) -> None:
    """A connect given up on that connected after all: close it (a client nobody holds)."""
    if attempt.cancelled() or attempt.exception() is not None:
        return
    task = asyncio.ensure_future(attempt.result().close())
    _LATE_CLOSES.add(task)
    task.add_done_callback(_LATE_CLOSES.discard)


class _JsDelivery(Delivery):
    def __init__(self, queue: JetStreamPrefillQueue, msg: Msg) -> None:
        super().__init__(queue, msg.metadata.num_delivered, msg.metadata.sequence.stream)
        self._q = queue
        self._msg = msg

    async def _ack(self) -> None:
        # Wait for the server's confirmation; if it is lost anyway the redelivery is
        # recognised as completed and acked unseen.
        await self._q._retry(lambda: self._msg.ack_sync(timeout=self._q.options.op_timeout))

    async def _nak(self, delay: float) -> None:
        await self._q._retry(lambda: self._msg.nak(delay=delay or None))

    async def _progress(self) -> None:
        await self._q._retry(self._msg.in_progress)

    async def _term(self) -> None:
        await self._q._retry(self._msg.term)  # the server counts a term as an ack


class JetStreamPrefillQueue(PrefillQueue):
    def __init__(
        self,
        servers: list[tuple[str, int]],
        options: QueueOptions,
        auth: BackendAuth | None = None,
    ) -> None:
        super().__init__(options)
        self._auth = auth or BackendAuth()
        self._last_error: Exception | None = None
        scheme = "tls" if self._auth.tls else "nats"
        self._servers = [f"{scheme}://{h}:{p}" for h, p in servers]
        ns = options.namespace
        self.stream = f"diptych-{ns}-prefill"
        self.subject = f"diptych.{ns}.prefill.requests"
        self._to_stream, self._to_prefix = f"{self.stream}-to", f"diptych.{ns}.prefill.to."
        self._own: dict[str, Any] = {}  # worker id -> its pull subscription
        self._done_stream, self._done_prefix = f"{self.stream}-done", f"diptych.{ns}.prefill.done."
        self._dead_stream, self._dead_prefix = f"{self.stream}-dead", f"diptych.{ns}.prefill.dead."
        self._nc: Any = None
        self._js: Any = None
        self._psub: Any = None
        self._reconnects = 0
        self._declared_at = -1  # value of _reconnects when the streams were last declared

    # -- connection -----------------------------------------------------------------------
    async def connect(self) -> None:
        if self._nc is not None:
            return

        async def on_reconnect() -> None:
            self._reconnects += 1
            log.info("reconnected to NATS at %s", self._nc.connected_url.netloc)

        async def on_disconnect() -> None:
            if self._nc is not None and not self._nc.is_closed:
                log.warning("disconnected from NATS; reconnecting")

        async def on_error(e: Exception) -> None:
            self._last_error = e
            log.debug("NATS client error: %s", e)

        attempt = asyncio.ensure_future(
            nats.connect(
                servers=self._servers,
                name=f"diptych-prefill-queue-{self.namespace}",
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.25,
                connect_timeout=2,
                ping_interval=5,
                max_outstanding_pings=3,
                reconnected_cb=on_reconnect,
                disconnected_cb=on_disconnect,
                error_cb=on_error,
                **self._credentials(),
            )
        )
        # not wait_for: it waits for the cancelled attempt to end, and nats-py's connect
        # loop can ignore a cancel that lands mid TLS handshake (a refused client hung
        # there under load); this gives up on time and lets the attempt end on its own
        await asyncio.wait({attempt}, timeout=self.options.publish_timeout)
        try:
            if not attempt.done():
                attempt.cancel()
                attempt.add_done_callback(_close_late_connection)
                raise asyncio.TimeoutError
            self._nc = attempt.result()
        except (asyncio.TimeoutError, *TRANSIENT_ERRORS) as e:
            why = self._last_error or e  # an authorization violation says so here
            raise BackendUnavailable(
                f"cannot reach NATS at {', '.join(self._servers)}: {why!r}"
            ) from e
        self._js = self._nc.jetstream(timeout=self.options.op_timeout)
        if self._nc.max_payload < self.options.max_message_bytes:
            log.warning(
                "NATS max_payload %d is below max_message_bytes %d; larger requests fail",
                self._nc.max_payload, self.options.max_message_bytes,
            )  # fmt: skip
        try:
            await self._retry(self._declare)
        except BackendUnavailable as e:
            await self.close()  # leave nothing half-open
            raise BackendUnavailable(
                f"{e}; is JetStream enabled on the server (nats-server -js)?"
            ) from e
        except BaseException:
            await self.close()
            raise

    def _credentials(self) -> dict[str, Any]:
        a = self._auth
        out: dict[str, Any] = {}
        if a.user is not None:
            out.update(user=a.user, password=a.password or "")
        if a.token:
            out["token"] = a.token
        if a.creds_file:
            out["user_credentials"] = a.creds_file
        if a.nkey_file:
            out["nkeys_seed"] = a.nkey_file
        ctx = a.ssl_context()
        if ctx is not None:
            out["tls"] = ctx
        return out

    async def close(self) -> None:
        nc, self._nc, self._js, self._psub = self._nc, None, None, None
        self._own.clear()
        if nc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), 2.0)

    def _require_js(self) -> Any:
        if self._js is None:
            raise NotConnected("JetStreamPrefillQueue is not connected; call connect() first")
        return self._js

    async def _declare(self) -> None:
        """Create the streams and the consumer if absent (idempotent)."""
        js, o = self._require_js(), self.options
        file = api.StorageType.FILE
        await self._add_stream(api.StreamConfig(
            name=self.stream, subjects=[self.subject], retention=api.RetentionPolicy.WORK_QUEUE,
            max_age=o.retention, max_msgs=o.max_pending, discard=api.DiscardPolicy.NEW,
            duplicate_window=o.dedup_window, max_msg_size=o.max_message_bytes, storage=file,
        ))  # fmt: skip
        await self._add_stream(api.StreamConfig(
            name=self._to_stream, subjects=[self._to_prefix + "*"],
            retention=api.RetentionPolicy.WORK_QUEUE, max_age=o.retention, max_msgs=o.max_pending,
            discard=api.DiscardPolicy.NEW, duplicate_window=o.dedup_window,
            max_msg_size=o.max_message_bytes, storage=file,
        ))  # fmt: skip
        await self._add_stream(api.StreamConfig(
            name=self._done_stream, subjects=[self._done_prefix + "*"], max_msgs_per_subject=1,
            max_age=o.done_ttl, max_msg_size=1024, storage=file,
        ))  # fmt: skip
        await self._add_stream(api.StreamConfig(
            name=self._dead_stream, subjects=[self._dead_prefix + "*"], max_age=o.retention,
            duplicate_window=o.dedup_window, max_msg_size=64 * 1024, storage=file,
        ))  # fmt: skip
        try:
            await js.add_consumer(self.stream, api.ConsumerConfig(
                durable_name=CONSUMER, ack_policy=api.AckPolicy.EXPLICIT, ack_wait=o.ack_wait,
                max_deliver=o.max_deliveries + 1, filter_subject=self.subject,
                max_ack_pending=-1, max_waiting=4096,
            ))  # fmt: skip
        except nats.js.errors.BadRequestError as e:
            # Created by a process with other options (ack_wait, max_deliveries): the first
            # one wins; this client still dead-letters after its own max_deliveries.
            log.warning("consumer %s exists with another configuration: %s", CONSUMER, e)
        self._declared_at = self._reconnects

    async def _add_stream(self, config: api.StreamConfig) -> None:
        try:
            await self._require_js().add_stream(config)
        except nats.js.errors.BadRequestError:
            # Exists with another configuration (another process's options): use it as is.
            log.warning("stream %s exists with a different configuration; using it", config.name)

    async def _retry(self, fn: Callable[[], Awaitable[T]], budget: float | None = None) -> T:
        """Call ``fn`` until it succeeds, retrying transient errors for ``budget`` seconds."""
        end = time.monotonic() + (budget or self.options.publish_timeout)
        pause = 0.05
        while True:
            if self._nc is None:
                raise NotConnected("JetStreamPrefillQueue is closed")
            try:
                if self._declared_at != self._reconnects and fn != self._declare:
                    await self._declare()
                return await fn()
            except TRANSIENT_ERRORS as e:
                if getattr(e, "err_code", None) in _ERR_FULL:
                    raise  # an answer (the stream is full), not an outage
                if time.monotonic() + pause > end:
                    raise BackendUnavailable(f"NATS at {', '.join(self._servers)}: {e!r}") from e
            except nats.js.errors.NotFoundError as e:
                if e.err_code not in _ERR_LOST:
                    raise  # e.g. "no message found": an answer, not a failure
                self._declared_at = -1  # the server lost its data: declare everything again
                self._psub = None
                self._own.clear()
                if time.monotonic() + pause > end:
                    raise
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.5)

    # -- publish and fetch ----------------------------------------------------------------
    async def _publish(self, request_id: str, data: bytes, prefer: str | None) -> PublishResult:
        js = self._require_js()
        headers = {"Nats-Msg-Id": request_id}
        if prefer is None:
            subject, stream = self.subject, self.stream
        else:
            subject, stream = self._to_prefix + _key(prefer), self._to_stream
        try:
            ack = await self._retry(
                lambda: js.publish(subject, data, headers=headers, stream=stream)
            )
        except nats.js.errors.APIError as e:
            if e.err_code in _ERR_FULL:
                raise QueueFull(
                    f"the prefill queue holds {self.options.max_pending} requests"
                ) from e
            raise ControlPlaneError(f"publish of {request_id} failed: {e.description}") from e
        return PublishResult(ack.seq, bool(ack.duplicate))

    async def _release(
        self, request_id: str, data: bytes, sequence: int, prefer: str, force: bool
    ) -> bool:
        js = self._require_js()
        if not force:
            try:
                info = await self._retry(lambda: js.consumer_info(self._to_stream, _own(prefer)))
                if (info.delivered.stream_seq or 0) >= sequence:
                    return False  # the preferred worker has taken it
            except nats.js.errors.NotFoundError:
                pass  # it never fetched: nothing delivered
        try:
            await self._retry(lambda: js.delete_msg(self._to_stream, sequence))
        except nats.js.errors.NotFoundError:
            return False  # acked (done) or expired
        except nats.js.errors.APIError as e:
            if e.err_code not in _ERR_NO_MESSAGE:
                raise
            return False
        headers = {"Nats-Msg-Id": request_id}
        await self._retry(
            lambda: js.publish(self.subject, data, headers=headers, stream=self.stream)
        )
        return True

    async def _fetch(
        self, batch: int, timeout: float, worker_id: str | None
    ) -> list[tuple[bytes, Delivery]]:
        """The worker's own preferred requests first, then the shared ones; polled in
        short turns so that neither waits behind the other's long poll."""
        js = self._require_js()
        if self._declared_at != self._reconnects:
            await self._retry(self._declare)
        if self._psub is None:
            self._psub = await js.pull_subscribe_bind(durable=CONSUMER, stream=self.stream)
        if worker_id is None:
            return await self._pull(self._psub, batch, timeout)
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while True:
            own = await self._own_sub(worker_id)
            got = await self._pull(own, batch, 0.02) if own is not None else []
            left = end - loop.time()
            if got or left <= 0:
                return got
            got = await self._pull(self._psub, batch, min(left, _SHARED_POLL_S))
            if got or end - loop.time() <= 0:
                return got

    async def _pull(self, sub: Any, batch: int, timeout: float) -> list[tuple[bytes, Delivery]]:
        try:
            msgs = await sub.fetch(batch, timeout=timeout)
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            return []
        except nats.js.errors.NotFoundError:
            self._psub = None  # the consumer vanished with the server's data
            self._own.clear()
            return []
        except TRANSIENT_ERRORS as e:
            log.warning("fetch from NATS failed (%r); retrying", e)
            await asyncio.sleep(min(timeout, 0.25))
            return []
        return [(m.data, _JsDelivery(self, m)) for m in msgs]

    async def _own_sub(self, worker_id: str) -> Any:
        """The pull subscription on this worker's preferred requests, its consumer
        declared on first use."""
        sub = self._own.get(worker_id)
        if sub is not None:
            return sub
        js, o = self._require_js(), self.options
        name = _own(worker_id)
        try:
            await self._retry(lambda: js.add_consumer(self._to_stream, api.ConsumerConfig(
                durable_name=name, ack_policy=api.AckPolicy.EXPLICIT, ack_wait=o.ack_wait,
                max_deliver=o.max_deliveries + 1, filter_subject=self._to_prefix + _key(worker_id),
                max_ack_pending=-1, max_waiting=512, inactive_threshold=_OWN_IDLE_S,
            )))  # fmt: skip
        except nats.js.errors.BadRequestError as e:
            log.warning("consumer %s exists with another configuration: %s", name, e)
        sub = await js.pull_subscribe_bind(durable=name, stream=self._to_stream)
        self._own[worker_id] = sub
        return sub

    async def depth(self) -> QueueDepth:
        js = self._require_js()
        info = await self._retry(lambda: js.consumer_info(self.stream, CONSUMER))
        return QueueDepth(pending=info.num_pending or 0, in_flight=info.num_ack_pending or 0)

    # -- completion marks -----------------------------------------------------------------
    async def _mark_done(self, request_id: str, claimant: str) -> bool:
        js = self._require_js()
        subject = self._done_prefix + request_key(request_id)
        headers = {"Nats-Expected-Last-Subject-Sequence": "0"}
        mark = claimant.encode()
        try:
            await self._retry(
                lambda: js.publish(subject, mark, headers=headers, stream=self._done_stream)
            )
        except nats.js.errors.APIError as e:
            if e.err_code != _ERR_WRONG_LAST_SEQUENCE:
                raise ControlPlaneError(
                    f"completion mark of {request_id} failed: {e.description}"
                ) from e
            # Marked already: by another delivery, or by an earlier try of this claim that
            # timed out while the server was away but landed once it was back.
            found = await self._retry(lambda: js.get_msg(self._done_stream, subject=subject))
            return bool(found.data == mark)
        return True

    async def _is_done(self, request_id: str) -> bool:
        js = self._require_js()
        subject = self._done_prefix + request_key(request_id)
        try:
            await self._retry(lambda: js.get_msg(self._done_stream, subject=subject))
        except nats.js.errors.NotFoundError:
            return False
        return True

    # -- dead letters ---------------------------------------------------------------------
    async def _put_dead_letter(self, letter: DeadLetter, data: bytes) -> None:
        js = self._require_js()
        subject = self._dead_prefix + letter.decode_worker_id
        headers = {"Nats-Msg-Id": letter.request_id}
        await self._retry(
            lambda: js.publish(subject, data, headers=headers, stream=self._dead_stream)
        )

    def dead_letters(self, decode_worker_id: str) -> AsyncIterator[DeadLetter]:
        return self._read_dead_letters(self._check_dead_letter_target(decode_worker_id))

    async def _read_dead_letters(self, worker: str) -> AsyncIterator[DeadLetter]:
        """Letters for ``worker`` published from now on, through an ephemeral consumer that is
        recreated from the last sequence seen after every reconnect (a restarted server may
        have dropped it)."""
        js = self._require_js()
        subject = self._dead_prefix + worker
        info = await self._retry(lambda: js.stream_info(self._dead_stream))
        next_seq = info.state.last_seq + 1  # deliver only letters published from now on
        first = True
        while self._nc is not None:
            if not first:
                try:
                    info = await self._retry(lambda: js.stream_info(self._dead_stream))
                except BackendUnavailable as e:
                    log.warning("dead-letter stream unreachable for %s (%s); retrying", worker, e)
                    continue
                except NotConnected:
                    return
                if info.state.last_seq + 1 < next_seq:  # the server lost its data: start over
                    next_seq = max(1, info.state.first_seq)
            first = False
            config = api.ConsumerConfig(
                deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=next_seq,
                ack_policy=api.AckPolicy.NONE, inactive_threshold=60.0, filter_subject=subject,
            )  # fmt: skip
            try:
                subscribe = functools.partial(
                    js.pull_subscribe, subject, stream=self._dead_stream, config=config
                )
                sub = await self._retry(subscribe)
            except BackendUnavailable as e:
                log.warning("dead-letter subscription for %s failed (%s); retrying", worker, e)
                continue
            except NotConnected:
                return
            seen_reconnects = self._reconnects
            try:
                while seen_reconnects == self._reconnects:
                    try:
                        msgs = await sub.fetch(64, timeout=1.0)
                    except (nats.errors.TimeoutError, asyncio.TimeoutError):
                        continue
                    for m in msgs:
                        next_seq = m.metadata.sequence.stream + 1
                        letter = self._open_dead_letter(m.data)
                        if letter is not None:
                            yield letter
            except nats.errors.ConnectionClosedError:
                return  # the queue was closed
            except (*TRANSIENT_ERRORS, nats.js.errors.APIError) as e:
                log.warning("dead-letter consumer for %s failed (%r); recreating", worker, e)
                await asyncio.sleep(0.25)
            finally:
                await _drop_consumer(js, self._dead_stream, sub)
            # After a reconnect the ephemeral consumer may be gone: recreate from next_seq.


def _key(worker_id: str) -> str:
    """A worker id as one NATS subject token (pod names may hold dots)."""
    return request_key(worker_id)[:24]


def _own(worker_id: str) -> str:
    return f"prefill-to-{_key(worker_id)}"


async def _drop_consumer(js: Any, stream: str, sub: Any) -> None:
    with contextlib.suppress(Exception):
        await sub.unsubscribe()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(js.delete_consumer(stream, sub._consumer), 1.0)
