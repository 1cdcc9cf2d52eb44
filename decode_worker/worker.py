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
from typing import Any

import torch

from decode_worker.config import DecodeWorkerConfig
from decode_worker.handler import DecodeHandler
from decode_worker.metrics import DecodeMetrics
from decode_worker.remote_prefill import RemotePrefill
from engine import AsyncEngine, EngineCore
from engine.tokenizer import Tokenizer
from engine.weights import resolve_model
from runtime.config import make_discovery, make_prefill_queue
from runtime.discovery import DiscoveryOptions, Registration
from runtime.discovery.members import RoleMembers
from runtime.metrics import MetricsServer, serve_metrics
from runtime.queue import QueueOptions
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
        self._closers: list[Any] = []
        self.info: WorkerInfo | None = None
        self.registration: Registration | None = None
        self.metrics_server: MetricsServer | None = None

    async def start(self) -> WorkerInfo:
        cfg = self.config
        self.agent = Agent(
            f"{cfg.worker_id}-{self.incarnation[:8]}",
            backend=cfg.transfer_backend,
            **cfg.transfer_options,
        )
        self._closers.append(self.agent.close)

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
        self.engine = AsyncEngine(self.core)
        self._closers.append(self.engine.close)
        self.engine.add_step_hook(self._after_step)

        self.discovery = make_discovery(
            cfg.discovery_url, DiscoveryOptions(namespace=cfg.namespace)
        )
        await self.discovery.connect()
        self._closers.append(self.discovery.close)
        self.queue = make_prefill_queue(
            cfg.queue_url,
            QueueOptions(
                namespace=cfg.namespace,
                ack_wait=cfg.queue_ack_wait,
                max_deliveries=cfg.queue_max_deliveries,
            ),
        )
        await self.queue.connect()
        self._closers.append(self.queue.close)

        self.prefill_workers = RoleMembers(
            self.discovery, "prefill", on_join=self._add_peer, on_leave=self._drop_peer
        )
        self.prefill_workers.start()
        self._closers.append(self.prefill_workers.close)

        name = cfg.served_model_name or self.core.source.name
        kv_layout = KvLayout(
            block_size=layout.block_size,
            num_blocks=layout.num_blocks,
            num_layers=layout.num_layers,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
            dtype=layout.dtype,
            layout_hash=layout.layout_hash,
        )
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
        self._closers.append(self.remote.close)
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
            kv_layout=kv_layout,
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
        for close in reversed(self._closers):
            try:
                result = close()
                if asyncio.iscoroutine(result):
                    await result
            except Exception:
                log.exception("shutting down %s failed", close)
        self._closers = []

    # -- hooks --------------------------------------------------------------------

    def _add_peer(self, info: WorkerInfo) -> None:
        if info.transfer is None:
            return
        try:
            self.agent.add_remote(
                info.transfer.metadata, expect_layout=self.core.layout.layout_hash
            )
        except Exception as e:  # layout mismatch, malformed metadata...
            log.warning("not accepting KV from prefill worker %s: %s", info.worker_id, e)

    def _drop_peer(self, info: WorkerInfo) -> None:
        if info.transfer is not None:
            with contextlib.suppress(Exception):
                self.agent.remove_remote(info.transfer.agent_name)

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
