"""Running the frontend: uvicorn on a socket bound here, so port 0 works and is reported.

    run(FrontendConfig(discovery_url="etcd://10.0.0.2:2379", port=8000))   # the CLI

or, inside an event loop::

    server = FrontendServer(config)
    address = await server.start()     # "127.0.0.1:41234"
    ...
    await server.stop()
"""

from __future__ import annotations

import logging

from fastapi import FastAPI

from frontend.app import create_app
from frontend.config import FrontendConfig
from runtime import event_loop
from runtime.asgi_server import AsgiServer


class FrontendServer(AsgiServer):
    def __init__(self, config: FrontendConfig, app: FastAPI | None = None) -> None:
        self.config = config
        app = app if app is not None else create_app(config)
        super().__init__(
            app, config.host, config.port, name="frontend", log_level=config.log_level,
            tls_certfile=config.tls_certfile, tls_keyfile=config.tls_keyfile,
            max_header_bytes=config.max_header_bytes, drain_timeout=config.drain_timeout_s,
        )  # fmt: skip


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
