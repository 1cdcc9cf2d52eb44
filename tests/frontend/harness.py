"""A frontend with test decode workers, run on an event loop in a background thread.

Tests are plain functions that talk HTTP (the ``openai`` client, ``httpx``) to the
frontend, like any client would; :class:`Cluster` starts, kills and registers workers
on the background loop. Workers share one engine (the model is loaded once per session);
each has its own gRPC server on a free loopback port and its own record in an
embedded discovery store in a temporary directory.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from engine import LLM, AsyncEngine
from frontend.app import create_app
from frontend.config import FrontendConfig
from frontend.router import Router
from frontend.server import FrontendServer
from runtime.config import make_discovery
from runtime.discovery import Discovery, DiscoveryOptions, Registration
from runtime.rpc import DecodeWorkerServer
from runtime.worker_info import WorkerInfo
from tests.frontend.worker import EngineHandler
from tests.loop_thread import LoopThread

NAMESPACE = "fe-test"


@dataclass
class ServedWorker:
    worker_id: str
    handler: EngineHandler
    server: DecodeWorkerServer
    registration: Registration | None = None
    address: str = ""


@dataclass
class Cluster:
    llm: LLM
    engine: AsyncEngine
    loop: LoopThread
    state_dir: Path
    workers: dict[str, ServedWorker] = field(default_factory=dict)
    frontend: FrontendServer | None = None
    discovery: Discovery | None = None

    # -- workers ---------------------------------------------------------------------------
    def add_worker(self, worker_id: str, *, register: bool = True, **extra: Any) -> ServedWorker:
        return self.loop.run(self._add_worker(worker_id, register, extra))

    async def _discovery(self) -> Discovery:
        if self.discovery is None:
            self.discovery = make_discovery(
                f"embedded:{self.state_dir}",
                DiscoveryOptions(namespace=NAMESPACE, ttl=30.0, poll_interval=0.02),
            )
            await self.discovery.connect()
        return self.discovery

    async def _add_worker(
        self, worker_id: str, register: bool, extra: dict[str, Any]
    ) -> ServedWorker:
        await self._discovery()
        handler = EngineHandler(self.engine, worker_id)
        server = DecodeWorkerServer(handler, "127.0.0.1:0")
        address = await server.start()
        worker = ServedWorker(worker_id, handler, server, address=address)
        self.workers[worker_id] = worker
        if register:
            await self._register(worker, extra)
        return worker

    async def _register(self, worker: ServedWorker, extra: dict[str, Any]) -> None:
        assert self.discovery is not None
        info = WorkerInfo(
            worker.worker_id,
            "decode",
            self.llm.tokenizer.name,
            incarnation_id=worker.handler.incarnation_id,
            grpc_address=worker.address,
            # a test may give max_model_len=None: a worker that states no context window
            max_model_len=extra.pop("max_model_len", self.llm.engine.max_model_len),
            extra=extra,
        )
        worker.registration = await self.discovery.register(info)

    def register_dead_worker(self, worker_id: str) -> None:
        """A record whose address has no server: what a crashed worker leaves behind."""

        async def go() -> None:
            info = WorkerInfo(worker_id, "decode", "m", grpc_address=f"127.0.0.1:{free_port()}")
            await (await self._discovery()).register(info)

        self.loop.run(go())

    def kill_worker(self, worker_id: str, unregister: bool = False) -> None:
        """Stop the worker's server at once (its streams fail UNAVAILABLE); its discovery
        record stays, as a crashed process's does until the lease expires."""
        worker = self.workers[worker_id]

        async def go() -> None:
            await worker.server.stop(0)
            if unregister and worker.registration is not None:
                await worker.registration.close()
                worker.registration = None

        self.loop.run(go())

    def unregister(self, worker_id: str) -> None:
        worker = self.workers[worker_id]
        if worker.registration is not None:
            self.loop.run(worker.registration.close())
            worker.registration = None

    # -- frontend ----------------------------------------------------------------------------
    def start_frontend(self, router: Router | None = None, **config: Any) -> str:
        config.setdefault("worker_cooldown_s", 5.0)
        cfg = FrontendConfig(
            discovery_url=f"embedded:{self.state_dir}",
            namespace=NAMESPACE,
            host="127.0.0.1",
            port=0,
            discovery_poll_s=0.02,
            log_level="warning",
            **config,
        )

        async def go() -> str:
            app = create_app(cfg, tokenizer=self.llm.tokenizer, router=router)
            self.frontend = FrontendServer(cfg, app)
            return await self.frontend.start()

        return self.loop.run(go())

    @property
    def base_url(self) -> str:
        assert self.frontend is not None
        return f"http://{self.frontend.address}"

    def wait_ready(self, workers: int = 1, timeout: float = 10.0) -> None:
        wait_until(lambda: self.ready_workers() >= workers, timeout, f"{workers} workers ready")

    def ready_workers(self) -> int:
        r = httpx.get(f"{self.base_url}/ready", timeout=5)
        return int(r.json()["decode_workers"]) if r.status_code == 200 else 0

    def close(self) -> None:
        async def go() -> None:
            if self.frontend is not None:
                await self.frontend.stop()
            for w in self.workers.values():
                await w.server.stop(0)
            if self.discovery is not None:
                await self.discovery.close()

        self.loop.run(go())

    # -- the engine --------------------------------------------------------------------------
    def engine_idle(self) -> bool:
        return self.engine.inspect(lambda core: core.is_idle()).result(10)

    def assert_engine_clean(self, timeout: float = 10.0) -> None:
        wait_until(self.engine_idle, timeout, "the engine to go idle")
        problems = self.engine.inspect(lambda core: core.check_invariants()).result(10)
        assert problems == [], problems


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
