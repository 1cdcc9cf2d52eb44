"""Stopping background tasks reliably.

On Python < 3.12, ``asyncio.wait_for`` can swallow a cancellation that arrives just as its
inner call completes (bpo-42130); a looping background task then keeps running and an
``await task`` after ``task.cancel()`` never returns. :func:`cancel_and_wait` cancels
again until the task really ends, with a bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

log = logging.getLogger(__name__)


async def cancel_and_wait(task: asyncio.Task[object] | None, timeout: float = 5.0) -> None:
    if task is None or task.done():
        return
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait({task}, timeout=min(0.05, max(0.0, end - loop.time())))
        if loop.time() >= end and not task.done():
            log.error("task %s did not stop within %.1fs", task.get_name(), timeout)
            return
    with contextlib.suppress(asyncio.CancelledError, Exception):
        task.result()
