"""Serving one completion or chat request, streamed or not.

    body -> parse -> model check -> prepare (template, tokens, sampling)
         -> generate_tokens (routing, retries, migration) -> Generation (text, stops)
         -> renderer (OpenAI shapes) -> JSON or SSE

A streamed response waits for its first output before sending the 200, so that an
error before any token (no worker, a prompt the worker refuses) still arrives as an
HTTP error with its status code; later errors arrive as an SSE ``{"error": ...}`` event
followed by ``[DONE]``. Whether streamed or not, a client that disconnects cancels
the request on its worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Literal

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.grammar import GrammarCompiler
from engine.tokenizer import Tokenizer
from frontend.config import FrontendConfig
from frontend.errors import (
    APIError,
    BadRequest,
    InternalError,
    ModelNotFound,
    Overloaded,
    PayloadTooLarge,
    from_worker_error,
)
from frontend.generation import ChoiceResult, Choices, Delta, Generation, generate_tokens
from frontend.logprobs import TokenTexts
from frontend.lora import LoraRegistry
from frontend.metrics import FrontendMetrics
from frontend.model_formats import ModelFormats
from frontend.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    PreparedRequest,
    parse,
    prepare_chat,
    prepare_completion,
    refuse_oversized_body,
)
from frontend.responses import (
    ChatRenderer,
    ClientDisconnected,
    CompletionRenderer,
    EventStreamResponse,
    Renderer,
    encode,
    until_disconnect,
)
from frontend.responses_api import ResponsesRenderer, ResponsesRequest, to_chat
from frontend.workers import WorkerPool, check_admission, priority_class
from protocol.lora import AdapterRef
from protocol.sampling import SamplingParams
from runtime.rpc import GenerateError, GenerateRequest, TokenLogprob
from runtime.tracing import NO_SPAN, Span

log = logging.getLogger(__name__)

# Answered to a client that is gone (nobody reads it); the status nginx logs for it.
CLIENT_CLOSED = 499


@dataclass
class FrontendState:
    """Everything the routes share; one per app."""

    config: FrontendConfig
    tokenizer: Tokenizer
    model_name: str
    pool: WorkerPool
    metrics: FrontendMetrics
    texts: TokenTexts
    grammar: GrammarCompiler  # validates structured-output constraints
    loras: LoraRegistry  # the LoRA adapters a request's `model` may name
    formats: ModelFormats  # the model's thinking markers and tool-call format
    in_flight: int = 0  # requests from when they are handed to the pool to their end
    # long-thinking requests in flight by API key (the per-key cap)
    long_thinking: dict[str, int] = field(default_factory=dict)
    admitting: int = 0  # admitted, not yet handed to the pool (being tokenized)

    def max_model_len(self) -> int | None:
        """The workers' stated context window, else the configured one."""
        return self.pool.max_model_len() or self.config.max_model_len

    def check_model(self, model: str) -> AdapterRef | None:
        """The LoRA adapter `model` names (None: the base model); 404 if neither."""
        if model in (self.model_name, self.config.model):
            return None
        if len(self.loras):
            return self.loras.resolve(model)
        raise ModelNotFound(model)

    def admit(self, request: Request, priority: int) -> None:
        """Refuse (429) a request the saturated pool has no room for (admission.py)."""
        try:
            cls = priority_class(request.headers.get("x-priority"), priority)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        views = self.pool.views()
        ours = self.in_flight + self.admitting
        unplaced = max(ours - sum(v.in_flight for v in views), 0)
        try:
            check_admission(self.config.admission, views, ours, cls, unplaced)
        except Overloaded:
            self.metrics.shed.labels(cls).inc()
            raise
        self.admitting += 1
        request.state.admitted = True
        request.state.priority_class = cls

    def take_long_thinking(self, prepared: PreparedRequest) -> str | None:
        """Count a long-thinking request against its key's cap (429 over it); the key
        to release when it ends, None for a request that is not one."""
        budget = prepared.sampling.max_reasoning_tokens
        if budget is None or budget < self.config.long_thinking_tokens:
            return None
        key = prepared.api_key or "-"
        cap = self.config.max_long_thinking_per_key
        held = self.long_thinking.get(key, 0)
        if cap and held >= cap:
            self.metrics.shed.labels("long_thinking").inc()
            raise Overloaded(
                f"this API key has {held} long-thinking requests in flight, the most it may "
                f"(--max-long-thinking-per-key); retry when one ends",
                self.config.admission.retry_after_s,
            )
        self.long_thinking[key] = held + 1
        return key

    def release_long_thinking(self, key: str | None) -> None:
        if key is not None:
            self.long_thinking[key] -= 1
            if not self.long_thinking[key]:
                del self.long_thinking[key]

    def admitted(self, request: Request) -> None:
        """An admitted request is handed to the pool, or ended before that."""
        if getattr(request.state, "admitted", False):
            request.state.admitted = False
            self.admitting -= 1


async def read_body(request: Request, limit: int) -> bytes:
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise PayloadTooLarge(f"the request body exceeds {limit} bytes")
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise PayloadTooLarge(f"the request body exceeds {limit} bytes")
        parts.append(part)
    return b"".join(parts)  # one copy (a growing bytearray copied a 30 MB body ~10 times)


async def serve_generation(
    state: FrontendState,
    request: Request,
    endpoint: Literal["chat", "completions", "responses"],
) -> Response:
    arrival = time.perf_counter()
    try:
        prepared, renderer, max_len = await _prepare(state, request, endpoint)
    finally:
        state.admitted(request)
    return await _serve(state, request, prepared, renderer, max_len, arrival)


async def _prepare(
    state: FrontendState,
    request: Request,
    endpoint: Literal["chat", "completions", "responses"],
) -> tuple[PreparedRequest, Renderer | ResponsesRenderer, int | None]:
    """Read, parse, admit and prepare (template, tokenize) one request."""
    body = await read_body(request, state.config.max_request_bytes)
    max_len = state.max_model_len()
    responses = None
    req: ChatCompletionRequest | CompletionRequest
    if endpoint == "responses":  # refused as the Responses API words it, then a chat
        responses = parse(ResponsesRequest, body)
        req = to_chat(responses)
    elif endpoint == "chat":
        refuse_oversized_body(body, ("messages",), state.tokenizer, max_len)
        req = parse(ChatCompletionRequest, body)
    else:
        refuse_oversized_body(body, ("prompt",), state.tokenizer, max_len)
        req = parse(CompletionRequest, body)
    lora = state.check_model(req.model)
    state.admit(request, req.priority)
    renderer: Renderer | ResponsesRenderer
    model = state.model_name if lora is None else lora.name
    key: str | None = getattr(request.state, "api_key", None)
    if isinstance(req, CompletionRequest):
        prepared = await asyncio.to_thread(
            prepare_completion, req, state.tokenizer, max_len, state.grammar, state.formats
        )
        prepared = dataclasses.replace(prepared, lora=lora, api_key=key)
        renderer = CompletionRenderer(model, prepared, state.texts)
    else:
        prepared = await asyncio.to_thread(
            prepare_chat, req, state.tokenizer, max_len, state.grammar, state.formats
        )
        prepared = dataclasses.replace(prepared, lora=lora, api_key=key)
        renderer = (
            ChatRenderer(model, prepared, state.texts)
            if responses is None
            else ResponsesRenderer(model, prepared, state.texts, responses)
        )
    log.debug("request %s is %s", request.state.request_id, renderer.id)
    return prepared, renderer, max_len


def _adapter(lora: AdapterRef | None) -> tuple[str, str]:
    """GenerateRequest's (lora_name, lora_path)."""
    return ("", "") if lora is None else (lora.name, lora.path)


async def probe_adapter(state: FrontendState, ref: AdapterRef, timeout_s: float = 120.0) -> None:
    """Run a one-token request for adapter `ref` on a decode worker: it reads and checks
    the adapter there (and keeps it in host memory). Raises the API error a worker's
    refusal means (400 with its reason for an adapter it cannot serve)."""
    loop = asyncio.get_running_loop()
    probe = GenerateRequest(
        f"lora-load-{uuid.uuid4().hex}", (state.tokenizer.eos_token_ids[0],),
        SamplingParams(max_tokens=1, temperature=0.0), lora_name=ref.name, lora_path=ref.path,
    )  # fmt: skip
    try:
        async for _ in generate_tokens(state.pool, probe, max_attempts=1,
                                       deadline=loop.time() + timeout_s):  # fmt: skip
            pass
    except GenerateError as e:
        raise from_worker_error(e) from None


async def _serve(
    state: FrontendState,
    request: Request,
    prepared: PreparedRequest,
    renderer: Renderer | ResponsesRenderer,
    max_len: int | None,
    arrival: float,
) -> Response:

    config, metrics = state.config, state.metrics
    deadline = None
    if config.request_timeout_s is not None:
        timeout = config.request_timeout_s / config.time_scale
        deadline = asyncio.get_running_loop().time() + timeout

    def failover(migrated: bool, worker_id: str, error: Exception) -> None:
        metrics.failovers.labels("migration" if migrated else "retry").inc()

    session = _session_id(request, prepared)
    trace: Span = getattr(request.state, "trace", NO_SPAN)  # the request's (app.py)

    def make(index: int, prefer: str | None, on_worker: Callable[[str], None]) -> Generation:
        sampling, rid = prepared.sampling, renderer.id
        if prepared.n > 1:
            rid = f"{rid}-{index}"
            if sampling.seed is not None:
                sampling = dataclasses.replace(sampling, seed=(sampling.seed + index) % 2**64)
        # the session's turn is choice 0 (its siblings go where it went: `prefer`)
        turn_of = (session or "") if index == 0 else ""
        lora_name, lora_path = _adapter(prepared.lora)
        tokens = generate_tokens(
            state.pool,
            GenerateRequest(
                rid, prepared.prompt_token_ids, sampling, prepared.priority, session_id=turn_of,
                lora_name=lora_name, lora_path=lora_path,
            ),
            max_attempts=config.max_attempts,
            deadline=deadline,
            max_model_len=max_len,
            on_failover=failover,
            prefer=prefer,
            on_worker=on_worker,
            hold_s=config.hold_for_workers_s,
            trace=trace,
        )
        return Generation(tokens, state.tokenizer, prepared, metrics, arrival)

    long_key = state.take_long_thinking(prepared)
    choices = Choices(prepared.n, make)
    deltas = choices.deltas()
    metrics.in_flight.inc()
    state.in_flight += 1
    metrics.arrivals.inc()
    metrics.prompt_length.observe(len(prepared.prompt_token_ids))
    streaming = False
    try:
        if prepared.stream:
            first = await until_disconnect(request.receive, _next(deltas))
            streaming = True

            async def close() -> None:
                await deltas.aclose()
                metrics.in_flight.dec()
                state.in_flight -= 1
                state.release_long_thinking(long_key)

            return EventStreamResponse(
                _sse(first, deltas, renderer, choices, state),
                on_disconnect=metrics.cancelled.inc,
                on_close=close,
            )
        results = await until_disconnect(request.receive, _collect(deltas, prepared.n))
        return JSONResponse(renderer.response(results, choices.usage))
    except ClientDisconnected:
        metrics.cancelled.inc()
        return Response(status_code=CLIENT_CLOSED)
    except Overloaded:  # every worker refused it as full: shed too, a step later
        metrics.shed.labels(request.state.priority_class).inc()
        raise
    finally:
        if not streaming:
            await deltas.aclose()
            metrics.in_flight.dec()
            state.in_flight -= 1
            state.release_long_thinking(long_key)


MAX_SESSION_ID = 256


def _session_id(request: Request, prepared: PreparedRequest) -> str | None:
    """The conversation a request belongs to, for session-affine routing: the
    ``X-Session-Id`` header, else the body's ``user``."""
    session = request.headers.get("x-session-id") or prepared.user
    if session is not None and len(session) > MAX_SESSION_ID:
        raise BadRequest(
            f"the session id (X-Session-Id or user) is longer than {MAX_SESSION_ID} characters",
            param="user",
        )
    return session or None


async def _next(deltas: AsyncGenerator[tuple[int, Delta], None]) -> tuple[int, Delta]:
    return await anext(deltas)


async def _collect(deltas: AsyncIterator[tuple[int, Delta]], n: int) -> list[ChoiceResult]:
    parts: list[list[str]] = [[] for _ in range(n)]
    ids: list[list[int]] = [[] for _ in range(n)]
    logprobs: list[list[TokenLogprob]] = [[] for _ in range(n)]
    reasons: list[str | None] = [None] * n
    async for i, d in deltas:
        parts[i].append(d.text)
        ids[i].extend(d.token_ids)
        logprobs[i].extend(d.logprobs)
        if d.finish_reason is not None:
            reasons[i] = d.finish_reason
    if any(r is None for r in reasons):
        raise InternalError("the output ended without a finish reason")
    return [
        ChoiceResult("".join(p), t, lp, r or "")
        for p, t, lp, r in zip(parts, ids, logprobs, reasons)
    ]


async def _sse(
    first: tuple[int, Delta],
    deltas: AsyncGenerator[tuple[int, Delta], None],
    renderer: Renderer | ResponsesRenderer,
    choices: Choices,
    state: FrontendState,
) -> AsyncGenerator[bytes, None]:
    try:
        for chunk in renderer.start():
            yield renderer.encode(chunk)
        index, delta = first
        open_ = choices.n
        while True:
            for piece in renderer.delta(delta, index):
                yield renderer.encode(piece)
            if delta.finish_reason is not None:
                for chunk in renderer.close(delta.finish_reason, index):
                    yield renderer.encode(chunk)
                open_ -= 1
                if not open_:
                    for chunk in renderer.end(choices.usage):
                        yield renderer.encode(chunk)
                    break
            index, delta = await anext(deltas)
    except APIError as e:
        state.metrics.stream_errors.inc()
        log.warning("stream %s ended by an error: %s", renderer.id, e.message)
        yield encode(e.body())
    except Exception as e:
        state.metrics.stream_errors.inc()
        log.exception("stream %s failed", renderer.id)
        yield encode(InternalError(f"internal error: {type(e).__name__}").body())
    if renderer.done:
        yield renderer.done
