"""The OpenAI-compatible HTTP edge: tokenize, route, stream, detokenize, cancel.

    from frontend import FrontendConfig, run
    run(FrontendConfig(discovery_url="embedded", port=8000))

* :class:`FrontendConfig` -> :func:`create_app` (a FastAPI app) -> :func:`serve_frontend`
  / :func:`run` (uvicorn), or :class:`FrontendServer` inside a running loop.
* Routing: :class:`Router` (``select`` over :class:`WorkerView`, optional worker events),
  :class:`LeastLoadedRouter` by default; :class:`WorkerPool` follows discovery.

Names load their module on first use, so importing one does not pull in FastAPI.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from frontend.app import create_app
    from frontend.config import FrontendConfig
    from frontend.router import LeastLoadedRouter, Router, RouteRequest, WorkerView
    from frontend.server import FrontendServer, run, serve_frontend
    from frontend.workers import WorkerPool

_MODULE_OF = {
    "FrontendConfig": "frontend.config",
    "create_app": "frontend.app",
    "FrontendServer": "frontend.server",
    "serve_frontend": "frontend.server",
    "run": "frontend.server",
    "Router": "frontend.router",
    "LeastLoadedRouter": "frontend.router",
    "RouteRequest": "frontend.router",
    "WorkerView": "frontend.router",
    "WorkerPool": "frontend.workers",
}

__all__ = [
    "FrontendConfig",
    "FrontendServer",
    "LeastLoadedRouter",
    "RouteRequest",
    "Router",
    "WorkerPool",
    "WorkerView",
    "create_app",
    "run",
    "serve_frontend",
]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'frontend' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
