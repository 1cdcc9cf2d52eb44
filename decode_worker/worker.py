"""A decode worker process: the worker runtime, remote prefill, and the gRPC server.

Start-up order matters for the invariants: the runtime allocates the KV pool through
the transfer agent (so prefill workers can write into it) before the engine exists
and follows the prefill pool (only registered prefill agents may write); the worker
subscribes to its dead letters before it publishes anything, and registers in
discovery last, once it can serve.
"""

from __future__ import annotations

import logging

from decode_worker.config import DecodeWorkerConfig
from decode_worker.handler import DecodeHandler
from decode_worker.metrics import DecodeMetrics
from decode_worker.remote_prefill import PrefillAffinity, RemotePrefill
from engine.engine_core import EngineCore
from runtime.discovery.members import RoleMembers
from runtime.rpc.events import KvEventPublisher
from runtime.rpc.server import DecodeWorkerServer
from runtime.worker_info import WorkerInfo
from worker.assembly import WorkerRole, WorkerRuntime

log = logging.getLogger(__name__)


class DecodeWorker(WorkerRole):
    def __init__(self, config: DecodeWorkerConfig) -> None:
        self.config = config
        self.metrics = DecodeMetrics()
        self.rt = WorkerRuntime(config, "decode", self.metrics)
        self.info: WorkerInfo | None = None
        self.handler: DecodeHandler | None = None
        self.server: DecodeWorkerServer | None = None
        self.affinity: PrefillAffinity | None = None

    @property
    def prefill_workers(self) -> RoleMembers:
        return self.peers

    async def start(self) -> WorkerInfo:
        cfg, rt = self.config, self.rt
        await rt.start()
        rt.core.record_kv_events()
        self.events = KvEventPublisher(rt.incarnation)
        self.remote = RemotePrefill(rt, cfg, self.metrics)
        if cfg.prefill_affinity and cfg.remote_prefill:
            self.affinity = PrefillAffinity(
                rt.discovery, rt.layout_hash, rt.core.layout.block_size,
                subscriber=f"decode {cfg.worker_id}", on_leave=self.remote.preferred_left,
            )  # fmt: skip
            self.affinity.start()
            self.remote.affinity = self.affinity
        self.remote.start_loops()
        rt.engine.add_step_hook(self._after_step)
        self.handler = DecodeHandler(
            rt.engine, self.remote, self.events, self.metrics, cfg.worker_id, rt.incarnation,
            max_queued=cfg.max_queued_requests,
        )  # fmt: skip
        self.server = DecodeWorkerServer(
            self.handler, f"{cfg.host}:{cfg.port}", worker_id=cfg.worker_id, tracer=rt.tracer
        )
        address = rt.advertised(await self.server.start())
        self.info = rt.record(
            cfg.served_model_name or rt.core.source.name,
            grpc_address=address,
            max_running=cfg.engine.max_num_seqs,
            max_queued=cfg.max_queued_requests,
        )
        await rt.register(self.info)
        log.info("decode worker %s serving at %s", cfg.worker_id, address)
        return self.info

    async def stop(self, grace: float | None = None) -> None:
        """Drain, then shut down: leave discovery (the frontends route no new request
        here), refuse new calls as UNAVAILABLE (a frontend that chose this worker just
        before it left retries elsewhere), and give running streams, with the remote
        prefills they wait for, `grace` s (the config's `drain_timeout`) to finish."""
        await self.rt.leave()
        if self.handler is not None:
            self.handler.draining = True
        if self.server is not None:
            await self.server.stop(self.config.drain_timeout if grace is None else grace)
        if hasattr(self, "remote"):
            await self.remote.close()
        if self.affinity is not None:
            await self.affinity.close()
        await self.rt.close()

    def _after_step(self, core: EngineCore) -> None:
        """On the engine thread after each step: KV events and load figures."""
        self.events.publish(core.drain_kv_events())
        m, s = self.metrics, self.rt.engine.snapshot  # refreshed just before the hooks
        m.running.set(s.running)
        m.waiting.set(s.waiting)
        m.remote_waiting.set(s.remote_waiting)
        m.kv_usage.set(s.kv_usage)
        if self.handler is not None:
            self.events.update_load(self.handler.load())
