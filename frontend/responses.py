"""Response bodies and stream chunks in the exact shapes of the OpenAI API.

One renderer per endpoint, with the same methods, so that serving code is shared:
``start()`` (chunks sent before any token), ``delta(d, index)`` (the chunks of a
choice's new output, often one), ``close(reason, index)`` (the chunks ending a choice: the one
carrying its ``finish_reason``, and with tools its content or ``tool_calls``), ``end()``
(after every choice closed: the extra chunk of ``stream_options.include_usage``),
``response()`` (the whole non-streamed body), and how a chunk is framed (``encode``,
``done``). With ``n`` > 1 every chunk names its choice by ``index``. The Responses
API's renderer (frontend/responses_api.py) has the same methods.

Server-sent events, and noticing that the HTTP client went away.

``data: {json}`` frames (`encode`, `DONE`) and :class:`EventStreamResponse`, a response
that stops on disconnect. Starlette's ``StreamingResponse`` notices a client that went
away only when a write fails (ASGI 2.4 servers such as uvicorn), so a request waiting
for its next token would run on. :class:`EventStreamResponse` also waits on
``http.disconnect`` and then cancels the event iterator at once; its cleanup cancels
the request on the worker. ``on_close`` runs however the response ends, even if the
iterator never started.

An ASGI server reports a disconnect as an ``http.disconnect`` message on ``receive``
once the request body has been read. Nothing else reads ``receive`` after that, so
the frontend waits on it beside the work of a request (`until_disconnect`, for a
non-streamed response or the wait for the first token): whichever ends first wins, and
a disconnect cancels the work (whose cleanup cancels the gRPC stream, which aborts the
request on the worker). This does not depend on a send failing, so a client that
leaves during a long prefill or a queue wait is noticed at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

import orjson
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from frontend.generation import ChoiceResult, Delta
from frontend.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from frontend.message import MessageStream, message
from frontend.protocol import PreparedRequest
from runtime.rpc import Usage

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"


def encode(data: Mapping[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"  # compact UTF-8, as json.dumps would


class EventStreamResponse(Response):
    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncGenerator[bytes, None],
        headers: Mapping[str, str] | None = None,
        on_disconnect: Callable[[], None] | None = None,
        on_close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.events = events
        self.status_code = 200
        self.background = None
        self._on_disconnect = on_disconnect
        self._on_close = on_close
        self.init_headers(
            {"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})}
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self._stream(send))
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait({stream, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, watcher):
                if not task.done():
                    task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            if self._on_close is not None:  # also if the stream never started
                await asyncio.shield(self._on_close())
        error = None if stream.cancelled() else stream.exception()
        if stream.cancelled() or isinstance(error, OSError):  # a write failed: gone too
            if self._on_disconnect is not None:
                self._on_disconnect()
        elif error is not None:
            raise error

    async def _stream(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        async with contextlib.aclosing(self.events) as events:
            async for frame in events:
                await send({"type": "http.response.body", "body": frame, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class ClientDisconnected(Exception):
    """The client closed the connection before the response was complete."""


async def wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """``await work``, unless the client disconnects first: then cancel it (and wait for
    its cleanup) and raise :class:`ClientDisconnected`."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        # Also when we are cancelled ourselves: nothing may outlive the request.
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        watcher.cancel()
        with contextlib.suppress(BaseException):
            await watcher
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


Json = dict[str, Any]


def usage_json(usage: Usage) -> Json:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
    }


class _Renderer:
    id_prefix = ""
    object = ""
    chunk_object = ""
    done = DONE  # what ends the event stream

    @staticmethod
    def encode(chunk: Json) -> bytes:
        return encode(chunk)

    def __init__(self, model: str, prepared: PreparedRequest, texts: TokenTexts) -> None:
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.prepared = prepared
        self.texts = texts

    def _chunk(self, choices: list[Json]) -> Json:
        out: Json = {
            "id": self.id,
            "object": self.chunk_object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.prepared.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usage: Usage) -> Json:
        out = self._chunk([])
        out["usage"] = usage_json(usage)
        return out

    def close(self, reason: str, index: int = 0) -> list[Json]:
        return [self.finish(reason, index)]

    def finish(self, reason: str, index: int = 0) -> Json:
        raise NotImplementedError

    def end(self, usage: Usage) -> list[Json]:
        return [self.usage_chunk(usage)] if self.prepared.include_usage else []

    @property
    def wants_logprobs(self) -> bool:
        return self.prepared.sampling.logprobs is not None

    def _body(self, choices: list[Json], usage: Usage) -> Json:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage_json(usage),
        }


class ChatRenderer(_Renderer):
    id_prefix = "chatcmpl"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, model: str, prepared: PreparedRequest, texts: TokenTexts) -> None:
        super().__init__(model, prepared, texts)
        # each choice's text as message fields: thinking, content, tool calls (none for
        # a plain chat, whose text is its content)
        plain = prepared.thinking is None and prepared.tool_mode is None
        self._messages = [] if plain else [MessageStream(prepared) for _ in range(prepared.n)]

    def _choice(self, delta: Json, logprobs: Json | None, finish: str | None, i: int) -> Json:
        return {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def start(self) -> list[Json]:
        role = {"role": "assistant", "content": ""}
        return [self._chunk([self._choice(role, None, None, i)]) for i in range(self.prepared.n)]

    def delta(self, d: Delta, index: int = 0) -> list[Json]:
        logprobs = None
        if self.wants_logprobs and d.logprobs and self.prepared.tool_mode is None:
            logprobs = {"content": chat_logprobs(self.texts, d.token_ids, d.logprobs)}
        if not self._messages:
            fields = {"content": d.text} if d.text or logprobs is not None else None
        else:
            fields = self._messages[index].push(d.text)
        if fields is None and logprobs is None:
            return []
        return [self._chunk([self._choice(fields or {}, logprobs, None, index)])]

    def finish(self, reason: str, index: int = 0) -> Json:
        return self._chunk([self._choice({}, None, reason, index)])

    def close(self, reason: str, index: int = 0) -> list[Json]:
        if not self._messages:
            return [self.finish(reason, index)]
        deltas, called = self._messages[index].finish()
        out = [self._chunk([self._choice(d, None, None, index)]) for d in deltas]
        if called and reason == "stop":
            reason = "tool_calls"
        out.append(self.finish(reason, index))
        return out

    def response(self, results: list[ChoiceResult], usage: Usage) -> Json:
        choices = []
        for i, r in enumerate(results):
            lp = None
            if self.wants_logprobs:
                lp = {"content": chat_logprobs(self.texts, r.token_ids, r.logprobs)}
            msg, called = {"role": "assistant", "content": r.text}, False
            if self._messages:
                msg, called = message(r.text, self.prepared)
            reason = "tool_calls" if called and r.finish_reason == "stop" else r.finish_reason
            choices.append({"index": i, "message": msg, "logprobs": lp, "finish_reason": reason})
        return self._body(choices, usage)


class CompletionRenderer(_Renderer):
    id_prefix = "cmpl"
    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, model: str, prepared: PreparedRequest, texts: TokenTexts) -> None:
        super().__init__(model, prepared, texts)
        self._offset = [len(prepared.echo_text or "")] * prepared.n  # text offset per choice

    def _choice(self, text: str, logprobs: Json | None, finish: str | None, i: int) -> Json:
        return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def _logprobs(self, token_ids: Any, logprobs: Any, index: int) -> Json:
        out = completion_logprobs(self.texts, token_ids, logprobs, self._offset[index])
        self._offset[index] += sum(len(t) for t in out["tokens"])
        return out

    def start(self) -> list[Json]:
        echo = self.prepared.echo_text
        if not echo:
            return []
        return [self._chunk([self._choice(echo, None, None, i)]) for i in range(self.prepared.n)]

    def delta(self, d: Delta, index: int = 0) -> list[Json]:
        logprobs = None
        if self.wants_logprobs and d.logprobs:
            logprobs = self._logprobs(d.token_ids, d.logprobs, index)
        if not d.text and logprobs is None:
            return []
        return [self._chunk([self._choice(d.text, logprobs, None, index)])]

    def finish(self, reason: str, index: int = 0) -> Json:
        return self._chunk([self._choice("", None, reason, index)])

    def response(self, results: list[ChoiceResult], usage: Usage) -> Json:
        choices = []
        for i, r in enumerate(results):
            lp = self._logprobs(r.token_ids, r.logprobs, i) if self.wants_logprobs else None
            text = (self.prepared.echo_text or "") + r.text
            choices.append(self._choice(text, lp, r.finish_reason, i))
        return self._body(choices, usage)


Renderer = ChatRenderer | CompletionRenderer
