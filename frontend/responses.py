"""Response bodies and stream chunks in the exact shapes of the OpenAI API.

One renderer per endpoint, with the same methods, so that serving code is shared:
``start()`` (chunks sent before any token), ``delta()`` (one chunk of new output),
``end()`` (the chunks after the last token: the one carrying ``finish_reason`` and
the extra one of ``stream_options.include_usage``), ``response()`` (the whole
non-streamed body), and how a chunk is framed (``encode``, ``done``). The Responses
API's renderer (frontend/responses_api.py) has the same methods.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from frontend.generation import Delta
from frontend.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from frontend.preprocess import PreparedRequest
from frontend.sse import DONE, encode
from frontend.tools import parse_calls
from runtime.rpc import TokenLogprob, Usage

Json = dict[str, Any]


def usage_json(usage: Usage) -> Json:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
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

    def finish(self, reason: str) -> Json:
        raise NotImplementedError

    def end(self, reason: str, usage: Usage) -> list[Json]:
        out = [self.finish(reason)]
        if self.prepared.include_usage:
            out.append(self.usage_chunk(usage))
        return out

    @property
    def wants_logprobs(self) -> bool:
        return self.prepared.top_logprobs is not None


class ChatRenderer(_Renderer):
    id_prefix = "chatcmpl"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, model: str, prepared: PreparedRequest, texts: TokenTexts) -> None:
        super().__init__(model, prepared, texts)
        self._held: list[str] = []  # with tools: the text, parsed at the end

    def _choice(self, delta: Json, logprobs: Json | None, finish: str | None) -> Json:
        return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def start(self) -> list[Json]:
        return [self._chunk([self._choice({"role": "assistant", "content": ""}, None, None)])]

    def delta(self, d: Delta) -> Json | None:
        if self.prepared.tool_mode is not None:
            self._held.append(d.text)
            return None
        logprobs = None
        if self.wants_logprobs and d.logprobs:
            logprobs = {"content": chat_logprobs(self.texts, d.token_ids, d.logprobs)}
        if not d.text and logprobs is None:
            return None
        return self._chunk([self._choice({"content": d.text}, logprobs, None)])

    def finish(self, reason: str) -> Json:
        return self._chunk([self._choice({}, None, reason)])

    def end(self, reason: str, usage: Usage) -> list[Json]:
        mode = self.prepared.tool_mode
        if mode is None:
            return super().end(reason, usage)
        content, calls = parse_calls("".join(self._held), mode)
        out = []
        if content:
            out.append(self._chunk([self._choice({"content": content}, None, None)]))
        if calls:
            deltas = [{"index": i, **call} for i, call in enumerate(calls)]
            out.append(self._chunk([self._choice({"tool_calls": deltas}, None, None)]))
            reason = "tool_calls" if reason == "stop" else reason
        out.append(self.finish(reason))
        if self.prepared.include_usage:
            out.append(self.usage_chunk(usage))
        return out

    def response(
        self,
        text: str,
        token_ids: list[int],
        logprobs: list[TokenLogprob],
        finish_reason: str,
        usage: Usage,
    ) -> Json:
        lp = None
        if self.wants_logprobs:
            lp = {"content": chat_logprobs(self.texts, token_ids, logprobs)}
        message: Json = {"role": "assistant", "content": text}
        if self.prepared.tool_mode is not None:
            content, calls = parse_calls(text, self.prepared.tool_mode)
            message = {"role": "assistant", "content": content, "tool_calls": calls}
            if calls and finish_reason == "stop":
                finish_reason = "tool_calls"
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": lp,
                    "finish_reason": finish_reason,
                }
            ],
            "usage": usage_json(usage),
        }


class CompletionRenderer(_Renderer):
    id_prefix = "cmpl"
    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, model: str, prepared: PreparedRequest, texts: TokenTexts) -> None:
        super().__init__(model, prepared, texts)
        self._offset = len(prepared.echo_text or "")

    def _choice(self, text: str, logprobs: Json | None, finish: str | None) -> Json:
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def _logprobs(self, token_ids: Any, logprobs: Any) -> Json:
        out = completion_logprobs(self.texts, token_ids, logprobs, self._offset)
        self._offset += sum(len(t) for t in out["tokens"])
        return out

    def start(self) -> list[Json]:
        echo = self.prepared.echo_text
        return [self._chunk([self._choice(echo, None, None)])] if echo else []

    def delta(self, d: Delta) -> Json | None:
        logprobs = None
        if self.wants_logprobs and d.logprobs:
            logprobs = self._logprobs(d.token_ids, d.logprobs)
        if not d.text and logprobs is None:
            return None
        return self._chunk([self._choice(d.text, logprobs, None)])

    def finish(self, reason: str) -> Json:
        return self._chunk([self._choice("", None, reason)])

    def response(
        self,
        text: str,
        token_ids: list[int],
        logprobs: list[TokenLogprob],
        finish_reason: str,
        usage: Usage,
    ) -> Json:
        lp = self._logprobs(token_ids, logprobs) if self.wants_logprobs else None
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "text": (self.prepared.echo_text or "") + text,
                    "logprobs": lp,
                    "finish_reason": finish_reason,
                }
            ],
            "usage": usage_json(usage),
        }


Renderer = ChatRenderer | CompletionRenderer
