"""A prefill worker process: fetch remote prefills, compute, write KV, notify, ack.

For each delivery (up to `max_batch` at once, batched by the engine):

    checks     the decode worker is registered with the same incarnation and KV layout,
               the deadline has not passed                       -> else term (dead letter)
    prefill    the prompt through this worker's engine (its own prefix cache), sampling
               the first token; the request's blocks are held after it finishes
    claim      `claim_completion`: of two deliveries of one request only one goes on,
               so a decode worker's blocks are written at most once
    write      the blocks of positions >= num_cached_tokens into the decode worker's
               blocks, with the notice as the notification (delivered after the data);
               refused, with a not-ok notice, once the deadline is too close
    ack        after the notice; the held blocks are released

A heartbeat (`in_progress`) runs while a delivery is worked on. A failure before
the claim hands the delivery back (nak) for another worker; after the claim the
decode worker's deadline covers it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import torch

from engine import AsyncEngine, EngineCore, SamplingParams
from engine.tokenizer import Tokenizer
from engine.weights import resolve_model
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.metrics import PrefillMetrics
from runtime.config import open_control_plane
from runtime.discovery import Registration
from runtime.discovery.members import transfer_peers
from runtime.metrics import MetricsServer, serve_metrics
from runtime.prefill_notice import PrefillNotice
from runtime.queue import Delivery, RemotePrefillRequest
from runtime.rpc.types import TokenLogprob, TopLogprob
from runtime.sampling import SamplingParams as WireSampling
from runtime.worker_info import KvLayout, TransferInfo, WorkerInfo, new_incarnation_id
from transfer import Agent, DescList, Region

log = logging.getLogger(__name__)


def first_token_params(s: WireSampling) -> SamplingParams:
    """The engine parameters that sample exactly the first token as the decode worker would
    (EOS is ignored: one token either way; the decode worker decides what it ends)."""
    kwargs = {**s.to_kwargs(), "max_tokens": 1, "ignore_eos": True}
    kwargs["min_tokens"] = min(s.min_tokens, 1)
    return SamplingParams(**kwargs)  # type: ignore[arg-type]


class PrefillWorker:
    def __init__(self, config: PrefillWorkerConfig) -> None:
        self.config = config
        self.incarnation = new_incarnation_id()
        self.metrics = PrefillMetrics()
        self._stack = contextlib.AsyncExitStack()
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self.registration: Registration | None = None
        self.metrics_server: MetricsServer | None = None
        self.pool: Region | None = None

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
        self.layout = lay = self.core.layout
        self.agent.layout = lay.layout_hash
        self.metrics.kernels.info(self.core.runner.kernel_paths())
        self.engine = AsyncEngine(self.core)
        stack.callback(self.engine.close)

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
        self.decode_workers = transfer_peers(
            self.discovery,
            "decode",
            lambda md: self.agent.add_remote(md, expect_layout=lay.layout_hash),
            self.agent.remove_remote,
        )
        self.decode_workers.start()
        stack.push_async_callback(self.decode_workers.close)

        metrics_address = ""
        if cfg.metrics_port is not None:
            self.metrics_server = serve_metrics(self.metrics.registry, cfg.host, cfg.metrics_port)
            metrics_address = self.metrics_server.address
        info = WorkerInfo(
            cfg.worker_id,
            "prefill",
            self.core.source.name,
            incarnation_id=self.incarnation,
            metrics_address=metrics_address,
            transfer=TransferInfo(self.agent.backends[0], self.agent.name, self.agent.metadata()),
            kv_layout=KvLayout.from_dict({**lay.to_dict(), "layout_hash": lay.layout_hash}),
        )
        self.registration = await self.discovery.register(info)
        self._loop_task = asyncio.create_task(self._serve_forever(), name="prefill loop")
        log.info("prefill worker %s ready", cfg.worker_id)
        return info

    async def stop(self) -> None:
        if self.registration is not None:
            with contextlib.suppress(Exception):
                await self.registration.close()
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self.metrics_server is not None:
            self.metrics_server.close()
        await self._stack.aclose()

    # -- the work loop ------------------------------------------------------------------

    async def _serve_forever(self) -> None:
        slots = asyncio.Semaphore(self.config.max_batch)
        while True:
            await slots.acquire()
            free = 1
            while free < self.config.max_batch and not slots.locked():
                await slots.acquire()
                free += 1
            try:
                deliveries = await self.queue.fetch(batch=free, timeout=1.0)
            except Exception as e:
                log.warning("fetching from the prefill queue failed: %s", e)
                deliveries = []
                await asyncio.sleep(0.5)
            for _ in range(free - len(deliveries)):
                slots.release()
            for d in deliveries:
                task = asyncio.create_task(self._serve(d, slots), name=d.request.request_id)
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _serve(self, d: Delivery, slots: asyncio.Semaphore) -> None:
        self.metrics.in_flight.inc()
        try:
            async with d.keepalive():
                result = await self._prefill_and_write(d)
            self.metrics.prefills.labels(result=result).inc()
        except Exception:
            log.exception("prefill of %s failed", d.request.request_id)
            self.metrics.prefills.labels(result="failed").inc()
            if d.settled is None:
                with contextlib.suppress(Exception):
                    await d.nak(0.5)
        finally:
            self.metrics.in_flight.dec()
            slots.release()

    async def _prefill_and_write(self, d: Delivery) -> str:
        req = d.request
        decode = await self.decode_workers.wait_for(
            req.decode_worker_id, self.config.decode_lookup_timeout
        )
        problem = self._check(req, decode)
        if problem:
            log.warning("not prefilling %s: %s", req.request_id, problem)
            await d.term(problem)
            return "skipped"
        assert decode is not None and decode.transfer is not None
        started = time.monotonic()
        local_id = f"{req.request_id}#{d.num_delivered}"
        q = self.engine.add_request(
            local_id,
            list(req.prompt_token_ids),
            first_token_params(req.sampling),
            cache_salt=req.cache_salt or None,
            hold_blocks=True,
        )
        try:
            outs = [o async for o in self.engine.stream(local_id, q)]
            out = outs[-1]  # one token: the only output
            assert out.new_token_ids
            prefill_s = time.monotonic() - started
            self.metrics.prefill_seconds.observe(prefill_s)
            if not await d.claim_completion():
                await d.ack()
                return "duplicate"
            peer = decode.transfer.agent_name
            if time.time() > req.deadline - self.config.write_margin:
                notice = PrefillNotice(req.request_id, ok=False, error="deadline too close")
                await self.agent.notify(peer, notice.encode()).wait(self.config.write_timeout)
                await d.ack()
                return "refused"
            src_blocks = await self.engine.run(lambda core: core.kv.block_ids(local_id))
            nbytes = await self._write(req, decode, src_blocks, out, prefill_s)
            self.metrics.transferred_bytes.inc(nbytes)
            await d.ack()
            return "ok"
        finally:
            with contextlib.suppress(KeyError, Exception):
                await self.engine.release_held(local_id)

    def _check(self, req: RemotePrefillRequest, decode: WorkerInfo | None) -> str:
        if decode is None or decode.transfer is None:
            return f"decode worker {req.decode_worker_id} is not registered"
        if decode.incarnation_id != req.decode_incarnation_id:
            return f"decode worker {req.decode_worker_id} restarted"
        if req.kv_layout_hash != self.layout.layout_hash:
            return f"KV layout {req.kv_layout_hash} differs from ours ({self.layout.layout_hash})"
        if req.expired():
            return "deadline passed"
        bs = self.layout.block_size
        if len(req.dst_block_ids) != -(-len(req.prompt_token_ids) // bs):
            return "dst_block_ids do not cover the prompt"
        return ""

    async def _write(
        self,
        req: RemotePrefillRequest,
        decode: WorkerInfo,
        src_blocks: list[int],
        out: Any,
        prefill_s: float,
    ) -> int:
        """Write the blocks past the decode worker's cached prefix, notice attached."""
        assert self.pool is not None and decode.transfer is not None
        bs, block_bytes = self.layout.block_size, self.layout.block_bytes
        first = req.num_cached_tokens // bs
        last = -(-len(req.prompt_token_ids) // bs)
        src = DescList.blocks(self.pool, src_blocks[first:last], block_bytes)
        region = int(decode.extra.get("kv_region", 0))
        dst = DescList.blocks(region, list(req.dst_block_ids[first:last]), block_bytes)
        nbytes = (last - first) * block_bytes
        lp = None
        if out.new_logprobs:
            e = out.new_logprobs[0]
            lp = TokenLogprob(e.logprob, tuple(TopLogprob(t, v) for t, v in e.top))
        notice = PrefillNotice(
            req.request_id,
            ok=True,
            first_token=out.new_token_ids[0],
            logprob=lp,
            prefill_worker_id=self.config.worker_id,
            prefill_s=prefill_s,
            transferred_bytes=nbytes,
        )
        t0 = time.monotonic()
        handle = self.agent.write(
            src, decode.transfer.agent_name, dst, notification=notice.encode()
        )
        await handle.wait(self.config.write_timeout)
        self.metrics.transfer_seconds.observe(time.monotonic() - t0)
        return nbytes
