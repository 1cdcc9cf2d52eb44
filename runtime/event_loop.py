"""The event loop a Diptych process runs on: uvloop where it is installed.

uvloop (libuv under asyncio's API) roughly halves the event loop's own cost per
callback, which is most of what a frontend streaming tens of thousands of SSE events
per second spends outside its own code. grpc.aio, uvicorn and nats-py all run on it.
``DIPTYCH_UVLOOP=0`` falls back to the standard loop (to compare, or to debug).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop factory, or None for asyncio's default loop."""
    if os.environ.get("DIPTYCH_UVLOOP", "1") == "0":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on the loop `loop_factory` picks."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)
