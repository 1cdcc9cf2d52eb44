"""Drive an `EngineCore` from asyncio code without blocking the event loop.

The core runs on one dedicated thread that owns it: it applies queued commands
(add, abort, or any callable on the core), runs a step when there is work, and
hands each request's outputs to that request's asyncio queue. Callers stream with
`async for out in engine.generate(...)`; leaving the loop early (a cancelled task,
a disconnected client) aborts the request.

    engine = AsyncEngine(EngineCore(config))
    async for out in engine.generate("r1", prompt_ids, SamplingParams(max_tokens=8)):
        print(out.new_token_ids)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from engine.engine_core import EngineCore
from engine.request import RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served."""


@dataclass(frozen=True)
class RemotePlan:
    """Blocks pinned for a remote prefill: the prompt's block table and cached prefix."""

    block_ids: list[int]
    num_cached_tokens: int


@dataclass(frozen=True)
class EngineSnapshot:
    """Load figures, refreshed on the engine thread after every step."""

    running: int = 0
    waiting: int = 0
    remote_waiting: int = 0
    kv_used_blocks: int = 0
    kv_total_blocks: int = 0


class AsyncEngine:
    def __init__(self, core: EngineCore, *, idle_wait_s: float = 0.05) -> None:
        self.core = core
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self._idle_wait_s = idle_wait_s
        self._hooks: list[Callable[[EngineCore], None]] = []
        self.snapshot = EngineSnapshot(kv_total_blocks=core.kv.pool.num_usable_blocks)
        self._thread = threading.Thread(target=self._loop, name="engine-core", daemon=True)
        self._thread.start()
        self.steps = 0

    # -- public API (any thread / event loop) -----------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; raises ValueError at once for bad input."""
        q = self.add_request(
            request_id, prompt_token_ids, params, priority=priority, cache_salt=cache_salt
        )
        async for out in self.stream(request_id, q):
            yield out

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        hold_blocks: bool = False,
    ) -> asyncio.Queue[Any]:
        """Queue a request; returns the asyncio queue its outputs will arrive on."""
        req, q = self._prepare(request_id, prompt_token_ids, params, priority, cache_salt)
        req.hold_blocks = hold_blocks
        self._submit(lambda: self._add(req))
        return q

    def _prepare(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None,
        priority: int,
        cache_salt: str | None,
    ) -> tuple[Any, asyncio.Queue[Any]]:
        self._check_alive()
        # Validation reads only immutable config, so it runs here and errors reach the caller.
        req = self.core.make_request(
            request_id, prompt_token_ids, params, priority=priority, cache_salt=cache_salt
        )
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        q: asyncio.Queue[Any] = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        return req, q

    async def plan_remote(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        min_uncached: int = 1,
    ) -> tuple[asyncio.Queue[Any], RemotePlan | None]:
        """Pin blocks for a remote prefill of this request if it is worth it.

        With a plan, the request waits (costing nothing) until `remote_ready` or
        `remote_failed`; without one (too little uncached, pool full) it was queued
        for local prefill. Either way its outputs arrive on the returned queue.
        """
        req, q = self._prepare(request_id, prompt_token_ids, params, priority, cache_salt)

        def plan(core: EngineCore) -> RemotePlan | None:
            blocks = core.plan_remote(req, min_uncached)
            if blocks is None:
                core.scheduler.add_request(req)
                return None
            return RemotePlan(blocks, max(req.num_cached_tokens, 0))

        try:
            return q, await self.run(plan)
        except BaseException:
            self._streams.pop(request_id, None)
            raise

    async def remote_ready(
        self, request_id: str, first_token: int, logprob: TokenLogprob | None = None
    ) -> None:
        """The remote prefill landed: adopt its KV; the first token goes to the stream."""

        def adopt(core: EngineCore) -> None:
            self.deliver([core.remote_kv_ready(request_id, first_token, logprob)])

        await self.run(adopt)

    async def remote_failed(self, request_id: str) -> None:
        """No remote write can land any more: release the blocks, prefill locally."""
        await self.run(lambda core: core.remote_kv_failed(request_id))

    async def release_held(self, request_id: str) -> None:
        await self.run(lambda core: core.release_held(request_id))

    def add_step_hook(self, fn: Callable[[EngineCore], None]) -> None:
        """Call `fn(core)` on the engine thread after every step (events, metrics)."""
        self._hooks.append(fn)

    async def stream(self, request_id: str, q: asyncio.Queue[Any]) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)
            self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Abort a request if it is still known; unknown ids are ignored here."""
        self._submit(lambda: self._abort(request_id))

    def call(self, fn: Callable[[EngineCore], T]) -> Future[T]:
        """Run `fn(core)` on the engine thread between steps; returns its future."""
        fut: Future[T] = Future()

        def run() -> None:
            try:
                fut.set_result(fn(self.core))
            except BaseException as e:  # delivered to the caller
                fut.set_exception(e)

        self._submit(run)
        return fut

    async def run(self, fn: Callable[[EngineCore], T]) -> T:
        return await asyncio.wrap_future(self.call(fn))

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Send outputs produced outside `step` (e.g. a remote first token) to streams."""
        for out in outputs:
            self._put(out.request_id, out)

    def close(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        err = EngineDeadError("the engine was shut down")
        for rid in list(self._streams):
            self._put(rid, err)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    # -- engine thread -------------------------------------------------------------

    def _check_alive(self) -> None:
        if not self.alive:
            raise EngineDeadError("the engine thread is not running")

    def _submit(self, cmd: Callable[[], None]) -> None:
        self._commands.put(cmd)
        self._wake.set()

    def _add(self, req: Any) -> None:
        try:
            self.core.scheduler.add_request(req)
        except Exception as e:
            self._put(req.request_id, e)

    def _abort(self, request_id: str) -> None:
        if request_id in self.core.scheduler.requests:
            self.core.abort_request(request_id)

    def _put(self, request_id: str, item: Any) -> None:
        entry = self._streams.get(request_id)
        if entry is None:
            return
        loop, q = entry
        try:
            loop.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed; nobody is listening
            self._streams.pop(request_id, None)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            while True:
                try:
                    self._commands.get_nowait()()
                except queue.Empty:
                    break
                except Exception:
                    log.exception("engine command failed")
            if not self.core.scheduler.has_work():
                self._wake.wait(self._idle_wait_s)
                continue
            try:
                outputs = self.core.step()
                self.steps += 1
            except Exception as e:
                log.exception("engine step failed; failing the running requests")
                self._fail_all(e)
                continue
            self.deliver(outputs)
            self._after_step()

    def _after_step(self) -> None:
        core = self.core
        s = core.scheduler
        self.snapshot = EngineSnapshot(
            running=len(s.running),
            waiting=len(s.waiting),
            remote_waiting=len(s.remote_waiting),
            kv_used_blocks=core.kv.pool.num_usable_blocks - core.kv.num_free_blocks,
            kv_total_blocks=core.kv.pool.num_usable_blocks,
        )
        for hook in self._hooks:
            try:
                hook(core)
            except Exception:
                log.exception("engine step hook failed")

    def _fail_all(self, error: Exception) -> None:
        for rid in list(self.core.scheduler.requests):
            with contextlib.suppress(KeyError):
                self.core.abort_request(rid)
            self._put(rid, RuntimeError(f"engine step failed: {error}"))
