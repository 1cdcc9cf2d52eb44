"""Notifications: small messages that arrive after the data they accompany.

Backends call `NotificationQueue.put` from their own threads, after the bytes
of the transfer have landed (or, for READ, after the reader has them). Each
notification is delivered once: the queue hands every item to exactly one
consumer, whether it is drained with `get_nowait`, awaited through the async
iterator, or taken with a blocking `get` from a thread.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Notification:
    peer: str  # the sending agent's name
    incarnation: str  # ... and its incarnation at the time it sent
    payload: bytes
    kind: str  # "write", "read", "notify", or "violation" (a refused use of a grant)
    nbytes: int  # data bytes the transfer moved (0 for a bare notification)
    grant: str | None = None  # the grant it came under, checked (`transfer/grants.py`)


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
