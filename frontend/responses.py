"""Response bodies and stream chunks in the exact shapes of the OpenAI API.

One renderer per endpoint, with the same methods, so that serving code is shared:
``start()`` (chunks sent before any token), ``delta(d, index)`` (one chunk of a
choice's new output), ``close(reason, index)`` (the chunks ending a choice: the one
carrying its ``finish_reason``, and with tools its content or ``tool_calls``), ``end()``
(after every choice closed: the extra chunk of ``stream_options.include_usage``),
``response()`` (the whole non-streamed body), and how a chunk is framed (``encode``,
``done``). With ``n`` > 1 every chunk names its choice by ``index``. The Responses
API's renderer (frontend/responses_api.py) has the same methods.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from frontend.generation import ChoiceResult, Delta
from frontend.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from frontend.preprocess import PreparedRequest
from frontend.sse import DONE, encode
from frontend.tools import ToolStream, parse_calls
from runtime.rpc import Usage

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
        mode = prepared.tool_mode  # with tools: what each choice may send, and when
        self._tools = [ToolStream(mode) for _ in range(prepared.n)] if mode else []

    def _choice(self, delta: Json, logprobs: Json | None, finish: str | None, i: int) -> Json:
        return {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def start(self) -> list[Json]:
        role = {"role": "assistant", "content": ""}
        return [self._chunk([self._choice(role, None, None, i)]) for i in range(self.prepared.n)]

    def delta(self, d: Delta, index: int = 0) -> Json | None:
        if self._tools:
            piece = self._tools[index].push(d.text)
            return None if piece is None else self._chunk([self._choice(piece, None, None, index)])
        logprobs = None
        if self.wants_logprobs and d.logprobs:
            logprobs = {"content": chat_logprobs(self.texts, d.token_ids, d.logprobs)}
        if not d.text and logprobs is None:
            return None
        return self._chunk([self._choice({"content": d.text}, logprobs, None, index)])

    def finish(self, reason: str, index: int = 0) -> Json:
        return self._chunk([self._choice({}, None, reason, index)])

    def close(self, reason: str, index: int = 0) -> list[Json]:
        if not self._tools:
            return [self.finish(reason, index)]
        deltas, called = self._tools[index].finish()
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
            message: Json = {"role": "assistant", "content": r.text}
            reason = r.finish_reason
            if self.prepared.tool_mode is not None:
                content, calls = parse_calls(r.text, self.prepared.tool_mode)
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                if calls and reason == "stop":
                    reason = "tool_calls"
            choices.append(
                {"index": i, "message": message, "logprobs": lp, "finish_reason": reason}
            )
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

    def delta(self, d: Delta, index: int = 0) -> Json | None:
        logprobs = None
        if self.wants_logprobs and d.logprobs:
            logprobs = self._logprobs(d.token_ids, d.logprobs, index)
        if not d.text and logprobs is None:
            return None
        return self._chunk([self._choice(d.text, logprobs, None, index)])

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
