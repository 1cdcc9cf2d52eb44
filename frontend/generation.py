"""One request's output as text: token chunks in, :class:`Delta` out.

Tokens are detokenized incrementally; a stop string ends the output there (the match
itself is never emitted unless ``include_stop_str_in_output``), even when it spans
several tokens or chunks, and ending it closes the token stream, which cancels the
request on the worker. Latency and token metrics are recorded here, where each token
is first seen.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import Tokenizer
from frontend.errors import ServiceUnavailable, from_worker_error
from frontend.metrics import FrontendMetrics
from frontend.preprocess import PreparedRequest
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
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self._cached_tokens = 0
        self._last_token_at: float | None = None

    @property
    def usage(self) -> Usage:
        return Usage(len(self._prepared.prompt_token_ids), self.num_tokens, self._cached_tokens)

    async def deltas(self) -> AsyncGenerator[Delta, None]:
        """The output; the last delta carries ``finish_reason``. Raises :class:`APIError`."""
        async with contextlib.aclosing(self._deltas()) as deltas:
            try:
                async for delta in deltas:
                    yield delta
            except GenerateError as e:
                raise from_worker_error(e) from None

    async def _deltas(self) -> AsyncGenerator[Delta, None]:
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

    def _on_tokens(self, chunk: GenerateChunk) -> None:
        if chunk.usage is not None:
            self._cached_tokens = chunk.usage.cached_tokens
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
        m.cached_tokens.inc(self._cached_tokens)
        m.generation_tokens.inc(self.num_tokens)
        return delta
