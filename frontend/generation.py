"""One request's output as text: token chunks in, :class:`Delta` out.

Tokens are detokenized incrementally; a stop string ends the output there (the match
itself is never emitted unless ``include_stop_str_in_output``), even when it spans
several tokens or chunks, and ending it closes the token stream, which cancels the
request on the worker. Latency and token metrics are recorded here, where each token
is first seen.

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
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from frontend.errors import ServiceUnavailable, from_worker_error
from frontend.metrics import FrontendMetrics
from frontend.protocol import PreparedRequest
from runtime.rpc import FinishReason, GenerateChunk, GenerateError, TokenLogprob, Usage


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
        )
        self.prompt_token_ids = prepared.prompt_token_ids
        self.num_tokens = 0
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

    def _finish(self, delta: Delta) -> Delta:
        self.finish_reason = delta.finish_reason
        m = self._metrics
        m.e2e.observe((time.perf_counter() - self._arrival) * m.time_scale)
        m.prompt_tokens.inc(len(self._prepared.prompt_token_ids))
        m.cached_tokens.inc(self.cached_tokens)
        m.generation_tokens.inc(self.num_tokens)
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
        return Usage(len(first.prompt_token_ids), completion, first.cached_tokens)

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
