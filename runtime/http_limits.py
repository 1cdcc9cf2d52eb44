"""Bounds on HTTP connections for uvicorn: a request head's size and time, and a cap on
connections.

uvicorn's fast parser (httptools) buffers headers of any size: one client sending a
10 MB header costs the server 10 MB, and many such clients exhaust it. Nor does it time a
head: 2,000 clients sending a header byte now and then, or nothing at all, held 2,000
connections for as long as they liked (its keep-alive timeout starts after a response).
:func:`http_protocol` gives uvicorn a protocol that

* answers 431 and closes the connection once a request's head passes ``max_bytes``,
  before the parser buffers it;
* answers 408 and closes a connection whose request head (from its first byte, or from
  the connection's start for the first request) is not complete within
  ``header_timeout_s``: a slow or idle client holds a connection that long, no longer;
* answers 429 with Retry-After and closes a new connection while ``max_connections``
  are open.

Without httptools it falls back to uvicorn's h11 protocol, which bounds the head's size
only.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from typing import Any

HEADER_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 4096


def _error(code: str, message: str) -> bytes:
    """An OpenAI-style error body, written before the app sees the request."""
    body = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    return json.dumps({"error": body}).encode()


HEADER_TOO_LARGE = _error("headers_too_large", "the request's headers are too large")
_TOO_SLOW = _error("request_timeout", "the request's head did not arrive in time")
_TOO_MANY = _error("too_many_connections", "this server has too many open connections")


def http_protocol(
    max_bytes: int,
    header_timeout_s: float = HEADER_TIMEOUT_S,
    max_connections: int = MAX_CONNECTIONS,
) -> tuple[Any, dict[str, Any]]:
    """(uvicorn.Config's ``http``, more Config keyword arguments)."""
    if importlib.util.find_spec("httptools") is None:
        return "h11", {"h11_max_incomplete_event_size": max_bytes}
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class BoundedHttpTools(HttpToolsProtocol):
        _in_head = True  # reading a request's head
        _head_bytes = 0  # read since it began
        _tail = b""  # the last 3 bytes read: the head's end may straddle two reads
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self.logger.info("refused a connection: %d are open", max_connections)
                self._answer(b"429 Too Many Requests", _TOO_MANY, b"retry-after: 1\r\n")
                return
            self._time_head()

        def connection_lost(self, exc: Exception | None) -> None:
            self._untime_head()
            super().connection_lost(exc)

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._untime_head()
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._in_head, self._head_bytes, self._tail = True, 0, b""

        def _time_head(self) -> None:
            self._untime_head()
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_late)

        def _untime_head(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_late(self) -> None:
            self._head_timer = None
            if self._in_head and not self.transport.is_closing():
                self.logger.info("closed a connection: no request head in %g s", header_timeout_s)
                self._answer(b"408 Request Timeout", _TOO_SLOW)

        def _answer(self, status: bytes, body: bytes, extra: bytes = b"") -> None:
            self.transport.write(
                b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n" + extra
                + b"content-length: " + str(len(body)).encode() + b"\r\n"
                b"connection: close\r\n\r\n" + body
            )  # fmt: skip
            self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self._in_head and self._head_bytes == 0 and self._head_timer is None:
                self._time_head()  # the next request's head starts: it has the same time
            if self._in_head:
                room = max_bytes - self._head_bytes
                if len(data) > room:  # unless the head ends within the room left
                    end = (self._tail + data).find(b"\r\n\r\n")
                    if end < 0 or end + 4 - len(self._tail) > room:
                        self._refuse()
                        return
                self._head_bytes += len(data)
                self._tail = data[-3:]
            super().data_received(data)

        def _refuse(self) -> None:
            self.logger.info("refused a request whose head exceeds %d bytes", max_bytes)
            self._answer(b"431 Request Header Fields Too Large", HEADER_TOO_LARGE)

    return BoundedHttpTools, {}
