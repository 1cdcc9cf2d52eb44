"""A streaming OpenAI-API client that times every server-sent event.

One `send` per request: POST with `stream: true` and `stream_options.include_usage`,
then read the SSE lines. Every `data:` event with a non-empty `choices` list is a
token event (its text may be empty, as after a special token); the first sets TTFT,
each later one adds an inter-token latency, the last ends E2EL. The usage event, if
the server sends one, gives the output token count; otherwise the generated text is
counted with the tokenizer, or failing that the token events are. A reasoning model's
thinking (``reasoning_content`` deltas) and its count (``completion_tokens_details.
reasoning_tokens``) give the thinking rate and the time to the final answer (TTFA:
the first content after the thinking).

A request fails on an HTTP status other than 200, an `error` object in the stream, a
stream without any token event, a transport error, or the request timeout.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from bench.metrics import RequestResult
from bench.request import Request

_ERROR_CHARS = 500


@dataclass(frozen=True)
class Endpoint:
    """Where and how to send: the full URL and the request body's fixed fields."""

    api_url: str
    model: str
    chat: bool = False
    ignore_eos: bool = False
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)
    # send a multi-turn request's session as X-Session-Id (unique to this client)
    session_header: bool = False

    def body(self, req: Request) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "max_tokens": req.output_len}
        if self.chat:
            out["messages"] = req.chat_messages()
        else:
            out["prompt"] = req.prompt
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}
        if self.ignore_eos:
            out["ignore_eos"] = True
        if req.thinking is not None:
            out["max_reasoning_tokens"] = req.thinking
        out.update(self.extra_body)
        return out


class OpenAIClient:
    """Sends `Request`s to one endpoint over a shared connection pool."""

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        timeout_s: float = 6 * 3600,
        count_tokens: Callable[[str], int] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.count_tokens = count_tokens
        self._sessions = uuid.uuid4().hex[:12]  # this run's sessions, not an earlier run's
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=60.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
            transport=transport,
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def send(self, req: Request) -> RequestResult:
        """Send one request and time its stream; never raises for a failed request."""
        result = RequestResult(prompt_len=req.prompt_len, tag=req.tag)
        result.start_time = time.perf_counter()
        try:
            await asyncio.wait_for(self._stream(req, result), self.timeout_s)
        except asyncio.TimeoutError:
            result.success = False
            result.error = f"timed out after {self.timeout_s:g} s"
        except Exception as e:  # any failure of one request is that request's result
            result.success = False
            result.error = f"{type(e).__name__}: {e}"[:_ERROR_CHARS]
        return result

    async def _stream(self, req: Request, result: RequestResult) -> None:
        ep = self.endpoint
        headers = {"Content-Type": "application/json", **ep.headers}
        if ep.session_header and req.session is not None:
            headers["X-Session-Id"] = f"{self._sessions}-{req.session}"
        st = result.start_time
        last = st
        events = 0
        usage_tokens: int | None = None
        texts: list[str] = []
        thinking = False  # a reasoning_content delta was seen
        async with self._http.stream(
            "POST", ep.api_url, json=ep.body(req), headers=headers
        ) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                result.error = f"HTTP {resp.status_code}: {body}"[:_ERROR_CHARS]
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments (": ping"), event names
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                event = orjson.loads(data)
                if not isinstance(event, dict):
                    continue
                if event.get("error"):
                    result.error = f"error event: {json.dumps(event['error'])}"[:_ERROR_CHARS]
                    return
                choices = event.get("choices")
                if choices:
                    if events == 0:
                        result.ttft = now - st
                    else:
                        result.itl.append(now - last)
                    last = now
                    events += 1
                    text = _text(choices[0])
                    texts.append(text)
                    if _thinks(choices[0]):
                        thinking = True
                    elif thinking and text and result.ttfa is None:
                        result.ttfa = now - st  # the answer after the thinking
                usage = event.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
                    if usage.get("prompt_tokens") is not None:
                        result.prompt_len = int(usage["prompt_tokens"])
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        result.cached_tokens = int(details["cached_tokens"])
                    done = usage.get("completion_tokens_details") or {}
                    if done.get("reasoning_tokens"):
                        result.reasoning_tokens = int(done["reasoning_tokens"])
        if events == 0:
            result.error = "the stream ended without any token event"
            return
        result.generated_text = "".join(texts)
        result.latency = last - st
        if usage_tokens is not None:
            result.output_tokens = usage_tokens
        elif self.count_tokens is not None:
            result.output_tokens = self.count_tokens(result.generated_text)
        else:
            result.output_tokens = events
        result.success = True


def _thinks(choice: Any) -> bool:
    """A chat delta of thinking (``reasoning_content``, vLLM's and Diptych's field)."""
    delta = choice.get("delta") if isinstance(choice, dict) else None
    return isinstance(delta, dict) and bool(delta.get("reasoning_content"))


def _text(choice: Any) -> str:
    if not isinstance(choice, dict):
        return ""
    if isinstance(choice.get("text"), str):
        return str(choice["text"])
    delta = choice.get("delta")
    if isinstance(delta, dict) and isinstance(delta.get("content"), str):
        return str(delta["content"])
    return ""
