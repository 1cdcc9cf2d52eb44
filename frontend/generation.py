"""One request's output: tokens from the decode pool across retries and migrations,
then text (token chunks in, :class:`Delta` out), for each of its ``n`` choices.

**Tokens** (:func:`generate_tokens`): the caller sees a single stream of
:class:`GenerateChunk` whatever happens underneath:

* a worker that fails with a retryable error (UNAVAILABLE: dead or unreachable;
  RESOURCE_EXHAUSTED: full) before sending a token is replaced by another worker;
* one that fails after tokens were streamed is **migrated**: the prompt plus the tokens
  so far are replayed to another worker, with ``max_tokens`` and ``min_tokens`` reduced
  by what was already generated, and the stream goes on from there;
* after ``max_attempts`` workers, or on any other error, :class:`GenerateError` ends
  the stream.

Greedy output is unchanged by a migration, and a grammar (structured output) resumes
where the output stopped: the new worker replays the tokens so far into it. Seeded
sampling restarts its generator on the new worker, and presence/frequency penalties
then count the replayed tokens as prompt, so sampled output may differ from what the
first worker would have produced. Usage in the chunks is rewritten in terms of the
client's request: prompt tokens are the original prompt, completion tokens all tokens
generated, cached tokens those of the original prompt only. Closing the iterator early
(a stop string matched, the client went away) cancels the RPC in flight, and the
worker aborts the request.

**Text** (:class:`Generation`): tokens are detokenized incrementally; a stop string
ends the output there (the match itself is never emitted unless
``include_stop_str_in_output``), even when it spans several tokens or chunks, and
ending it closes the token stream, which cancels the request on the worker. Latency and
token metrics are recorded here, where each token is first seen.

The ``n`` choices of one request are one stream of ``(index, Delta)`` (:class:`Choices`).
Choice 0 goes first. Once its first output arrives, its prompt's KV is computed and in
the prefix cache of the decode worker that holds it, and the other choices are sent to
that same worker: each finds the prompt's full blocks there (shared, reference counted)
and computes only the last partial block and its own tokens, so ``n`` choices hold the
prompt once plus a block each, not ``n`` times. A seeded request's choice ``i`` samples
with seed ``seed + i``, so choices differ and the whole response is reproducible.

Usage is computed here, once: the prompt once, the completion tokens of every choice,
and the cached prompt tokens the first choice's worker reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

from engine.reasoning import ReasoningState
from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from frontend.errors import GatewayTimeout, ServiceUnavailable, from_worker_error
from frontend.metrics import FrontendMetrics
from frontend.protocol import PreparedRequest
from frontend.router import RouteRequest
from frontend.workers import WorkerPool
from runtime.rpc import (
    ErrorCode,
    FinishReason,
    GenerateChunk,
    GenerateError,
    GenerateRequest,
    TokenLogprob,
    Usage,
)
from runtime.tracing import NO_SPAN, Span

log = logging.getLogger(__name__)


# CANCELLED that this frontend did not ask for means the worker's server went down.
FAILOVER_CODES = frozenset(
    {ErrorCode.UNAVAILABLE, ErrorCode.RESOURCE_EXHAUSTED, ErrorCode.CANCELLED}
)

# (migrated: tokens had been streamed, worker id, error)
FailoverHook = Callable[[bool, str, GenerateError], None]


async def generate_tokens(
    pool: WorkerPool,
    request: GenerateRequest,
    *,
    max_attempts: int = 3,
    deadline: float | None = None,
    max_model_len: int | None = None,
    on_failover: FailoverHook | None = None,
    prefer: str | None = None,
    on_worker: Callable[[str], None] | None = None,
    hold_s: float = 0.0,
    trace: Span = NO_SPAN,
) -> AsyncGenerator[GenerateChunk, None]:
    """Stream ``request``'s tokens; ``deadline`` is on the event loop's clock;
    ``request.session_id`` is the client's conversation, a hint for the router (and,
    with ``--kv-session-ttl``, the worker holds its blocks between turns); ``prefer`` a
    worker the first attempt goes to if it can (a sibling choice of ``n`` > 1);
    ``on_worker`` hears which worker each attempt runs on; with no worker at all (a
    pool scaled to zero) an attempt waits up to ``hold_s`` (within the deadline) for one
    to join. Each attempt is a span under ``trace`` naming its worker, and the parent
    of the worker's spans."""
    prompt = request.prompt_token_ids
    produced: list[int] = []
    tried: list[str] = []
    cached = 0
    last_error: GenerateError | None = None
    loop = asyncio.get_running_loop()
    for attempt in range(max_attempts):
        attempt_request = _for_attempt(request, produced, attempt, max_model_len)
        if attempt_request is None:  # the failed worker had produced the whole budget
            usage = Usage(len(prompt), len(produced), cached)
            yield GenerateChunk(finish_reason=FinishReason.LENGTH, usage=usage)
            return
        route = RouteRequest(
            request.request_id, attempt_request.prompt_token_ids, attempt,
            cache_salt=request.cache_salt, session_id=request.session_id or None,
            prefer=prefer if attempt == 0 else None, lora=request.lora,
        )  # fmt: skip
        try:
            wait = hold_s if deadline is None else max(min(hold_s, deadline - loop.time()), 0.0)
            lease = await pool.acquire(route, exclude=tried, wait_s=wait)
        except ServiceUnavailable:
            if last_error is not None:  # every worker failed it: say how the last one did
                raise last_error from None
            raise
        before = len(produced)
        tried.append(lease.worker_id)
        if on_worker is not None:
            on_worker(lease.worker_id)
        timeout = None
        if deadline is not None:
            timeout = deadline - loop.time()
            if timeout <= 0:
                lease.release()
                raise GatewayTimeout("the request timed out", code="timeout")
        span = trace.child(
            "attempt",
            {"diptych.attempt": attempt, "diptych.worker_id": lease.worker_id,
             "diptych.request_id": attempt_request.request_id, "diptych.replayed_tokens": before},
            kind="client",
        )  # fmt: skip
        if lease.pull is not None:  # another worker holds more of the prompt: name it
            attempt_request = dataclasses.replace(
                attempt_request, kv_peer=lease.pull.holder, kv_peer_blocks=lease.pull.blocks
            )
        try:
            async with lease.client.generate(
                attempt_request, timeout=timeout, traceparent=span.traceparent
            ) as stream:
                async for chunk in stream:
                    produced.extend(chunk.token_ids)
                    if chunk.token_ids or chunk.finished:
                        lease.prefilled(chunk.usage.cached_tokens if chunk.usage else None)
                    if chunk.usage is not None:
                        if attempt == 0 or not cached:
                            cached = min(chunk.usage.cached_tokens, len(prompt))
                        chunk = dataclasses.replace(
                            chunk,
                            usage=dataclasses.replace(
                                chunk.usage,
                                prompt_tokens=len(prompt),
                                completion_tokens=len(produced),
                                cached_tokens=cached,
                            ),
                        )
                    yield chunk
                    if chunk.finished:
                        return
        except GenerateError as e:
            span.error(str(e))
            if e.code not in FAILOVER_CODES or attempt + 1 >= max_attempts:
                raise
            lease.failed()
            last_error = e
            migrated = bool(produced)
            span.set("diptych.failover", "migration" if migrated else "retry")
            log.warning(
                "request %s: worker %s failed (%s) after %d tokens; %s on another worker",
                request.request_id, lease.worker_id, e, len(produced),
                "migrating" if migrated else "retrying",
            )  # fmt: skip
            if on_failover is not None:
                on_failover(migrated, lease.worker_id, e)
        finally:
            span.end()
            lease.release(produced[before:])
    raise AssertionError("unreachable: the last attempt re-raises")  # pragma: no cover


def _for_attempt(
    request: GenerateRequest, produced: list[int], attempt: int, max_model_len: int | None
) -> GenerateRequest | None:
    """The request to send on ``attempt``: the original, or prompt + tokens so far with
    the budget reduced; None when nothing is left to generate."""
    if attempt == 0:
        return request
    rid = f"{request.request_id}~{attempt}"
    if not produced:
        return dataclasses.replace(request, request_id=rid)
    done = len(produced)
    s = request.sampling
    max_tokens = None if s.max_tokens is None else s.max_tokens - done
    if max_tokens is not None and max_tokens < 1:
        return None
    prompt = request.prompt_token_ids + tuple(produced)
    if max_model_len is not None and len(prompt) >= max_model_len:
        return None
    sampling = dataclasses.replace(
        s,
        max_tokens=max_tokens,
        min_tokens=max(s.min_tokens - done, 0),
        # a grammar and a reasoning count resume where the output stopped
        output_replay=s.output_replay + done,
    )
    return dataclasses.replace(request, request_id=rid, prompt_token_ids=prompt, sampling=sampling)


@dataclass(frozen=True)
class Delta:
    """New output: text made final by these tokens (possibly ""), and the tokens."""

    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None  # "stop" or "length" on the last delta


@dataclass(frozen=True)
class ChoiceResult:
    """One choice's whole output (a non-streamed response)."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str


class Generation:
    def __init__(
        self,
        tokens: AsyncGenerator[GenerateChunk, None],
        tokenizer: Tokenizer,
        prepared: PreparedRequest,
        metrics: FrontendMetrics,
        arrival: float,
    ) -> None:
        self._tokens = tokens
        self._prepared = prepared
        self._metrics = metrics
        self._arrival = arrival  # time.perf_counter() at arrival
        self._detok = IncrementalDetokenizer(
            tokenizer,
            prepared.prompt_token_ids,
            skip_special_tokens=prepared.sampling.skip_special_tokens,
            stop=list(prepared.sampling.stop),
            include_stop_str_in_output=prepared.sampling.include_stop_str_in_output,
            keep_special=prepared.keep_special,
        )
        self.prompt_token_ids = prepared.prompt_token_ids
        self.num_tokens = 0
        # a reasoning model's thinking tokens, counted as the engine counts them
        self._reasoning: ReasoningState | None = None
        s = prepared.sampling
        if s.reasoning_end or s.reasoning_start:
            decode = None
            if len(s.reasoning_end) > 1:
                decode = functools.partial(tokenizer.decode, skip_special_tokens=False)
            self._reasoning = ReasoningState(s, decode)
        self.finish_reason: str | None = None
        self.cached_tokens = 0
        self._last_token_at: float | None = None

    async def deltas(self) -> AsyncGenerator[Delta, None]:
        """The output; the last delta carries ``finish_reason``. Raises :class:`APIError`
        (a worker's error as the HTTP error it maps to)."""
        try:
            async with contextlib.aclosing(self._tokens) as tokens:
                async for chunk in tokens:
                    self._on_tokens(chunk)
                    text = self._detok.push(chunk.token_ids)
                    if self._detok.stopped:
                        yield self._finish(Delta(text, chunk.token_ids, chunk.logprobs, "stop"))
                        return  # closing the token stream cancels the request on the worker
                    if chunk.finished:
                        if chunk.finish_reason is FinishReason.ABORT:
                            raise ServiceUnavailable(
                                "the decode worker aborted the request", code="worker_aborted"
                            )
                        text += self._detok.flush()
                        reason = "length" if chunk.finish_reason is FinishReason.LENGTH else "stop"
                        yield self._finish(Delta(text, chunk.token_ids, chunk.logprobs, reason))
                        return
                    if text or chunk.token_ids:
                        yield Delta(text, chunk.token_ids, chunk.logprobs)
        except GenerateError as e:
            raise from_worker_error(e) from None

    def _on_tokens(self, chunk: GenerateChunk) -> None:
        if chunk.usage is not None:
            self.cached_tokens = chunk.usage.cached_tokens
        n = len(chunk.token_ids)
        if not n:
            return
        now = time.perf_counter()
        m = self._metrics
        scale = m.time_scale
        if self._last_token_at is None:
            m.ttft.observe((now - self._arrival) * scale)  # a first chunk's tokens: no ITL
        else:
            gap = (now - self._last_token_at) / n * scale
            for _ in range(n):
                m.itl.observe(gap)
        self._last_token_at = now
        self.num_tokens += len(chunk.token_ids)
        if self._reasoning is not None:
            for token in chunk.token_ids:
                self._reasoning.accept(token)

    @property
    def reasoning_tokens(self) -> int:
        return self._reasoning.tokens if self._reasoning is not None else 0

    def _finish(self, delta: Delta) -> Delta:
        self.finish_reason = delta.finish_reason
        m = self._metrics
        m.e2e.observe((time.perf_counter() - self._arrival) * m.time_scale)
        m.prompt_tokens.inc(len(self._prepared.prompt_token_ids))
        m.cached_tokens.inc(self.cached_tokens)
        m.generation_tokens.inc(self.num_tokens)
        if self._reasoning is not None:
            m.reasoning_tokens.labels(self._prepared.api_key or "-").inc(self.reasoning_tokens)
        return delta


# (choice index, the worker to prefer or None) -> the choice's generation; the maker
# calls ``on_worker`` with the worker each attempt runs on.
MakeChoice = Callable[[int, str | None, Callable[[str], None]], Generation]


class Choices:
    def __init__(self, n: int, make: MakeChoice) -> None:
        self.n = n
        self._make = make
        self.generations: list[Generation] = []
        self._worker: str | None = None

    @property
    def usage(self) -> Usage:
        first = self.generations[0]
        completion = sum(g.num_tokens for g in self.generations)
        reasoning = sum(g.reasoning_tokens for g in self.generations)
        return Usage(
            len(first.prompt_token_ids), completion, first.cached_tokens,
            reasoning_tokens=reasoning,
        )  # fmt: skip

    def _on_worker(self, worker_id: str) -> None:
        self._worker = worker_id

    def _start(self, index: int, prefer: str | None) -> AsyncGenerator[Delta, None]:
        gen = self._make(index, prefer, self._on_worker if index == 0 else lambda _: None)
        self.generations.append(gen)
        return gen.deltas()

    async def deltas(self) -> AsyncGenerator[tuple[int, Delta], None]:
        """Every choice's deltas, interleaved as they come; each choice's last delta
        carries its finish reason. Raises what a choice raises (APIError)."""
        first_stream = self._start(0, None)
        if self.n == 1:
            async with contextlib.aclosing(first_stream):
                async for d in first_stream:
                    yield 0, d
            return
        streams = [first_stream]
        queue: asyncio.Queue[tuple[int, Delta | BaseException]] = asyncio.Queue()
        tasks: list[asyncio.Task[None]] = []

        async def pump(i: int, stream: AsyncGenerator[Delta, None]) -> None:
            try:
                async for d in stream:
                    await queue.put((i, d))
            except Exception as e:  # handed to the reader, which raises it
                await queue.put((i, e))

        try:
            first = await anext(first_stream)
            yield 0, first
            worker = self._worker
            streams += [self._start(i, worker) for i in range(1, self.n)]
            open_ = set(range(self.n))
            if first.finish_reason is not None:
                open_.discard(0)
            tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams) if i in open_]
            while open_:
                i, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason is not None:
                    open_.discard(i)
                yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for s in streams:
                await s.aclose()
