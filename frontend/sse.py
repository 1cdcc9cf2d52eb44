"""Server-sent events, and noticing that the HTTP client went away.

``data: {json}`` frames (`encode`, `DONE`) and :class:`EventStreamResponse`, a response
that stops on disconnect. Starlette's ``StreamingResponse`` notices a client that went
away only when a write fails (ASGI 2.4 servers such as uvicorn), so a request waiting
for its next token would run on. :class:`EventStreamResponse` also waits on
``http.disconnect`` and then cancels the event iterator at once; its cleanup cancels
the request on the worker. ``on_close`` runs however the response ends, even if the
iterator never started.

An ASGI server reports a disconnect as an ``http.disconnect`` message on ``receive``
once the request body has been read. Nothing else reads ``receive`` after that, so
the frontend waits on it beside the work of a request (`until_disconnect`, for a
non-streamed response or the wait for the first token): whichever ends first wins, and
a disconnect cancels the work (whose cleanup cancels the gRPC stream, which aborts the
request on the worker). This does not depend on a send failing, so a client that
leaves during a long prefill or a queue wait is noticed at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

import orjson
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"


def encode(data: Mapping[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"  # compact UTF-8, as json.dumps would


class EventStreamResponse(Response):
    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncGenerator[bytes, None],
        headers: Mapping[str, str] | None = None,
        on_disconnect: Callable[[], None] | None = None,
        on_close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.events = events
        self.status_code = 200
        self.background = None
        self._on_disconnect = on_disconnect
        self._on_close = on_close
        self.init_headers(
            {"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})}
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self._stream(send))
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait({stream, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, watcher):
                if not task.done():
                    task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            if self._on_close is not None:  # also if the stream never started
                await asyncio.shield(self._on_close())
        error = None if stream.cancelled() else stream.exception()
        if stream.cancelled() or isinstance(error, OSError):  # a write failed: gone too
            if self._on_disconnect is not None:
                self._on_disconnect()
        elif error is not None:
            raise error

    async def _stream(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        async with contextlib.aclosing(self.events) as events:
            async for frame in events:
                await send({"type": "http.response.body", "body": frame, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


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
