"""Drive an `EngineCore` from asyncio code without blocking the event loop.

The core runs on one dedicated thread that owns it: it applies queued commands
(any callable on the core), runs a step when there is work, and hands each
request's outputs to that request's stream. This module only bridges threads:
what a request is, whether it is admitted and where its prompt is prefilled are
`EngineCore.submit`'s decisions.

    engine = AsyncEngine(EngineCore(config))
    stream = await engine.submit(NewRequest("r1", prompt_ids, SamplingParams(max_tokens=8)))
    async for out in stream:
        print(out.new_token_ids)

Leaving the loop early (a cancelled task, a disconnected client) or `stream.close()`
aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import Future
from typing import Any, TypeVar

from engine.engine_core import EngineCore, EngineSnapshot
from engine.request import NewRequest, RemotePlan, RemoteRule, RequestOutput
from protocol.logprobs import TokenLogprob

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served."""


class EngineStream:
    """The outputs of one admitted request, in order, ending with a finished one.

    `remote_plan` is set when the request waits for a remote prefill into those
    blocks (`AsyncEngine.remote_ready` / `remote_failed` settle it). `cached_tokens`
    is how much of the prompt the prefix cache held when it was admitted.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        request_id: str,
        outputs: asyncio.Queue[Any],
        remote_plan: RemotePlan | None,
        cached_tokens: int = 0,
    ) -> None:
        self.engine = engine
        self.request_id = request_id
        self.remote_plan = remote_plan
        self.cached_tokens = cached_tokens
        self._outputs = outputs
        self._done = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            held: Any = None
            while not self._done:
                item = held if held is not None else await self._outputs.get()
                held = None
                if isinstance(item, BaseException):
                    raise item
                # A reader that fell behind takes every step waiting for it as one
                # output: one message and one SSE event downstream instead of many.
                while not item.finished and not item.error and not self._outputs.empty():
                    later = self._outputs.get_nowait()
                    if isinstance(later, BaseException) or later.error:
                        held = later
                        break
                    item = item.followed_by(later)
                if item.finished:
                    self._done = True
                yield item
        finally:
            self.close()

    def close(self) -> None:
        """Stop listening; aborts the request unless it has finished."""
        if not self._done:
            self._done = True
            self.engine.abort(self.request_id)
        self.engine._forget(self.request_id, self._outputs)


class AsyncEngine:
    def __init__(self, core: EngineCore, *, idle_wait_s: float = 0.05) -> None:
        self.core = core
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        # request id -> the caller's loop and the queue its outputs go to; written on
        # the engine thread at admission, so no step can report before it is there
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self._idle_wait_s = idle_wait_s
        self._hooks: list[Callable[[EngineCore], None]] = []
        self.snapshot: EngineSnapshot = core.snapshot()
        self.steps = 0
        self._thread = threading.Thread(target=self._loop, name="engine-core", daemon=True)
        self._thread.start()

    # -- public API (any thread / event loop) -----------------------------------

    async def submit(
        self, new: NewRequest, *, remote_min_uncached: int | RemoteRule | None = None
    ) -> EngineStream:
        """Admit a request through `EngineCore.submit` (same arguments, same ValueError
        for bad input); returns the stream its outputs arrive on."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[Any] = asyncio.Queue()
        rid = new.request_id
        grammar = None
        if new.params.grammar is not None:  # compiled here, not on the engine thread
            grammar = await asyncio.to_thread(self.core.compile_grammar, new)

        def admit(core: EngineCore) -> tuple[RemotePlan | None, int]:
            plan = core.submit(new, remote_min_uncached=remote_min_uncached, grammar=grammar)
            self._streams[rid] = (loop, outputs)
            cached = core.prefix_hit_tokens(rid) if plan is None else plan.num_cached_tokens
            return plan, cached

        fut = self.call(admit)
        try:
            plan, cached = await asyncio.shield(asyncio.wrap_future(fut))
        except asyncio.CancelledError:
            # nobody will read this stream: once admitted, abort it
            def drop(f: Future[tuple[RemotePlan | None, int]]) -> None:
                if not f.cancelled() and f.exception() is None:
                    self.abort(rid)
                    self._forget(rid, outputs)

            fut.add_done_callback(drop)
            raise
        return EngineStream(self, rid, outputs, plan, cached)

    async def generate(self, new: NewRequest) -> AsyncIterator[RequestOutput]:
        """Submit and stream in one: `async for out in engine.generate(new)`."""
        async for out in await self.submit(new):
            yield out

    async def remote_ready(
        self, request_id: str, first_token: int, logprob: TokenLogprob | None = None
    ) -> None:
        """The remote prefill landed: adopt its KV; the first token goes to the stream."""

        def adopt(core: EngineCore) -> None:
            self._put(request_id, core.remote_kv_ready(request_id, first_token, logprob))

        await self.run(adopt)

    async def remote_failed(self, request_id: str) -> None:
        """No remote write can land any more: release the blocks, prefill locally."""
        await self.run(lambda core: core.remote_kv_failed(request_id))

    async def release_held(self, request_id: str) -> None:
        await self.run(lambda core: core.release_held(request_id))

    def add_step_hook(self, fn: Callable[[EngineCore], None]) -> None:
        """Call `fn(core)` on the engine thread after every step, and after commands that
        leave no step to run (events, metrics)."""
        self._hooks.append(fn)

    def abort(self, request_id: str) -> None:
        """Abort a request if it is still known; unknown ids are ignored here."""
        self._submit(lambda: self._abort(request_id))

    def call(self, fn: Callable[[EngineCore], T]) -> Future[T]:
        """Run `fn(core)` on the engine thread between steps; returns its future."""
        fut: Future[T] = Future()

        def run() -> None:
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn(self.core))
            except BaseException as e:  # delivered to the caller
                fut.set_exception(e)

        self._submit(run)
        return fut

    async def run(self, fn: Callable[[EngineCore], T]) -> T:
        return await asyncio.wrap_future(self.call(fn))

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

    def _forget(self, request_id: str, outputs: asyncio.Queue[Any]) -> None:
        entry = self._streams.get(request_id)
        if entry is not None and entry[1] is outputs:
            self._streams.pop(request_id, None)

    def _abort(self, request_id: str) -> None:
        with contextlib.suppress(KeyError):  # finished or never admitted
            self.core.abort_request(request_id)

    def _put(self, request_id: str, item: Any) -> None:
        self._put_all([(request_id, item)])

    def _put_all(self, items: Iterable[tuple[str, Any]]) -> None:
        """(request id, output or error) pairs to their streams, one wake-up per event
        loop rather than one per request."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[str, asyncio.Queue[Any], Any]]] = {}
        for rid, item in items:
            entry = self._streams.get(rid)
            if entry is not None:
                by_loop.setdefault(entry[0], []).append((rid, entry[1], item))
        for loop, queued in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, queued)
            except RuntimeError:  # that loop is closed; nobody is listening
                for rid, q, _ in queued:
                    self._forget(rid, q)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            ran = False
            while True:
                try:
                    self._commands.get_nowait()()
                except queue.Empty:
                    break
                except Exception:
                    log.exception("engine command failed")
                ran = True
            if ran and not self.core.has_work():
                # a command alone changed the state (a remote prefill's KV adopted as
                # the whole request, blocks released): the hooks see it now, not at the
                # next step, which may be long in coming
                self._after_step()
            if not self.core.has_work():
                self._wake.wait(self._idle_wait_s)
                continue
            try:
                outputs = self.core.step()
                self.steps += 1
            except Exception as e:
                log.exception("engine step failed; failing the running requests")
                for rid in self.core.abort_all():
                    self._put(rid, RuntimeError(f"engine step failed: {e}"))
                continue
            # hooks first: a router hears of the blocks a step cached no later than of
            # the tokens that step produced
            self._after_step()
            self._put_all((out.request_id, out) for out in outputs)

    def _after_step(self) -> None:
        self.snapshot = self.core.snapshot()
        for hook in self._hooks:
            try:
                hook(self.core)
            except Exception:
                log.exception("engine step hook failed")


def _deliver(items: list[tuple[str, asyncio.Queue[Any], Any]]) -> None:
    for _, q, item in items:
        q.put_nowait(item)
