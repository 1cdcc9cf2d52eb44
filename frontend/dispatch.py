"""One request's tokens from the decode pool, across retries and migrations.

The caller sees a single stream of :class:`GenerateChunk` whatever happens underneath:

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
first worker would have produced.

Usage in the chunks is rewritten in terms of the client's request: prompt tokens are
the original prompt, completion tokens all tokens generated, cached tokens those of the
original prompt only.

Closing the iterator early (a stop string matched, the client went away) cancels the
RPC in flight, and the worker aborts the request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncGenerator, Callable

from frontend.errors import GatewayTimeout, ServiceUnavailable
from frontend.router import RouteRequest
from frontend.workers import WorkerPool
from runtime.rpc import (
    ErrorCode,
    FinishReason,
    GenerateChunk,
    GenerateError,
    GenerateRequest,
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
    session_id: str | None = None,
    prefer: str | None = None,
    on_worker: Callable[[str], None] | None = None,
    hold_s: float = 0.0,
    trace: Span = NO_SPAN,
) -> AsyncGenerator[GenerateChunk, None]:
    """Stream ``request``'s tokens; ``deadline`` is on the event loop's clock;
    ``session_id`` is the client's conversation, a hint for the router; ``prefer`` a
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
            cache_salt=request.cache_salt, session_id=session_id,
            prefer=prefer if attempt == 0 else None,
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
        # a grammar resumes where the output stopped
        grammar_replay=s.grammar_replay + done if s.grammar is not None else 0,
    )
    return dataclasses.replace(request, request_id=rid, prompt_token_ids=prompt, sampling=sampling)
