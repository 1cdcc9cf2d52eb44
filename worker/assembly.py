"""What every worker process is made of, started in the order the invariants need.

    transfer agent      named for this incarnation
    KV pool             allocated through the agent (shared or RDMA-registered memory),
                        so peers can write into it, and handed to the engine: one
                        region a tensor-parallel rank (shared memory the rank's
                        process maps), so the agent reaches every rank's heads
    engine              EngineCore on its own thread, behind AsyncEngine
    control plane       discovery and the prefill queue
    peers               the other role's workers, followed through discovery: only a
                        registered agent whose published KV layout matches ours may
                        exchange KV with us
    metrics             the Prometheus endpoint
    registration        last, by the role, once it can serve (`register`)

Shutting down is the reverse: `leave` (out of discovery first, so nothing new arrives),
the role drains what it holds, then `close`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import torch

from engine.async_engine import AsyncEngine
from engine.engine_core import EngineCore
from engine.kv_cache.layout import PoolMemory
from engine.tokenizer import Tokenizer
from engine.weights import resolve_model
from runtime.config import open_control_plane
from runtime.discovery import Discovery, Registration
from runtime.discovery.members import RoleMembers, transfer_peers
from runtime.metrics import MetricsServer, serve_metrics
from runtime.queue import PrefillQueue
from runtime.tracing import open_tracer
from runtime.worker_info import (
    DETERMINISTIC_KEY,
    LORA_RANK_KEY,
    TransferInfo,
    WorkerInfo,
    new_incarnation_id,
)
from transfer import Agent, Region
from worker.config import WorkerConfig
from worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)

PEER_ROLE = {"decode": "prefill", "prefill": "decode"}


class WorkerRuntime:
    """One worker's agent, KV pool, engine, control plane, peers and metrics endpoint.

    The attributes exist once `start()` has returned.
    """

    agent: Agent
    pools: list[Region]  # the KV pool's regions, a tensor-parallel rank's each
    core: EngineCore
    engine: AsyncEngine
    discovery: Discovery
    queue: PrefillQueue
    peers: RoleMembers

    def __init__(
        self, config: WorkerConfig, role: str, metrics: WorkerMetrics, *, moves_kv: bool = True
    ) -> None:
        """`moves_kv`: the role hands KV to or takes it from the other role's workers
        (a decode worker that prefills every prompt itself does not)."""
        self.config = config
        self.role = role
        self.moves_kv = moves_kv
        self.metrics = metrics
        self.incarnation = new_incarnation_id()
        self.metrics_address = ""
        self._stack = contextlib.AsyncExitStack()
        self._metrics_server: MetricsServer | None = None
        self._registration: Registration | None = None
        # spans of the requests this worker serves (runtime/tracing.py; off by default)
        self.tracer = open_tracer(
            config.otlp_endpoint, f"diptych-{role}", instance=config.worker_id
        )

    async def start(self) -> None:
        cfg, stack = self.config, self._stack
        self.agent = Agent(
            f"{cfg.worker_id}-{self.incarnation[:8]}",
            backend=cfg.transfer_backend,
            **{"host": cfg.host, "advertise_host": cfg.advertise_host, **cfg.transfer_options},
        )
        stack.callback(self.agent.close)
        self.metrics.watch_transfer(self.agent.stats)

        self.pools = []
        split = cfg.engine.tensor_parallel_size > 1
        device = cfg.engine.torch_device()

        def allocate(nbytes: int, rank: int) -> PoolMemory | None:
            if device.type != "cpu":  # device memory, registered (the nixl backend)
                if rank:  # another GPU's process: it needs an agent of its own (not yet)
                    return None
                memory = torch.zeros(nbytes, dtype=torch.uint8, device=device)
                region = self.agent.register(memory)
            else:  # shared memory when the other ranks' processes map it
                region = self.agent.allocate(nbytes, shared=split)
            # peers write KV only into blocks reserved for them (transfer/context.py)
            self.agent.guard(region)
            self.pools.append(region)
            path = self.agent.shared_path(region) if split and region.is_host else None
            return PoolMemory(region.tensor(), path)

        eos = Tokenizer.from_source(resolve_model(cfg.engine.model)).eos_token_ids
        self.core = await asyncio.to_thread(
            EngineCore, cfg.engine, kv_allocator=allocate, eos_token_ids=eos
        )
        ranks = self.core.layout.tp_size
        if self.moves_kv and len(self.pools) != ranks:
            self.core.close()
            raise ValueError(
                f"this {self.role} worker's KV pool is split over {ranks} ranks and only "
                f"{len(self.pools)} of their pools are reachable by transfer (ranks on "
                "other hosts, or on GPUs, where an agent a rank is not built yet): run it "
                "aggregated (a decode worker with --no-remote-prefill, no prefill pool)"
            )
        # what peers compare: the unsplit pool's hash, whatever either side's TP size
        self.kv_format = self.core.layout.format_hash
        self.agent.layout = self.kv_format
        self.metrics.kernels.info(self.core.runner.kernel_paths())
        self.engine = AsyncEngine(self.core)
        stack.callback(self.engine.close)
        # read when scraped, from the snapshot the engine thread publishes after each step
        engine = self.engine
        self.metrics.kv_used_blocks.set_function(lambda: engine.snapshot.kv_used_blocks)
        self.metrics.kv_total_blocks.set(engine.snapshot.kv_total_blocks)
        self.metrics.prefix_hit_rate.set_function(lambda: engine.snapshot.prefix_hit_rate)
        self.metrics.watch_tensor_parallel(  # every worker says its size (1: not split)
            cfg.engine.tensor_parallel_size,
            lambda: (engine.snapshot.tp_collectives, engine.snapshot.tp_collective_s,
                     engine.snapshot.tp_collective_bytes),
        )
        if self.core.model_config.num_experts:
            self.metrics.watch_expert_load(lambda: engine.snapshot.expert_load)
        # zeros without tiers: a dashboard's queries find the series on every worker
        self.metrics.watch_kv_tiers(lambda: engine.snapshot.kv_tiers)
        self.metrics.watch_sessions(lambda: engine.snapshot)
        if self.core.loras is not None:
            self.metrics.watch_loras(lambda: engine.snapshot)
        if self.core.scheduler.speculator is not None:
            self.metrics.watch_speculation(
                lambda: (engine.snapshot.spec_steps, engine.snapshot.spec_drafted,
                         engine.snapshot.spec_accepted)
            )  # fmt: skip

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
        queue = self.queue
        self.metrics.watch_queue(lambda: dict(queue.stats.rejected))
        # a peer that leaves may be draining (a scale-down): keep talking to it for
        # as long as a drain takes, the fleet's --drain-timeout
        self.peers = transfer_peers(
            self.discovery, PEER_ROLE[self.role], self.add_peer, self.agent.remove_remote,
            linger_s=cfg.drain_timeout + 5.0,
        )  # fmt: skip
        self.peers.start()
        stack.push_async_callback(self.peers.close)
        if cfg.metrics_port is not None:
            self._metrics_server = serve_metrics(
                self.metrics.registry,
                cfg.host,
                cfg.metrics_port,
                probes={"/health": self._health, "/ready": self._ready},
                advertise_host=cfg.advertise_host,
            )
            stack.callback(self._metrics_server.close)
            self.metrics_address = self._metrics_server.address

    def _health(self) -> tuple[bool, str]:
        """Liveness: the engine thread runs."""
        return (True, "ok") if self.engine.alive else (False, "the engine thread stopped")

    def _ready(self) -> tuple[bool, str]:
        """Readiness: registered in discovery, so routers and peers send work here; false
        before that and from the moment a drain starts."""
        if self._registration is None:
            return False, "not registered (starting or draining)"
        return True, "ready"

    def advertised(self, address: str) -> str:
        """`address` (host:port as bound) with the host peers should dial."""
        host = self.config.advertise_host
        return f"{host}:{address.rpartition(':')[2]}" if host else address

    def add_peer(self, info: WorkerInfo) -> None:
        """Peer with a worker (of the other role; or of ours, for prefix pulls) if its
        published KV layout is ours."""
        if info.kv_layout is None:
            raise ValueError("it publishes no KV layout")
        if info.kv_layout.format_hash != self.kv_format:
            why = "; ".join(self.core.layout.differences(info.kv_layout))
            raise ValueError(f"its KV layout cannot take ours ({why})")
        assert info.transfer is not None
        # ours are all reachable when we move KV (`start` refuses otherwise); a peer's
        # may not be: a GPU worker above TP 1 publishes only rank 0's (an agent a rank: not yet)
        regions, split = len(info.transfer.kv_regions), info.kv_layout.tp_size
        if regions and regions != split:
            raise ValueError(f"its KV pool is split {split} ways and only {regions} of the "
                             "ranks' pools are reachable by transfer")  # fmt: skip
        self.agent.add_remote(info.transfer.metadata, expect_layout=self.kv_format)

    def record(self, model: str, **fields: Any) -> WorkerInfo:
        """This worker's discovery record: identity, transfer agent, KV pool and layout,
        context window, plus the role's `fields` (its gRPC address, say); with LoRA
        adapters served, the largest rank it takes (`LORA_RANK_KEY` in `extra`); under
        `--deterministic`, `DETERMINISTIC_KEY`."""
        loras = self.core.loras
        if loras is not None:
            fields["extra"] = {**fields.get("extra", {}), LORA_RANK_KEY: loras.slots.max_rank}
        if self.config.engine.deterministic:
            fields["extra"] = {**fields.get("extra", {}), DETERMINISTIC_KEY: self.core.numerics}
        return WorkerInfo(
            self.config.worker_id,
            self.role,
            model,
            incarnation_id=self.incarnation,
            metrics_address=self.metrics_address,
            transfer=TransferInfo(
                self.agent.backends[0], self.agent.name, self.agent.metadata(),
                tuple(r.id for r in self.pools),
            ),
            kv_layout=self.core.layout,
            max_model_len=self.core.max_model_len,
            **fields,
        )

    async def register(self, info: WorkerInfo) -> None:
        self._registration = await self.discovery.register(info)
        self.metrics.registered()

    async def leave(self) -> None:
        """Leave discovery: routers and peers stop sending new work here."""
        registration, self._registration = self._registration, None
        if registration is not None:
            with contextlib.suppress(Exception):
                await registration.close()

    async def close(self) -> None:
        await self.leave()
        try:
            await self._stack.aclose()
        finally:
            if self.tracer.on:
                await asyncio.to_thread(self.tracer.close)  # flush the last requests' spans


class WorkerRole:
    """A role's process object: what it exposes of its runtime (for tests, the launcher)."""

    rt: WorkerRuntime

    @property
    def core(self) -> EngineCore:
        return self.rt.core

    @property
    def engine(self) -> AsyncEngine:
        return self.rt.engine

    @property
    def peers(self) -> RoleMembers:
        """The other role's workers, as discovery shows them."""
        return self.rt.peers
