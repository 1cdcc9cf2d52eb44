"""A decode worker process: engine + transfer agent + gRPC server + discovery record.

Start-up order matters for the invariants: the KV pool is allocated through the
transfer agent (so prefill workers can write into it) before the engine exists;
the worker follows the prefill pool (only registered prefill agents may write) and
subscribes to its dead letters before it publishes anything; it registers in
discovery last, once it can serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import torch

from decode_worker.config import DecodeWorkerConfig
from decode_worker.handler import DecodeHandler
from decode_worker.metrics import DecodeMetrics
from decode_worker.remote_prefill import RemotePrefill
from engine import AsyncEngine, EngineCore
from engine.tokenizer import Tokenizer
from engine.weights import resolve_model
from runtime.config import open_control_plane
from runtime.discovery import Registration
from runtime.discovery.members import transfer_peers
from runtime.metrics import MetricsServer, serve_metrics
from runtime.rpc.events import KvEventPublisher
from runtime.rpc.server import DecodeWorkerServer
from runtime.worker_info import KvLayout, TransferInfo, WorkerInfo, new_incarnation_id
from transfer import Agent

log = logging.getLogger(__name__)


class DecodeWorker:
    def __init__(self, config: DecodeWorkerConfig) -> None:
        self.config = config
        self.incarnation = new_incarnation_id()
        self.metrics = DecodeMetrics()
        self._stack = contextlib.AsyncExitStack()
        self.info: WorkerInfo | None = None
        self.registration: Registration | None = None
        self.metrics_server: MetricsServer | None = None

    async def start(self) -> WorkerInfo:
        cfg = self.config
        stack = self._stack
        self.agent = Agent(
            f"{cfg.worker_id}-{self.incarnation[:8]}",
            backend=cfg.transfer_backend,
            **cfg.transfer_options,
        )
        stack.callback(self.agent.close)

        def allocate(nbytes: int) -> torch.Tensor:
            self.pool = self.agent.allocate(nbytes)
            return self.pool.tensor()

        source = resolve_model(cfg.engine.model)
        eos = Tokenizer.from_source(source).eos_token_ids
        self.core = await asyncio.to_thread(
            EngineCore, cfg.engine, kv_allocator=allocate, eos_token_ids=eos
        )
        layout = self.core.layout
        self.agent.layout = layout.layout_hash
        self.core.kv.pool.record_events = True
        self.events = KvEventPublisher(self.incarnation)
        self.metrics.kernels.info(self.core.runner.kernel_paths())
        self.engine = AsyncEngine(self.core)
        stack.callback(self.engine.close)
        self.engine.add_step_hook(self._after_step)

        self.discovery, self.queue = await open_control_plane(
            cfg.discovery_url,
            cfg.queue_url,
            namespace=cfg.namespace,
            queue_options={
                "ack_wait": cfg.queue_ack_wait,
                "max_deliveries": cfg.queue_max_deliveries,
            },
        )
        stack.push_async_callback(self.discovery.close)
        stack.push_async_callback(self.queue.close)
        # only registered prefill workers' agents may write into this pool
        self.prefill_workers = transfer_peers(
            self.discovery,
            "prefill",
            lambda md: self.agent.add_remote(md, expect_layout=layout.layout_hash),
            self.agent.remove_remote,
        )
        self.prefill_workers.start()
        stack.push_async_callback(self.prefill_workers.close)

        name = cfg.served_model_name or self.core.source.name
        draft = WorkerInfo(cfg.worker_id, "decode", name, incarnation_id=self.incarnation)
        self.remote = RemotePrefill(
            self.engine,
            self.queue,
            self.agent,
            cfg,
            draft,
            layout.layout_hash,
            self.prefill_workers,
            self.metrics,
        )
        self.remote.start_loops()
        stack.push_async_callback(self.remote.close)
        self.handler = DecodeHandler(
            self.engine,
            self.remote,
            self.events,
            self.metrics,
            cfg.worker_id,
            self.incarnation,
            cfg.min_remote_prefill_tokens,
        )
        self.server = DecodeWorkerServer(self.handler, f"{cfg.host}:{cfg.port}")
        address = await self.server.start()
        metrics_address = ""
        if cfg.metrics_port is not None:
            self.metrics_server = serve_metrics(self.metrics.registry, cfg.host, cfg.metrics_port)
            metrics_address = self.metrics_server.address
        self.info = WorkerInfo(
            cfg.worker_id,
            "decode",
            name,
            incarnation_id=self.incarnation,
            grpc_address=address,
            metrics_address=metrics_address,
            transfer=TransferInfo(self.agent.backends[0], self.agent.name, self.agent.metadata()),
            kv_layout=KvLayout.from_dict({**layout.to_dict(), "layout_hash": layout.layout_hash}),
            extra={"max_model_len": self.core.max_model_len, "kv_region": self.pool.id},
        )
        self.registration = await self.discovery.register(self.info)
        log.info("decode worker %s serving at %s", cfg.worker_id, address)
        return self.info

    async def stop(self, grace: float = 5.0) -> None:
        """Leave discovery, let running streams finish for `grace` s, then shut down."""
        if self.registration is not None:
            with contextlib.suppress(Exception):
                await self.registration.close()
        if hasattr(self, "handler"):
            self.handler.draining = True
        if hasattr(self, "server"):
            await self.server.stop(grace)
        if self.metrics_server is not None:
            self.metrics_server.close()
        await self._stack.aclose()

    # -- hooks --------------------------------------------------------------------

    def _after_step(self, core: EngineCore) -> None:
        """On the engine thread after each step: KV events and load figures."""
        for kind, hashes in core.kv.pool.drain_events():
            if kind == "stored":
                self.events.stored(hashes)
            else:
                self.events.removed(hashes)
        m = self.metrics
        s = core.scheduler
        m.running.set(len(s.running))
        m.waiting.set(len(s.waiting))
        m.remote_waiting.set(len(s.remote_waiting))
        m.kv_usage.set(core.kv.usage)
        m.prefix_hit_rate.set(s.prefix_hit_tokens / max(s.prefix_queried_tokens, 1))
        self.events.update_load(self.handler.load())
