"""Drive an `EngineCore` from asyncio code without blocking the event loop.

The core runs on one dedicated thread that owns it: it applies queued commands (the
typed set below), runs a step when there is work, publishes an
`EngineSnapshot` for other threads to read, and hands each request's outputs to that
request's stream. This module only bridges threads: what a request is, whether it is
admitted and where its prompt is prefilled are `EngineCore.submit`'s decisions.

    engine = AsyncEngine(EngineCore(config))
    stream = await engine.submit(NewRequest("r1", prompt_ids, SamplingParams(max_tokens=8)))
    async for out in stream:
        print(out.new_token_ids)

Leaving the loop early (a cancelled task, a disconnected client) or `stream.close()`
aborts the request.

What other threads ask of the engine thread is one typed command each.
The engine thread owns the `EngineCore`; an event loop never calls it, it sends one of
these (`AsyncEngine` queues them) and the engine thread applies them between steps, in
order (`apply`). What a command returns reaches the sender's future:

    Submit        admit a request (EngineCore.submit)        -> Admitted
    Abort         stop a request, free its blocks            -> None (unknown ids ignored)
    RemoteReady   adopt a remote prefill's KV + first token  -> the first token's output
    RemoteFailed  no remote write can land: prefill here     -> None
    ReleaseHeld   free a finished hold_blocks request        -> None
    BlockIds      a tracked or held request's block table    -> list[int]
    Inspect       a read of the core, for tests and tools    -> what it returns

Reads the other way (load, KV usage, what the prefix cache would give a prompt) go
through `EngineSnapshot`, which the engine thread publishes after every step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar, cast

from engine.engine_core import EngineCore, EngineSnapshot
from engine.parallel.group import RankLostError
from engine.request import NewRequest, RemotePlan, RemoteRule, RequestOutput
from protocol.kv_layout import BlockHash
from protocol.logprobs import TokenLogprob

if TYPE_CHECKING:
    from engine.grammar import GrammarState


@dataclass(frozen=True)
class Submit:
    new: NewRequest
    # prefill remotely when this rule says so (EngineCore.submit's remote_min_uncached)
    remote_rule: int | RemoteRule | None = None
    grammar: GrammarState | None = None  # compiled off the engine thread


@dataclass(frozen=True)
class Admitted:
    plan: RemotePlan | None  # blocks pinned for a remote prefill, or None: prefilled here
    cached_tokens: int  # of the prompt, held by the prefix cache at admission


@dataclass(frozen=True)
class _OneRequest:
    request_id: str


class Abort(_OneRequest):
    """Stop the request and free its blocks (an unknown id is ignored)."""


@dataclass(frozen=True)
class RemoteReady:
    request_id: str
    first_token: int
    logprob: TokenLogprob | None = None


class RemoteFailed(_OneRequest):
    """No remote write can land for the request: it prefills here."""


class ReleaseHeld(_OneRequest):
    """Free a finished `hold_blocks` request's blocks."""


class BlockIds(_OneRequest):
    """A tracked or held request's block table."""


@dataclass(frozen=True)
class Inspect:
    """A read of the core's state between steps (tests, diagnostics); it must not
    change the core."""

    read: Callable[[EngineCore], object]


@dataclass(frozen=True)
class PeerBlocks:
    """A prefix's blocks moved between workers' pools (`EngineCore.*_peer_blocks`):
    `op` is "reserve", "commit", "pin" or "release"."""

    op: str
    owner: str
    hashes: tuple[BlockHash, ...] = ()


EngineCommand = (
    Submit | Abort | RemoteReady | RemoteFailed | ReleaseHeld | BlockIds | Inspect | PeerBlocks
)


def apply(core: EngineCore, command: EngineCommand) -> object:
    """Carry out one command on the engine thread; raises what the core raises (bad
    input: ValueError) for the sender."""
    match command:
        case Submit(new, rule, grammar):
            plan = core.submit(new, remote_min_uncached=rule, grammar=grammar)
            rid = new.request_id
            cached = core.prefix_hit_tokens(rid) if plan is None else plan.num_cached_tokens
            return Admitted(plan, cached)
        case Abort(rid):
            with contextlib.suppress(KeyError):  # finished or never admitted
                core.abort_request(rid)
            return None
        case RemoteReady(rid, token, logprob):
            out: RequestOutput = core.remote_kv_ready(rid, token, logprob)
            return out
        case RemoteFailed(rid):
            core.remote_kv_failed(rid)
            return None
        case ReleaseHeld(rid):
            core.release_held(rid)
            return None
        case BlockIds(rid):
            return core.block_ids(rid)
        case Inspect(read):
            return read(core)
        case PeerBlocks("reserve", owner, hashes):
            return core.reserve_peer_blocks(owner, hashes)
        case PeerBlocks("commit", owner, hashes):
            return core.commit_peer_blocks(owner, hashes)
        case PeerBlocks("pin", owner, hashes):
            return core.pin_peer_blocks(owner, hashes)
        case PeerBlocks("release", owner, _):
            core.release_peer_blocks(owner)
            return None
    raise TypeError(f"not an engine command: {command!r}")


log = logging.getLogger(__name__)
T = TypeVar("T")
# what a stream carries: outputs, or the error that ends it
Item = RequestOutput | BaseException
Outputs = asyncio.Queue[Item]
Stream = tuple[asyncio.AbstractEventLoop, Outputs]  # where a request's outputs go


@dataclass(frozen=True)
class _Queued:
    command: EngineCommand
    result: Future[object] | None = None  # None: nobody waits (an abort)
    stream: Stream | None = None  # a Submit's


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served."""


@dataclass(eq=False)
class EngineStream:
    """The outputs of one admitted request, in order, ending with a finished one.

    `remote_plan` is set when the request waits for a remote prefill into those
    blocks (`AsyncEngine.remote_ready` / `remote_failed` settle it). `cached_tokens`
    is how much of the prompt the prefix cache held when it was admitted.
    """

    engine: AsyncEngine
    request_id: str
    _outputs: Outputs
    remote_plan: RemotePlan | None
    cached_tokens: int = 0
    _done: bool = field(default=False, init=False)

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            held: Item | None = None
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
        self.core = core  # the engine thread's: other threads read `snapshot`
        self._commands: queue.SimpleQueue[_Queued] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        # request id -> the caller's loop and the queue its outputs go to; written on
        # the engine thread at admission, so no step can report before it is there
        self._streams: dict[str, Stream] = {}
        self._idle_wait_s = idle_wait_s
        self._hooks: list[Callable[[EngineCore], None]] = []
        self.snapshot: EngineSnapshot = core.snapshot()
        self.steps = 0
        # set when the engine thread ends by itself: the error that stopped it
        self._died: Future[None] = Future()
        self._thread = threading.Thread(target=self._loop, name="engine-core", daemon=True)
        self._thread.start()

    # -- public API (any thread / event loop) -----------------------------------

    async def submit(
        self, new: NewRequest, *, remote_min_uncached: int | RemoteRule | None = None
    ) -> EngineStream:
        """Admit a request through `EngineCore.submit` (same arguments, same ValueError
        for bad input); returns the stream its outputs arrive on."""
        self._check_alive()
        outputs: Outputs = asyncio.Queue()
        rid = new.request_id
        grammar = None
        if new.params.grammar is not None:  # compiled here, not on the engine thread
            grammar = await asyncio.to_thread(self.core.compile_grammar, new)
        stream = (asyncio.get_running_loop(), outputs)
        fut = self._send(Submit(new, remote_min_uncached, grammar), stream)
        try:
            admitted = cast(Admitted, await asyncio.shield(asyncio.wrap_future(fut)))
        except asyncio.CancelledError:
            # nobody will read this stream: once admitted, abort it
            def drop(f: Future[object]) -> None:
                if not f.cancelled() and f.exception() is None:
                    self.abort(rid)
                    self._forget(rid, outputs)

            fut.add_done_callback(drop)
            raise
        return EngineStream(self, rid, outputs, admitted.plan, admitted.cached_tokens)

    async def generate(self, new: NewRequest) -> AsyncIterator[RequestOutput]:
        """Submit and stream in one: `async for out in engine.generate(new)`."""
        async for out in await self.submit(new):
            yield out

    async def remote_ready(
        self, request_id: str, first_token: int, logprob: TokenLogprob | None = None
    ) -> None:
        """The remote prefill landed: adopt its KV; the first token goes to the stream."""
        await self._run(RemoteReady(request_id, first_token, logprob))

    async def remote_failed(self, request_id: str) -> None:
        """No remote write can land any more: release the blocks, prefill locally."""
        await self._run(RemoteFailed(request_id))

    async def release_held(self, request_id: str) -> None:
        await self._run(ReleaseHeld(request_id))

    async def block_ids(self, request_id: str) -> list[int]:
        """The block table of a tracked (or held) request."""
        return cast(list[int], await self._run(BlockIds(request_id)))

    # a prefix moved between workers' pools (EngineCore.*_peer_blocks says what each does)
    async def reserve_peer_blocks(
        self, owner: str, hashes: Sequence[BlockHash]
    ) -> tuple[int, list[int]]:
        answer = await self._run(PeerBlocks("reserve", owner, tuple(hashes)))
        return cast("tuple[int, list[int]]", answer)

    async def commit_peer_blocks(self, owner: str, hashes: Sequence[BlockHash]) -> int:
        return cast(int, await self._run(PeerBlocks("commit", owner, tuple(hashes))))

    async def pin_peer_blocks(self, owner: str, hashes: Sequence[BlockHash]) -> list[int]:
        return cast(list[int], await self._run(PeerBlocks("pin", owner, tuple(hashes))))

    async def release_peer_blocks(self, owner: str) -> None:
        await self._run(PeerBlocks("release", owner))

    def abort(self, request_id: str) -> None:
        """Abort a request if it is still known; unknown ids are ignored."""
        self._commands.put(_Queued(Abort(request_id)))
        self._wake.set()

    def inspect(self, read: Callable[[EngineCore], T]) -> Future[T]:
        """`read(core)` on the engine thread between steps (tests, diagnostics); it must
        not change the core."""
        return cast("Future[T]", self._send(Inspect(read)))

    def add_step_hook(self, fn: Callable[[EngineCore], None]) -> None:
        """Call `fn(core)` on the engine thread after every step, and after commands that
        leave no step to run (events, metrics)."""
        self._hooks.append(fn)

    def _send(self, command: EngineCommand, stream: Stream | None = None) -> Future[object]:
        fut: Future[object] = Future()
        self._commands.put(_Queued(command, fut, stream))
        self._wake.set()
        return fut

    async def _run(self, command: EngineCommand) -> object:
        return await asyncio.wrap_future(self._send(command))

    def close(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        if not self._thread.is_alive():  # the ranks' collectives belong to that thread
            self.core.close()
        else:
            log.error("the engine thread did not stop in %.0f s; its ranks are left to "
                      "end with this process", timeout)  # fmt: skip
        err = EngineDeadError("the engine was shut down")
        for rid in list(self._streams):
            self._put(rid, err)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    async def died(self) -> None:
        """Wait until the engine stops by itself (a tensor-parallel rank lost); raises
        the EngineDeadError that says why. A worker then stops: it leaves discovery and
        its requests move elsewhere, as for any dead worker."""
        await asyncio.wrap_future(self._died)

    # -- engine thread -------------------------------------------------------------

    def _check_alive(self) -> None:
        if not self.alive:
            raise EngineDeadError("the engine thread is not running")

    def _forget(self, request_id: str, outputs: Outputs) -> None:
        entry = self._streams.get(request_id)
        if entry is not None and entry[1] is outputs:
            self._streams.pop(request_id, None)

    def _put(self, request_id: str, item: Item) -> None:
        self._put_all([(request_id, item)])

    def _put_all(self, items: Iterable[tuple[str, Item]]) -> None:
        """(request id, output or error) pairs to their streams, one wake-up per event
        loop rather than one per request."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[str, Outputs, Item]]] = {}
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
                    queued = self._commands.get_nowait()
                except queue.Empty:
                    break
                self._carry_out(queued)
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
            except RankLostError as e:  # no step can run again: the engine ends
                log.error("engine stopped: %s", e)
                dead = EngineDeadError(f"the engine stopped: {e}")
                self._stop.set()
                self.core.abort_all()
                self._put_all((rid, dead) for rid in list(self._streams))
                self._died.set_exception(dead)
                return
            except Exception as e:
                log.exception("engine step failed; failing the running requests")
                for rid in self.core.abort_all():
                    self._put(rid, RuntimeError(f"engine step failed: {e}"))
                continue
            # hooks first: a router hears of the blocks a step cached no later than of
            # the tokens that step produced
            self._after_step()
            self._put_all((out.request_id, out) for out in outputs)

    def _carry_out(self, queued: _Queued) -> None:
        fut = queued.result
        if fut is not None and not fut.set_running_or_notify_cancel():
            return
        try:
            result = apply(self.core, queued.command)
        except BaseException as e:  # delivered to the sender
            if fut is None:
                log.exception("engine command %r failed", queued.command)
            else:
                fut.set_exception(e)
            return
        if queued.stream is not None and isinstance(queued.command, Submit):
            self._streams[queued.command.new.request_id] = queued.stream
        if isinstance(queued.command, RemoteReady) and isinstance(result, RequestOutput):
            self._put(queued.command.request_id, result)
        if fut is not None:
            fut.set_result(result)

    def _after_step(self) -> None:
        self.snapshot = self.core.snapshot()
        for hook in self._hooks:
            try:
                hook(self.core)
            except Exception:
                log.exception("engine step hook failed")


def _deliver(items: list[tuple[str, Outputs, Item]]) -> None:
    for _, q, item in items:
        q.put_nowait(item)
