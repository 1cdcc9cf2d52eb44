"""Server-sent events: ``data: {json}`` frames and a response that stops on disconnect.

Starlette's ``StreamingResponse`` notices a client that went away only when a write
fails (ASGI 2.4 servers such as uvicorn), so a request waiting for its next token would
run on. :class:`EventStreamResponse` also waits on ``http.disconnect`` and then cancels
the event iterator at once; its cleanup cancels the request on the worker.
``on_close`` runs however the response ends, even if the iterator never started.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from frontend.disconnect import wait_for_disconnect

DONE = b"data: [DONE]\n\n"


def encode(data: Mapping[str, Any]) -> bytes:
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return b"data: " + text.encode() + b"\n\n"


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
