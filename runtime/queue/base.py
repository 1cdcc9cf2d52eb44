"""The durable prefill queue: decode workers publish, prefill workers fetch, work, ack.

Delivery contract, the same on both backends:

* A fetched message is invisible to other consumers for ``ack_wait`` seconds; ``ack``
  removes it, ``in_progress`` restarts the clock (use :meth:`Delivery.keepalive` around a
  long prefill), ``nak(delay)`` hands it back, and a consumer that dies simply lets the
  clock run out: the message is redelivered to another consumer.
* Each message is worked on at most ``max_deliveries`` times. After that (a ``nak`` of the
  last attempt, or a consumer dying on it), and on ``term`` or a passed deadline, a
  :class:`DeadLetter` goes to the publishing decode worker, which hears it through
  :meth:`PrefillQueue.dead_letters`. The server-side limit is ``max_deliveries + 1``: the
  extra delivery is the one this library turns into the dead letter.
* Exactly-once completion: ``publish`` drops a request id seen within ``dedup_window``;
  ``fetch`` skips redeliveries whose request is already completed; and
  :meth:`Delivery.claim_completion` is atomic, so of two consumers holding the same request
  (one too slow for its ack-wait) only one may notify the decode worker.

Preference (prefill affinity): ``publish(request, prefer=worker_id)`` offers a request
first to one prefill worker (the one holding most of its prefix): only that worker's
``fetch(worker_id=...)`` sees it, before any shared message, until ``release`` hands it
to every worker. ``release`` moves it only while the preferred worker has not taken it
(``force``: also when it has, for a worker that died holding it); a redelivery goes to
anyone. Everything above holds for preferred requests too.

Prefill worker loop::

    for d in await queue.fetch(batch=8, timeout=1.0):
        async with d.keepalive():
            first_token = await prefill_and_write_kv(d.request)
        if await d.claim_completion():
            await notify_decode_worker(d.request, first_token)
        await d.ack()
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator

from protocol.declare import check_worker_id
from runtime.errors import ControlPlaneError, InvalidInput, PayloadTooLarge
from runtime.queue.messages import DeadLetter, DeadLetterReason, RemotePrefillRequest
from runtime.queue.options import PublishResult, QueueDepth, QueueOptions, QueueStats
from runtime.queue.signing import Kind, Opened, Rejected, ReplayGuard, open_sealed, seal
from runtime.tasks import cancel_and_wait

log = logging.getLogger(__name__)


class Delivery(abc.ABC):
    """One delivery of a request to a consumer; settle it with exactly one of ack, nak, term."""

    request: RemotePrefillRequest  # set by PrefillQueue.fetch() once the payload is decoded

    def __init__(self, queue: PrefillQueue, num_delivered: int, position: int) -> None:
        self.num_delivered = num_delivered  # 1 on the first delivery
        self.position = position  # the message's place in the stream, the same on redelivery
        self._queue = queue
        self.settled: str | None = None
        # who claims its completion: a claim retried after an outage (whose first try may
        # have landed unseen) recognises its own mark
        self.claimant = uuid.uuid4().hex

    @abc.abstractmethod
    async def _ack(self) -> None: ...

    @abc.abstractmethod
    async def _nak(self, delay: float) -> None: ...

    @abc.abstractmethod
    async def _progress(self) -> None: ...

    @abc.abstractmethod
    async def _term(self) -> None: ...

    @property
    def last_attempt(self) -> bool:
        return self.num_delivered >= self._queue.options.max_deliveries

    def _settle(self, how: str) -> None:
        if self.settled is not None:
            raise InvalidInput(
                f"delivery of {self.request.request_id} was already settled ({self.settled})"
            )
        self.settled = how

    async def ack(self) -> None:
        """The work is done (KV written, decode worker notified): remove the message."""
        self._settle("ack")
        await self._ack()
        self._queue.stats.acked += 1

    async def nak(self, delay: float = 0.0, reason: str = "") -> None:
        """Give the request back for another attempt after ``delay`` seconds; on the last
        allowed attempt this dead-letters it instead."""
        if self.last_attempt:
            await self._dead_letter(DeadLetterReason.MAX_DELIVERIES, reason or "nak")
            return
        self._settle("nak")
        await self._nak(max(0.0, float(delay)))
        self._queue.stats.naked += 1

    async def term(self, reason: str) -> None:
        """Never retry: tell the decode worker (dead letter) and remove the message."""
        await self._dead_letter(DeadLetterReason.TERMINATED, reason)

    async def in_progress(self) -> None:
        """Still working: restart the ack-wait clock."""
        if self.settled is None:
            await self._progress()

    @contextlib.asynccontextmanager
    async def keepalive(self, interval: float | None = None) -> AsyncIterator[None]:
        """Send :meth:`in_progress` every ``ack_wait / 3`` while the body runs. The
        heartbeat task starts at the first beat: a body shorter than one period (most
        prefills) costs a timer, not a task."""
        period = interval or self._queue.options.ack_wait / 3
        loop = asyncio.get_running_loop()
        task: asyncio.Task[None] | None = None

        async def beat() -> None:
            while True:
                try:
                    await self.in_progress()
                except ControlPlaneError as e:  # the next beat may get through
                    log.warning("heartbeat for %s failed: %s", self.request.request_id, e)
                await asyncio.sleep(period)

        def start() -> None:
            nonlocal task
            task = loop.create_task(beat(), name=f"heartbeat {self.request.request_id}")

        first = loop.call_later(period, start)
        try:
            yield
        finally:
            first.cancel()
            if task is not None:
                await cancel_and_wait(task)

    async def claim_completion(self) -> bool:
        """Atomically record this request as completed. False: another delivery already
        completed it, so do not notify the decode worker again (still ``ack``). Safe to
        call again after it raised: a mark this delivery made counts as its claim."""
        return await self._queue._mark_done(self.request.request_id, self.claimant)

    async def _dead_letter(self, reason: DeadLetterReason, detail: str) -> None:
        self._settle(f"dead-letter ({reason.name})")
        await self._queue._send_dead_letter(self.request, reason, detail, self.num_delivered)
        await self._term()


class PrefillQueue(abc.ABC):
    def __init__(self, options: QueueOptions) -> None:
        self.options = options
        self.namespace = options.namespace
        self.stats = QueueStats()
        self._replays = ReplayGuard()

    # -- what a backend implements -------------------------------------------------------
    @abc.abstractmethod
    async def connect(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    @abc.abstractmethod
    async def _publish(self, request_id: str, data: bytes, prefer: str | None) -> PublishResult: ...

    @abc.abstractmethod
    async def _release(self, request_id: str, data: bytes, sequence: int, prefer: str,
                       force: bool) -> bool: ...  # fmt: skip

    @abc.abstractmethod
    async def _fetch(
        self, batch: int, timeout: float, worker_id: str | None
    ) -> list[tuple[bytes, Delivery]]:
        """Up to ``batch`` deliveries, each with its undecoded payload, those preferring
        ``worker_id`` first; [] after ``timeout``."""

    @abc.abstractmethod
    async def _mark_done(self, request_id: str, claimant: str) -> bool:
        """True if this call, or an earlier one by ``claimant``, recorded the mark."""

    @abc.abstractmethod
    async def _is_done(self, request_id: str) -> bool: ...

    @abc.abstractmethod
    async def _put_dead_letter(self, letter: DeadLetter, data: bytes) -> None:
        """Store ``data``, the letter as written (sealed when the queue signs)."""

    @abc.abstractmethod
    def dead_letters(self, decode_worker_id: str) -> AsyncIterator[DeadLetter]:
        """Dead letters for this decode worker published from now on. Subscribe before
        publishing requests; the iterator survives reconnects without losing letters."""

    @abc.abstractmethod
    async def depth(self) -> QueueDepth: ...

    # -- the public interface -------------------------------------------------------------
    async def __aenter__(self) -> PrefillQueue:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def publish(
        self, request: RemotePrefillRequest, *, prefer: str | None = None
    ) -> PublishResult:
        """Enqueue ``request`` durably; a request id already queued is not added again.
        ``prefer``: offer it to that prefill worker alone until :meth:`release`."""
        data = self._encode(request)
        if prefer is not None:
            check_worker_id(prefer, "prefer")
        result = await self._publish(request.request_id, data, prefer)
        if result.duplicate:
            self.stats.publish_duplicates += 1
        else:
            self.stats.published += 1
        return result

    async def release(
        self, request: RemotePrefillRequest, sequence: int, prefer: str, *, force: bool = False
    ) -> bool:
        """Hand a request published with ``prefer`` (at ``sequence``) to every prefill
        worker. True: it was moved; False: the preferred worker had taken it already (or
        it is gone: done, expired). ``force`` moves it even when taken: for a preferred
        worker that left, whose delivery would otherwise wait out its ack deadline."""
        return await self._release(
            request.request_id, self._encode(request), sequence, prefer, force
        )

    def _encode(self, request: RemotePrefillRequest) -> bytes:
        if not isinstance(request, RemotePrefillRequest):
            raise InvalidInput(
                f"publish() takes a RemotePrefillRequest, got {type(request).__name__}"
            )
        data = self._seal(Kind.REQUEST, request.encode())
        if len(data) > self.options.max_message_bytes:
            raise PayloadTooLarge(
                f"request {request.request_id} encodes to {len(data)} bytes, over the queue's "
                f"{self.options.max_message_bytes}-byte limit ({len(request.prompt_token_ids)} "
                "prompt tokens); prefill it locally or raise max_message_bytes"
            )
        return data

    async def fetch(
        self, batch: int = 1, timeout: float = 1.0, worker_id: str | None = None
    ) -> list[Delivery]:
        """Wait up to ``timeout`` seconds for up to ``batch`` requests to work on; with
        ``worker_id``, those preferring that worker come first.

        Malformed messages, requests past their deadline or past ``max_deliveries``, and
        redeliveries of completed requests are settled here and never returned."""
        if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= 1024:
            raise InvalidInput(f"batch must be an integer in [1, 1024], got {batch!r}")
        if not 0 < timeout <= 3600:
            raise InvalidInput(f"timeout must be in (0, 3600] seconds, got {timeout!r}")
        end = time.monotonic() + timeout
        while True:
            remaining = end - time.monotonic()
            if remaining <= 0:
                return []
            raw = await self._fetch(batch, remaining, worker_id)
            out = [d for d in await self._screen(raw) if d]
            if out:
                return out

    async def _screen(self, raw: list[tuple[bytes, Delivery]]) -> list[Delivery | None]:
        return [await self._screen_one(data, d) for data, d in raw]

    async def _screen_one(self, data: bytes, d: Delivery) -> Delivery | None:
        num = d.num_delivered
        try:
            opened = self._open(Kind.REQUEST, data)
            d.request = RemotePrefillRequest.decode(opened.body)
            if self.options.signing_key is not None:
                self._replays.check(opened, d.position, d.request.deadline, time.time())
        except Rejected as e:
            # not from this deployment (or a replay of what was): no dead letter, whose
            # recipient the message names and nobody vouches for
            log.error("dropping a prefill-queue message that is not ours: %s", e)
            self.stats.reject(e.reason)
            d.settled = f"term (rejected: {e.reason})"
            await d._term()
            return None
        except InvalidInput as e:
            log.error("dropping a malformed prefill-queue message: %s", e)
            self.stats.malformed += 1
            d.settled = "term (malformed)"
            await d._term()
            return None
        self.stats.delivered += 1
        if num > 1:
            self.stats.redelivered += 1
        # Completed first: a consumer that completed and died before its ack leaves a
        # redelivery that must be acked unseen, not dead-lettered. First deliveries skip
        # the round trip (a re-publish after dedup_window is caught by claim_completion()).
        if num > 1 and await self._is_done(d.request.request_id):
            self.stats.skipped_completed += 1
            d.settled = "ack (already completed)"
            await d._ack()
            return None
        if num > self.options.max_deliveries:
            await d._dead_letter(
                DeadLetterReason.MAX_DELIVERIES,
                f"{num - 1} deliveries without an ack (consumers died or timed out)",
            )
            return None
        if d.request.expired():
            await d._dead_letter(DeadLetterReason.DEADLINE, "fetched after its deadline")
            return None
        return d

    async def _send_dead_letter(
        self, request: RemotePrefillRequest, reason: DeadLetterReason, detail: str, num: int
    ) -> None:
        letter = DeadLetter(request.request_id, request.decode_worker_id, reason, detail, num)
        await self._put_dead_letter(letter, self._seal(Kind.DEAD_LETTER, letter.encode()))
        self.stats.dead_lettered += 1
        self.stats.reasons[reason.name] = self.stats.reasons.get(reason.name, 0) + 1
        log.warning(
            "prefill request %s dead-lettered (%s after %d deliveries): %s",
            request.request_id, reason.name, num, detail,
        )  # fmt: skip

    # -- signatures (runtime/queue/signing.py) -------------------------------------------
    def _seal(self, kind: Kind, body: bytes) -> bytes:
        key = self.options.signing_key
        return body if key is None else seal(key, kind, body)

    def _open(self, kind: Kind, data: bytes) -> Opened:
        key = self.options.signing_key
        if key is None:
            return Opened(bytes(data), 0.0, b"")
        return open_sealed(key, kind, data)

    def _open_dead_letter(self, data: bytes) -> DeadLetter | None:
        """A stored dead letter, or None (logged, counted) when it is malformed or
        not signed by this deployment: a forged letter would fail a live request."""
        try:
            return DeadLetter.decode(self._open(Kind.DEAD_LETTER, data).body)
        except Rejected as e:
            log.error("skipping a dead letter that is not ours: %s", e)
            self.stats.reject(e.reason)
        except InvalidInput as e:
            log.error("skipping a malformed dead letter: %s", e)
            self.stats.malformed += 1
        return None

    @staticmethod
    def _check_dead_letter_target(decode_worker_id: str) -> str:
        return check_worker_id(decode_worker_id, "decode_worker_id")
