"""Running the frontend: uvicorn on a socket bound here, so port 0 works and is reported.

    run(FrontendConfig(discovery_url="etcd://10.0.0.2:2379", port=8000))   # the CLI

or, inside an event loop::

    server = FrontendServer(config)
    address = await server.start()     # "127.0.0.1:41234"
    ...
    await server.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

import uvicorn
from fastapi import FastAPI

from frontend.app import create_app
from frontend.config import FrontendConfig
from runtime import event_loop

log = logging.getLogger(__name__)


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot bind the frontend to {host}:{port}: {e.strerror}") from None
    return sock


class FrontendServer:
    def __init__(self, config: FrontendConfig, app: FastAPI | None = None) -> None:
        self.config = config
        self.app = app if app is not None else create_app(config)
        self.address = ""
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self, timeout: float = 60.0) -> str:
        """Bind, run the app's startup, and serve; returns ``host:port`` as bound."""
        sock = bind_socket(self.config.host, self.config.port)
        host, port = sock.getsockname()[:2]
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        uv_config = uvicorn.Config(
            self.app,
            log_level=self.config.log_level,
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=5,
        )
        self._server = server = uvicorn.Server(uv_config)
        self._task = asyncio.create_task(server.serve(sockets=[sock]), name="frontend-http")
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while not server.started:
            if self._task.done() or loop.time() > end:
                await self.stop()
                sock.close()
                raise RuntimeError(f"the frontend did not start on {self.address}")
            await asyncio.sleep(0.02)
        log.info("frontend listening on http://%s", self.address)
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
            await asyncio.wait_for(asyncio.shield(task), 10.0)
        except asyncio.TimeoutError:
            server.force_exit = True
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(task, 5.0)
        self._server = self._task = None


async def serve_frontend(config: FrontendConfig, app: FastAPI | None = None) -> None:
    """Serve until cancelled or until SIGINT/SIGTERM (uvicorn's handlers, main thread)."""
    server = FrontendServer(config, app)
    await server.start()
    try:
        await server.wait()
    finally:
        await server.stop()


def run(config: FrontendConfig) -> None:
    """The blocking entry point of ``diptych frontend``."""
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    event_loop.run(serve_frontend(config))
