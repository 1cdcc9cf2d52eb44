"""An ASGI app under uvicorn on a socket bound here, so port 0 works and the address
bound is known before the first request (the frontend, the planner's dashboard).

    server = AsgiServer(app, "127.0.0.1", 0, name="frontend")
    address = await server.start()     # "127.0.0.1:41234"
    ...
    await server.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
from typing import Any

import uvicorn

from runtime.http_limits import HEADER_TIMEOUT_S, MAX_CONNECTIONS, http_protocol

log = logging.getLogger(__name__)


def bind_socket(host: str, port: int, name: str = "server") -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot bind the {name} to {host}:{port}: {e.strerror}") from None
    return sock


class AsgiServer:
    def __init__(
        self,
        app: Any,
        host: str,
        port: int,
        *,
        name: str = "server",
        log_level: str = "info",
        tls_certfile: str | None = None,
        tls_keyfile: str | None = None,
        max_header_bytes: int = 64 * 1024,
        header_timeout_s: float = HEADER_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
        drain_timeout: float = 5.0,
    ) -> None:
        self.app = app
        self.host, self.port, self.name, self.log_level = host, port, name, log_level
        self.tls_certfile, self.tls_keyfile = tls_certfile, tls_keyfile
        self.scheme = "https" if tls_certfile else "http"
        self.max_header_bytes = max_header_bytes
        self.header_timeout_s, self.max_connections = header_timeout_s, max_connections
        # on stop: no new connections, and requests in flight get this long to finish
        self.drain_timeout = drain_timeout
        self.address = ""
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self, timeout: float = 60.0) -> str:
        """Bind, run the app's startup, and serve; returns ``host:port`` as bound."""
        sock = bind_socket(self.host, self.port, self.name)
        host, port = sock.getsockname()[:2]
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        http, http_options = http_protocol(
            self.max_header_bytes, self.header_timeout_s, self.max_connections
        )
        uv_config = uvicorn.Config(
            self.app,
            http=http,
            **http_options,
            log_level=self.log_level,
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=math.ceil(self.drain_timeout),
            ssl_certfile=self.tls_certfile,
            ssl_keyfile=self.tls_keyfile,
        )
        self._server = server = uvicorn.Server(uv_config)
        self._task = asyncio.create_task(server.serve(sockets=[sock]), name=f"{self.name}-http")
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while not server.started:
            if self._task.done() or loop.time() > end:
                await self.stop()
                sock.close()
                raise RuntimeError(f"the {self.name} did not start on {self.address}")
            await asyncio.sleep(0.02)
        log.info("%s listening on %s://%s", self.name, self.scheme, self.address)
        return self.address

    async def wait(self) -> None:
        if self._task is not None:
            await asyncio.shield(self._task)

    async def stop(self) -> None:
        server, task = self._server, self._task
        if server is None or task is None:
            return
        server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(task), self.drain_timeout + 5.0)
        except asyncio.TimeoutError:
            server.force_exit = True
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(task, 5.0)
        self._server = self._task = None
