"""Noticing that the HTTP client went away, and cancelling the work done for it.

An ASGI server reports a disconnect as an ``http.disconnect`` message on ``receive``
once the request body has been read. Nothing else reads ``receive`` after that, so
the frontend waits on it beside the work of a request: whichever ends first wins, and
a disconnect cancels the work (whose cleanup cancels the gRPC stream, which aborts the
request on the worker). This does not depend on a send failing, so a client that
leaves during a long prefill or a queue wait is noticed at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from starlette.types import Receive

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before the response was complete."""


async def wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """``await work``, unless the client disconnects first: then cancel it (and wait for
    its cleanup) and raise :class:`ClientDisconnected`."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        # Also when we are cancelled ourselves: nothing may outlive the request.
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        watcher.cancel()
        with contextlib.suppress(BaseException):
            await watcher
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()
