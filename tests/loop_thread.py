"""An asyncio event loop on a daemon thread, for fixtures that must outlive one test.

Tests themselves are ``async def`` (see ``tests/conftest.py``). A module- or
session-scoped fixture that owns async servers cannot live in one test's
``asyncio.run``: it keeps them on a :class:`LoopThread` and its tests reach them
through ``run`` (wait for a result) or ``submit`` (a future to wait on later).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """``run(coro)`` waits up to ``timeout`` seconds (the instance's default unless given)."""

    def __init__(self, name: str = "test-loop", timeout: float = 60.0) -> None:
        self.timeout = timeout
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name=name)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        future = self.submit(coro)
        try:
            return future.result(self.timeout if timeout is None else timeout)
        except concurrent.futures.TimeoutError:  # TimeoutError itself from Python 3.11
            future.cancel()  # do not leave it running behind the next test
            raise

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if not self.thread.is_alive():
            self.loop.close()
