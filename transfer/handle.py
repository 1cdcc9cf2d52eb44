"""What a transfer gives back: handles, the caller's view of one WRITE, READ or
notification; the operation (`Op`) a backend completes them through; and the
notifications that arrive after their data.

A handle is completed exactly once, from whichever thread finishes the work
(a socket thread, the UCX progress thread, the NIXL poller). It can be polled
without blocking, awaited from any event loop, or waited on from a thread.

What DONE means, per operation:

* write: the bytes are in the remote region and the notification (if any) is
  queued at the receiver. (nixl: NIXL reports the one-sided WRITE complete;
  shm: the bytes are copied into the peer's memory and the notification is
  sent, as with NIXL it is delivered after them.)
* read: the bytes are in the local region and the notification (if any) has
  been handed to the remote.
* notify: the notification has been handed to the remote.

Notifications are small messages that arrive after the data they accompany. Backends
call `NotificationQueue.put` from their own threads, after the bytes of the transfer
have landed (or, for READ, after the reader has them). Each notification is delivered
once: the queue hands every item to exactly one consumer, whether it is drained with
`get_nowait`, awaited through the async iterator, or taken with a blocking `get` from
a thread.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import enum
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from transfer.errors import TransferError

if TYPE_CHECKING:
    from transfer.context import AgentContext, Peer
    from transfer.descriptors import Plan


class TransferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class TransferHandle:
    """Completion of one operation towards `peer`; see the module docstring."""

    __slots__ = (
        "_callbacks", "_claim", "_claimed", "_future", "ended", "nbytes", "op", "peer", "started",
    )  # fmt: skip

    def __init__(self, op: str, peer: str, nbytes: int) -> None:
        self.op = op
        self.peer = peer
        self.nbytes = nbytes
        self.started = time.monotonic()
        self.ended: float | None = None
        self._claim = threading.Lock()
        self._claimed = False
        self._future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._future.set_running_or_notify_cancel()  # a running future cannot be cancelled

    def poll(self) -> TransferState:
        """The current state; never blocks."""
        if not self._future.done():
            return TransferState.PENDING
        return TransferState.FAILED if self._future.exception() else TransferState.DONE

    def done(self) -> bool:
        return self._future.done()

    @property
    def error(self) -> BaseException | None:
        """The failure, once the handle has FAILED; None otherwise."""
        return self._future.exception() if self._future.done() else None

    @property
    def duration(self) -> float | None:
        """Seconds from post to completion, once complete."""
        return None if self.ended is None else self.ended - self.started

    async def wait(self, timeout: float | None = None) -> None:
        """Wait for completion; raise its error if it failed.

        A timeout raises `TimeoutError` and leaves the transfer running: the
        handle still completes later, and the caller decides what to do.
        """
        fut = asyncio.wrap_future(self._future)
        await asyncio.wait_for(asyncio.shield(fut), timeout)

    def result(self, timeout: float | None = None) -> None:
        """Blocking wait for threads and scripts; same errors as `wait`."""
        try:
            self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"{self.op} to {self.peer!r} still pending after {timeout}s"
            ) from None

    def add_done_callback(self, fn: Callable[[TransferHandle], None]) -> None:
        """Call `fn(handle)` on completion, from the completing thread."""
        self._future.add_done_callback(lambda _f: fn(self))

    def set_done(self, first: Callable[[], None] | None = None) -> bool:
        """Complete successfully; False if it had already completed. `first` runs once,
        before any waiter wakes (the agent's counters, so a waiter sees them updated)."""
        return self._finish(None, first)

    def set_failed(self, error: BaseException, first: Callable[[], None] | None = None) -> bool:
        """Complete with `error`; False if it had already completed."""
        return self._finish(error, first)

    def _finish(self, error: BaseException | None, first: Callable[[], None] | None) -> bool:
        with self._claim:  # one completion wins; it alone runs `first`
            if self._claimed:
                return False
            self._claimed = True
        self.ended = time.monotonic()
        if first is not None:
            first()
        if error is None:
            self._future.set_result(None)
        else:
            self._future.set_exception(error)
        return True

    def __repr__(self) -> str:
        state = self.poll().value
        err = f" error={self.error!r}" if isinstance(self.error, TransferError) else ""
        return f"<TransferHandle {self.op} {self.nbytes}B to {self.peer!r} {state}{err}>"


@dataclass(frozen=True)
class Notification:
    peer: str  # the sending agent's name
    incarnation: str  # ... and its incarnation at the time it sent
    payload: bytes
    kind: str  # "write", "read", "notify", or "violation" (a refused use of a grant)
    nbytes: int  # data bytes the transfer moved (0 for a bare notification)
    grant: str | None = None  # the grant it came under, checked (`transfer/context.py`)


class NotificationQueue:
    """Thread-safe FIFO with an async iterator; `close` ends every iteration."""

    def __init__(self) -> None:
        self._items: collections.deque[Notification] = collections.deque()
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._closed = False

    def put(self, item: Notification) -> None:
        with self._cond:
            if self._closed:
                return
            self._items.append(item)
            self._cond.notify()
            self._wake_async()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            self._wake_async()

    def _wake_async(self) -> None:
        waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            if not loop.is_closed():
                loop.call_soon_threadsafe(_resolve, fut)

    def get_nowait(self) -> list[Notification]:
        """Every notification queued so far (possibly none)."""
        with self._cond:
            items = list(self._items)
            self._items.clear()
            return items

    def get(self, timeout: float | None = None) -> Notification | None:
        """Blocking take for threads; None on timeout or once closed and empty."""
        with self._cond:
            self._cond.wait_for(lambda: self._items or self._closed, timeout)
            return self._items.popleft() if self._items else None

    async def next(self) -> Notification:
        """Await the next notification; raises StopAsyncIteration once closed."""
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                if self._items:
                    return self._items.popleft()
                if self._closed:
                    raise StopAsyncIteration
                fut: asyncio.Future[None] = loop.create_future()
                self._waiters.append((loop, fut))
            await fut

    def __aiter__(self) -> AsyncIterator[Notification]:
        return self

    async def __anext__(self) -> Notification:
        return await self.next()

    def __len__(self) -> int:
        return len(self._items)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


_BYTES_COUNTER = {"write": "bytes_written", "read": "bytes_read", "notify": None}


@dataclass(eq=False)
class Op:
    """One WRITE, READ or bare notification towards `peer`."""

    kind: str
    peer: Peer
    plan: Plan | None
    notification: bytes | None
    handle: TransferHandle
    ctx: AgentContext
    xfer_id: int = 0
    grant: str | None = None  # the receiver's write grant it uses (transfer/context.py)
    pins: list[Any] = field(default_factory=list)  # views keeping memory mapped
    extra: dict[str, Any] = field(default_factory=dict)  # backend scratch space

    @property
    def nbytes(self) -> int:
        return 0 if self.plan is None else self.plan.nbytes

    @property
    def info(self) -> dict[str, Any] | None:
        """The frame info a stream backend sends with it."""
        return None if self.grant is None else {"grant": self.grant}

    def succeed(self) -> None:
        # counted before the handle wakes its waiters: one that reads stats sees them
        self.handle.set_done(self._count_done)
        self._release()

    def fail(self, error: BaseException) -> None:
        self.handle.set_failed(error, lambda: self.ctx.stats.inc("transfers_failed"))
        self._release()

    def _count_done(self) -> None:
        self.ctx.stats.inc("transfers_done")
        counter = _BYTES_COUNTER[self.kind]
        if counter:
            self.ctx.stats.inc(counter, self.nbytes)

    def _release(self) -> None:
        # Unpin now rather than at garbage collection, so a closing agent can unmap;
        # a view another thread still exports (a sendmsg returning) unpins later.
        for p in self.pins:
            if isinstance(p, memoryview):
                with contextlib.suppress(BufferError):
                    p.release()
        self.pins.clear()
        self.extra.clear()
