"""The FastAPI application: OpenAI routes, health, readiness, metrics, error shapes.

``create_app(config)`` loads the tokenizer at once (a bad model path fails here, not at
the first request) and connects to discovery when the app starts (its lifespan).
Tests and embedders may pass their own tokenizer, router or discovery client; a
discovery client passed in is neither connected nor closed by the app.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.grammar import GrammarCompiler
from engine.tokenizer import Tokenizer, load_tokenizer
from frontend.auth import ApiKeyMiddleware, ApiKeys
from frontend.config import FrontendConfig
from frontend.errors import (
    APIError,
    BadRequest,
    InternalError,
    MethodNotAllowed,
    RouteNotFound,
)
from frontend.logprobs import TokenTexts
from frontend.lora import LoraRegistry, load_request, unload_request
from frontend.metrics import FrontendMetrics, RouterMetrics
from frontend.model_formats import ModelFormats
from frontend.router import KvRouter, LeastLoadedRouter, Router
from frontend.serving import FrontendState, probe_adapter, read_body, serve_generation
from frontend.tokenize import detokenize, tokenize
from frontend.workers import WorkerPool
from protocol.declare import check_request_id
from runtime.config import make_discovery
from runtime.discovery import Discovery
from runtime.metrics import gauge
from runtime.tracing import NO_SPAN, NO_TRACER, Tracer, open_tracer

log = logging.getLogger(__name__)

# Paths counted in diptych_frontend_requests_total; anything else is "other".
_ENDPOINTS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/models",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/tokenize",
    "/detokenize",
    "/health",
    "/ready",
)


# Paths whose requests are traced (the root span of a request's trace is here).
_GENERATION = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})


class RequestContext:
    """Gives each request an id (the client's ``X-Request-Id`` if usable, else a new
    one), echoes it in the response headers, and counts requests by status. With
    tracing on, a generation request's server span, the root of its trace (or a child
    of the client's ``traceparent``), lasts until its response is sent."""

    def __init__(self, app: ASGIApp, metrics: FrontendMetrics, tracer: Tracer = NO_TRACER) -> None:
        self.app = app
        self.metrics = metrics
        self.tracer = tracer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id, traceparent = "", ""
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                try:
                    request_id = check_request_id(value.decode("latin-1"))
                except ValueError:
                    log.info("ignoring an unusable X-Request-Id header")
            elif name == b"traceparent":
                traceparent = value.decode("latin-1")
        request_id = request_id or uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        span = NO_SPAN
        if self.tracer.on and scope["path"] in _GENERATION:
            route = f"{scope['method']} {scope['path']}"
            span = self.tracer.start(
                route, traceparent, {"http.request.method": scope["method"],
                                     "http.route": scope["path"],
                                     "diptych.http_request_id": request_id},
                kind="server",
            )  # fmt: skip
        state["trace"] = span
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if span.recording:
                span.set("http.response.status_code", status)
                if status >= 500:
                    span.error(f"HTTP {status}")
                span.end()
            path = scope["path"]
            endpoint = path if path in _ENDPOINTS else "other"
            if path.startswith("/v1/models/"):
                endpoint = "/v1/models"
            self.metrics.requests.labels(endpoint, str(status)).inc()


def create_app(
    config: FrontendConfig,
    *,
    tokenizer: Tokenizer | None = None,
    router: Router | None = None,
    discovery: Discovery | None = None,
) -> FastAPI:
    tokenizer = tokenizer or load_tokenizer(config.model)
    if config.chat_template is not None:
        try:
            tokenizer.hf_tokenizer.chat_template = Path(config.chat_template).read_text()
        except OSError as e:
            raise ValueError(f"--chat-template {config.chat_template}: {e.strerror}") from None
    metrics = FrontendMetrics(time_scale=config.time_scale)
    tracer = open_tracer(config.otlp_endpoint, "diptych-frontend")
    pool = WorkerPool(
        router or make_router(config, metrics),
        cooldown_s=config.worker_cooldown_s,
        on_change=metrics.workers.set,
        on_proof_failure=metrics.worker_proof_failures.inc,
        max_held=config.max_held,
        on_held=metrics.held.set,
    )
    tokenizer.max_token_chars  # noqa: B018 - read once now, not by the first long prompt
    state = FrontendState(
        config=config,
        tokenizer=tokenizer,
        model_name=config.served_model_name or tokenizer.name or "default",
        pool=pool,
        metrics=metrics,
        texts=TokenTexts(tokenizer),
        grammar=GrammarCompiler(
            tokenizer.hf_tokenizer, list(tokenizer.eos_token_ids), tokenizer.vocab_size
        ),
        loras=LoraRegistry(config.lora_modules),
        formats=ModelFormats.resolve(
            tokenizer, config.reasoning_parser, config.tool_call_parser, config.effort_budgets()
        ),
    )
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned = discovery is None
        d = discovery or make_discovery(config.discovery_url, config.discovery_options())
        if owned:
            await d.connect()
        pool.start(d)
        log.info("frontend serving %r; watching decode workers in %s", state.model_name, d)
        try:
            yield
        finally:
            await pool.close()
            if owned:
                await d.close()
            if tracer.on:
                await asyncio.to_thread(tracer.close)  # flush the last requests' spans

    app = FastAPI(
        title="Diptych", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.frontend = state
    if config.api_keys:  # inside RequestContext: a refusal still gets its id and count
        app.add_middleware(ApiKeyMiddleware, keys=ApiKeys(config.api_keys))
    app.add_middleware(RequestContext, metrics=metrics, tracer=tracer)
    _add_error_handlers(app)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> Response:
        n = pool.num_workers
        if n:
            return JSONResponse({"status": "ready", "decode_workers": n})
        if config.hold_for_workers_s > 0:  # a pool scaled to zero: requests wake it
            return JSONResponse({"status": "ready", "decode_workers": 0, "held": pool.held})
        return JSONResponse({"status": "not ready", "decode_workers": 0}, status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict[str, Any]:
        return {
            "id": state.model_name,
            "object": "model",
            "created": started,
            "owned_by": "diptych",
            "max_model_len": state.max_model_len(),
            # every decode worker batch-invariant (`--deterministic`): a greedy or seeded
            # request's tokens do not depend on what else is served
            "deterministic": pool.deterministic(),
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list",
                "data": [model_card(), *state.loras.cards(state.model_name, started)]}  # fmt: skip

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        lora = state.check_model(model)
        if lora is None:
            return model_card()
        return next(c for c in state.loras.cards(state.model_name, started) if c["id"] == model)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        ref = load_request(await read_body(request, 64 * 1024))
        state.loras.add(ref)  # 400 if the name is taken
        try:
            await probe_adapter(state, ref)
        except BaseException:
            state.loras.remove(ref.name)
            raise
        log.info("LoRA adapter %s loaded from %s", ref.name, ref.path)
        return PlainTextResponse(f"Success: LoRA adapter '{ref.name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        name = unload_request(await read_body(request, 64 * 1024))
        state.loras.remove(name)  # 404 if it is not loaded
        log.info("LoRA adapter %s unloaded", name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve_generation(state, request, "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve_generation(state, request, "chat")

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await serve_generation(state, request, "responses")

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> dict[str, Any]:
        body = await read_body(request, config.max_request_bytes)
        return await asyncio.to_thread(tokenize, state, body)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> dict[str, Any]:
        body = await read_body(request, config.max_request_bytes)
        return await asyncio.to_thread(detokenize, state, body)

    return app


def make_router(config: FrontendConfig, metrics: FrontendMetrics) -> Router:
    if config.router == "least-loaded":
        return LeastLoadedRouter(config.use_load_reports)
    router = KvRouter(config.kv_router, observer=RouterMetrics(metrics.registry))
    gauge(
        metrics.registry, "frontend", "router_indexed_blocks",
        "Block entries in the router's prefix index (a block held by two workers counts twice)",
    ).set_function(lambda: router.indexed_blocks)  # fmt: skip
    return router


def _add_error_handlers(app: FastAPI) -> None:
    def respond(e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status_code, headers=e.headers())

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        if e.status_code >= 500:
            log.warning("%s %s: %s", request.method, request.url.path, e.message)
        return respond(e)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        if e.status_code == 404:
            return respond(RouteNotFound(f"no route {request.method} {request.url.path}"))
        if e.status_code == 405:
            return respond(
                MethodNotAllowed(f"method {request.method} is not allowed on {request.url.path}")
            )
        err = APIError(str(e.detail))
        err.status_code = e.status_code
        err.type = "invalid_request_error" if e.status_code < 500 else "server_error"
        return respond(err)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return respond(BadRequest(f"invalid request: {e.errors()[:1]}"))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return respond(InternalError(f"internal error: {type(e).__name__}"))
