"""One Diptych worker (decode or prefill) inside a Ray actor: what the planner's Ray
connector (`planner.connectors.ray`) creates and stops.

    WorkerActor.options(name="diptych-decode-3", num_gpus=1).remote(
        "decode", "decode-3", ["--engine", "sim", "--etcd", "10.0.0.2:2379"])

The actor takes the flags of `diptych decode|prefill` (parsed by the same CLI, so a
fleet on Ray is configured as one started by hand) and runs the worker on an event
loop of its own thread: `start` returns once the worker is registered in discovery,
`stop` drains it (leave discovery, finish what it holds, `--drain-timeout`) and
shuts it down, after which the connector kills the actor.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections.abc import Coroutine
from typing import TYPE_CHECKING, TypeVar

from decode_worker.config import DecodeWorkerConfig
from prefill_worker.config import PrefillWorkerConfig
from runtime import event_loop

if TYPE_CHECKING:
    from decode_worker.worker import DecodeWorker
    from prefill_worker.worker import PrefillWorker

R = TypeVar("R")


class WorkerActor:
    def __init__(self, role: str, worker_id: str, flags: list[str]) -> None:
        from diptych import options
        from diptych.cli import build_parser

        if role not in ("decode", "prefill"):
            raise ValueError(f"a Ray worker is a decode or prefill worker, not {role!r}")
        args = build_parser().parse_args([role, *flags, "--worker-id", worker_id])
        self.role, self.worker_id = role, worker_id
        self.config: DecodeWorkerConfig | PrefillWorkerConfig = (
            options.decode_config(args) if role == "decode" else options.prefill_config(args)
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._worker: DecodeWorker | PrefillWorker | None = None

    def _run(self, coro: Coroutine[object, object, R], timeout: float | None) -> R:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def start(self, timeout: float = 300.0) -> dict[str, object]:
        """Start the worker; returns once it serves (registered in discovery)."""
        if isinstance(self.config, DecodeWorkerConfig):
            from decode_worker.worker import DecodeWorker

            self._worker = DecodeWorker(self.config)
        else:
            from prefill_worker.worker import PrefillWorker

            self._worker = PrefillWorker(self.config)
        factory = event_loop.loop_factory() or asyncio.new_event_loop
        self._loop = factory()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"diptych-{self.worker_id}", daemon=True
        )
        self._thread.start()
        info = self._run(self._worker.start(), timeout)
        return {
            "worker_id": info.worker_id,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "metrics": info.metrics_address,
        }

    def stop(self) -> bool:
        """Drain and shut the worker down (bounded by its drain timeout)."""
        if self._worker is None or self._loop is None:
            return False
        try:
            self._run(self._worker.stop(), self.config.drain_timeout + 30.0)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread is not None:
                self._thread.join(timeout=10)
        return True

    def ping(self) -> str:
        return self.worker_id
