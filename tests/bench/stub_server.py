"""A stub OpenAI server with scripted timing, for testing the load generator.

Every request waits `ttft_s`, then streams one event per output token `itl_s` apart
(the last carrying finish_reason), optionally a usage event, then [DONE]. A prompt
containing "FAIL" gets an HTTP 500; one containing "BREAK" gets an error event
after its first token. The server records each request's body, arrival and end
times, and the peak number of requests in flight.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


@dataclass
class Seen:
    body: dict[str, Any]
    arrived: float
    ended: float = 0.0
    session: str | None = None  # the X-Session-Id header


@dataclass
class StubConfig:
    ttft_s: float = 0.05
    itl_s: float = 0.005
    usage: bool = True
    model: str = "stub-model"


@dataclass
class StubState:
    seen: list[Seen] = field(default_factory=list)
    in_flight: int = 0
    peak_in_flight: int = 0


def _prompt_text(body: dict[str, Any]) -> str:
    if "messages" in body:
        return " ".join(str(m.get("content", "")) for m in body["messages"])
    return str(body.get("prompt", ""))


class StubServer:
    def __init__(self, config: StubConfig | None = None) -> None:
        self.config = config or StubConfig()
        self.state = StubState()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        app = Starlette(
            routes=[
                Route("/v1/models", self._models),
                Route("/v1/completions", self._generate, methods=["POST"]),
                Route("/v1/chat/completions", self._generate, methods=["POST"]),
            ]
        )
        self._server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> StubServer:
        self._thread.start()
        end = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > end:
                raise RuntimeError("stub server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(10)

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.config.model}]})

    async def _generate(self, request: Request) -> Response:
        body = await request.json()
        seen = Seen(body, time.perf_counter(), session=request.headers.get("x-session-id"))
        self.state.seen.append(seen)
        prompt = _prompt_text(body)
        if "FAIL" in prompt:
            seen.ended = time.perf_counter()
            return JSONResponse({"error": {"message": "scripted failure"}}, status_code=500)
        chat = "messages" in body
        return StreamingResponse(
            self._events(body, seen, chat, broken="BREAK" in prompt),
            media_type="text/event-stream",
        )

    async def _events(
        self, body: dict[str, Any], seen: Seen, chat: bool, broken: bool
    ) -> AsyncIterator[bytes]:
        cfg, st = self.config, self.state
        st.in_flight += 1
        st.peak_in_flight = max(st.peak_in_flight, st.in_flight)
        try:
            n = int(body.get("max_tokens") or 16)
            await asyncio.sleep(cfg.ttft_s)
            for i in range(n):
                if i:
                    await asyncio.sleep(cfg.itl_s)
                finish = "length" if i == n - 1 else None
                if chat:
                    choice = {"index": 0, "delta": {"content": " tok"}, "finish_reason": finish}
                else:
                    choice = {"index": 0, "text": " tok", "finish_reason": finish}
                yield _sse({"choices": [choice], "usage": None})
                if broken:
                    yield _sse({"error": {"message": "scripted mid-stream error"}})
                    return
            if cfg.usage:
                prompt_tokens = len(_prompt_text(body).split())
                usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n}
                yield _sse({"choices": [], "usage": usage})
            yield b"data: [DONE]\n\n"
        finally:
            st.in_flight -= 1
            seen.ended = time.perf_counter()


def _sse(obj: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()
