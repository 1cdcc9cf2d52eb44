"""A bound on an HTTP request's head (request line and headers) for uvicorn.

uvicorn's fast parser (httptools) buffers headers of any size: one client sending a
10 MB header costs the server 10 MB, and many such clients exhaust it. :func:`http_protocol`
gives uvicorn a protocol that answers 431 and closes the connection once a request's
head passes ``max_bytes``, before the parser buffers it, or, without httptools,
uvicorn's h11 protocol with its own limit.
"""

from __future__ import annotations

import importlib.util
import json
from typing import Any

HEADER_TOO_LARGE = json.dumps(
    {
        "error": {
            "message": "the request's headers are too large",
            "type": "invalid_request_error",
            "param": None,
            "code": "headers_too_large",
        }
    }
).encode()


def http_protocol(max_bytes: int) -> tuple[Any, dict[str, Any]]:
    """(uvicorn.Config's ``http``, more Config keyword arguments)."""
    if importlib.util.find_spec("httptools") is None:
        return "h11", {"h11_max_incomplete_event_size": max_bytes}
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class BoundedHttpTools(HttpToolsProtocol):
        _in_head = True  # reading a request's head
        _head_bytes = 0  # read since it began
        _tail = b""  # the last 3 bytes read: the head's end may straddle two reads

        def on_headers_complete(self) -> None:
            self._in_head = False
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._in_head, self._head_bytes, self._tail = True, 0, b""

        def data_received(self, data: bytes) -> None:
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
            self.transport.write(
                b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                b"content-type: application/json\r\n"
                b"content-length: " + str(len(HEADER_TOO_LARGE)).encode() + b"\r\n"
                b"connection: close\r\n\r\n" + HEADER_TOO_LARGE
            )
            self.transport.close()

    return BoundedHttpTools, {}
