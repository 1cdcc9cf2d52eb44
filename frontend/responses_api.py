"""OpenAI's Responses API (``POST /v1/responses``), stateless, on the chat path.

A request becomes a chat request: ``instructions`` the system message, ``input`` (a
string, or a list of message items and function-call items) the conversation,
``max_output_tokens`` the budget, ``text.format`` the structured-output constraint.
Nothing is stored: ``previous_response_id`` and ``background`` are refused with a
400 (send the whole conversation as ``input`` instead), ``store`` is accepted and ignored.
Function ``tools`` work as in chat (frontend/tools.py): calls come back as
``function_call`` output items, and ``function_call`` / ``function_call_output`` input
items carry them and their results back in. A reasoning model's thinking
(frontend/reasoning.py) is a ``reasoning`` output item before the message (its text in
``content`` as ``reasoning_text``, streamed as ``response.reasoning_text.delta``; no
summary is made), ``reasoning.effort`` its budget, and ``output_tokens_details.
reasoning_tokens`` its count; ``reasoning`` input items are dropped, as the chat
templates of reasoning models drop earlier turns' thinking.

Streamed, the response is the API's event sequence (``response.created``,
``response.in_progress``, ``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``, then
``response.completed``, or ``response.incomplete`` when ``max_output_tokens`` ran out),
each framed with its ``event:`` name and numbered by ``sequence_number``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import Field

from frontend.errors import BadRequest
from frontend.generation import ChoiceResult, Delta
from frontend.logprobs import TokenTexts
from frontend.message import message
from frontend.protocol import ChatCompletionRequest, PreparedRequest, _Strict
from frontend.reasoning import Parts, ReasoningStream
from protocol.sampling import MAX_INT32
from runtime.rpc import Usage

Json = dict[str, Any]


class ResponsesRequest(_Strict):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stream: bool = False
    store: bool | None = None
    background: bool | None = None
    previous_response_id: str | None = None
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    priority: int = Field(0, ge=-(2**31), le=MAX_INT32)
    reasoning: dict[str, Any] | None = None  # {"effort": ...}; a summary is not made
    max_reasoning_tokens: int | None = Field(None, ge=0, le=MAX_INT32)


def to_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request a Responses request stands for; a 400 for what cannot be served."""
    if body.previous_response_id is not None:
        raise BadRequest(
            "previous_response_id is not supported: responses are not stored; send the whole "
            "conversation as input",
            param="previous_response_id",
        )
    if body.background:
        raise BadRequest("background responses are not supported", param="background")
    messages: list[Json] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
    else:
        for i, item in enumerate(body.input):
            message = _message(item, f"input[{i}]")
            if message is not None:
                messages.append(message)
    if not messages:
        raise BadRequest("input must not be empty", param="input")
    chat: Json = {
        "model": body.model,
        "messages": messages,
        "stream": body.stream,
        "priority": body.priority,
    }
    effort = (body.reasoning or {}).get("effort")
    if effort is not None:
        chat["reasoning_effort"] = effort
    passed = ("temperature", "top_p", "seed", "user", "max_reasoning_tokens", "parallel_tool_calls")
    for name in passed:
        value = getattr(body, name)
        if value is not None:
            chat[name] = value
    choice = body.tool_choice
    if isinstance(choice, dict) and "function" not in choice and "name" in choice:
        choice = {"type": "function", "function": {"name": choice["name"]}}  # Responses' shape
    if choice is not None:
        chat["tool_choice"] = choice
    if body.max_output_tokens is not None:
        chat["max_tokens"] = body.max_output_tokens
    if body.tools:
        chat["tools"] = [_chat_tool(t, i) for i, t in enumerate(body.tools)]
    fmt = (body.text or {}).get("format")
    if fmt is not None:
        chat["response_format"] = _response_format(fmt)
    return ChatCompletionRequest.model_validate(chat, strict=False)


def _message(item: Json, param: str) -> Json | None:
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise BadRequest(
                f"{param}.role must be system, developer, user or assistant", param=f"{param}.role"
            )
        return {"role": role, "content": _text(item.get("content"), f"{param}.content")}
    if kind == "function_call":
        call = {
            "id": _str(item, "call_id", param),
            "type": "function",
            "function": {
                "name": _str(item, "name", param),
                "arguments": _str(item, "arguments", param),
            },
        }
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == "function_call_output":
        return {
            "role": "tool",
            "tool_call_id": _str(item, "call_id", param),
            "content": _str(item, "output", param),
        }
    if kind == "reasoning":
        return None
    raise BadRequest(f"{param}.type {kind!r} is not supported", param=f"{param}.type")


def _text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{param} must be a string or a list of text parts", param=param)
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text"):
            raise BadRequest(
                f"{param}[{j}]: only input_text and output_text parts are supported (text only)",
                param=f"{param}[{j}]",
            )
        parts.append(_str(part, "text", f"{param}[{j}]"))
    return "".join(parts)


def _str(item: Json, key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise BadRequest(f"{param}.{key} must be a string", param=f"{param}.{key}")
    return value


def _chat_tool(tool: Json, i: int) -> Json:
    if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise BadRequest("only function tools with a name are supported", param=f"tools[{i}]")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": fn}


def _response_format(fmt: Json) -> Json:
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    return dict(fmt)


def usage_json(usage: Usage) -> Json:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


class ResponsesRenderer:
    """The Responses API's shapes, with the methods of frontend/responses.py's renderers."""

    done = b""  # the stream simply ends after response.completed

    def __init__(
        self, model: str, prepared: PreparedRequest, texts: TokenTexts, body: ResponsesRequest
    ) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.prepared = prepared
        self.texts = texts
        self.body = body
        self.reasoning_id = f"rs_{uuid.uuid4().hex}"
        self._seq = 0
        self._parts: list[str] = []  # all output text
        self._status = "completed"
        self._final_items: list[Json] = []
        fmt = prepared.thinking  # a reasoning model: thinking split off as it streams
        opened = prepared.sampling.reasoning_open
        self._thinking = ReasoningStream(fmt, opened) if fmt is not None else None
        self._reasoning: list[str] = []  # streamed thinking
        self._reasoning_done = False
        self._content: list[str] = []  # streamed message text
        self._message_at: int | None = None  # the message item's output index, once open

    @staticmethod
    def encode(event: Json) -> bytes:
        import orjson

        kind: str = event["type"]
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"

    def _event(self, kind: str, **fields: Any) -> Json:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _response(self, status: str, output: list[Json], usage: Usage | None) -> Json:
        body = self.body
        fmt = (body.text or {}).get("format") or {"type": "text"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "model": self.model,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": None,
            "store": False,
            "temperature": body.temperature if body.temperature is not None else 1.0,
            "text": {"format": fmt},
            "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [],
            "top_p": body.top_p if body.top_p is not None else 1.0,
            "truncation": "disabled",
            "usage": usage_json(usage) if usage is not None else None,
            "user": body.user,
        }

    def _item(self, text: str | None, status: str) -> Json:
        content = [] if text is None else [self._part(text)]
        return {
            "type": "message",
            "id": self.item_id,
            "status": status,
            "role": "assistant",
            "content": content,
        }

    @staticmethod
    def _part(text: str) -> Json:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _reasoning_item(self, text: str | None, status: str) -> Json:
        content = [] if text is None else [{"type": "reasoning_text", "text": text}]
        return {
            "type": "reasoning",
            "id": self.reasoning_id,
            "summary": [],
            "content": content,
            "status": status,
        }

    def _items(self, text: str, status: str) -> list[Json]:
        """The output items: the thinking of a reasoning model, then the message, or with
        tools its text and function calls."""
        msg, _ = message(text, self.prepared)
        items = []
        if msg.get("reasoning_content"):
            items.append(self._reasoning_item(msg["reasoning_content"], "completed"))
        if self.prepared.tool_mode is None:
            return [*items, self._item(msg["content"] or "", status)]
        if msg["content"]:
            items.append(self._item(msg["content"], status))
        for call in msg["tool_calls"]:
            items.append(
                {
                    "type": "function_call",
                    "id": f"fc_{uuid.uuid4().hex}",
                    "call_id": call["id"],
                    "name": call["function"]["name"],
                    "arguments": call["function"]["arguments"],
                    "status": "completed",
                }
            )
        return items if any(i["type"] != "reasoning" for i in items) else [
            *items, self._item("", status)
        ]  # fmt: skip

    @property
    def _streams_text(self) -> bool:
        """Output streams as it comes (no tools: those are parsed when it ends)."""
        return self.prepared.tool_mode is None

    def start(self) -> list[Json]:
        events = [
            self._event("response.created", response=self._response("in_progress", [], None)),
            self._event("response.in_progress", response=self._response("in_progress", [], None)),
        ]
        if self._streams_text and self._thinking is None:  # a message from the start
            events += self._message_opened(0)
            self._message_at = 0
        return events

    def _message_opened(self, index: int) -> list[Json]:
        where = {"item_id": self.item_id, "output_index": index, "content_index": 0}
        return [
            self._event(
                "response.output_item.added",
                output_index=index,
                item=self._item(None, "in_progress"),
            ),
            self._event("response.content_part.added", part=self._part(""), **where),
        ]

    def _message_closed(self, item: Json, index: int) -> list[Json]:
        text = item["content"][0]["text"]
        where = {"item_id": self.item_id, "output_index": index, "content_index": 0}
        return [
            self._event("response.output_text.done", text=text, logprobs=[], **where),
            self._event("response.content_part.done", part=self._part(text), **where),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def _reasoning_events(self, parts: Parts) -> list[Json]:
        """A streamed reasoning model's new thinking and answer as events: the reasoning
        item opens with the first thinking, and closes when the answer begins."""
        events: list[Json] = []
        if parts.reasoning:
            if not self._reasoning:
                events.append(self._event(
                    "response.output_item.added", output_index=0,
                    item=self._reasoning_item(None, "in_progress"),
                ))  # fmt: skip
            self._reasoning.append(parts.reasoning)
            events.append(self._event(
                "response.reasoning_text.delta", item_id=self.reasoning_id, output_index=0,
                content_index=0, delta=parts.reasoning,
            ))  # fmt: skip
        if parts.content:
            events += self._open_message()
            self._content.append(parts.content)
            events.append(self._event(
                "response.output_text.delta", item_id=self.item_id,
                output_index=self._message_at, content_index=0, delta=parts.content, logprobs=[],
            ))  # fmt: skip
        return events

    def _open_message(self) -> list[Json]:
        if self._message_at is not None:
            return []
        events = self._reasoning_closed()
        self._message_at = 1 if self._reasoning else 0
        return events + self._message_opened(self._message_at)

    def _reasoning_closed(self) -> list[Json]:
        if not self._reasoning or self._reasoning_done:
            return []
        self._reasoning_done = True
        text = "".join(self._reasoning)
        return [
            self._event(
                "response.reasoning_text.done", item_id=self.reasoning_id, output_index=0,
                content_index=0, text=text,
            ),
            self._event(
                "response.output_item.done", output_index=0,
                item=self._reasoning_item(text, "completed"),
            ),
        ]  # fmt: skip

    def delta(self, d: Delta, index: int = 0) -> list[Json]:
        if not d.text:
            return []
        self._parts.append(d.text)
        if not self._streams_text:
            return []  # parsed when the output ends
        if self._thinking is not None:
            return self._reasoning_events(self._thinking.push(d.text))
        self._content.append(d.text)
        return [self._event(
            "response.output_text.delta", item_id=self.item_id, output_index=0,
            content_index=0, delta=d.text, logprobs=[],
        )]  # fmt: skip

    def close(self, reason: str, index: int = 0) -> list[Json]:
        self._status = "incomplete" if reason == "length" else "completed"
        if self._streams_text:
            events = []
            if self._thinking is not None:
                events = self._reasoning_events(self._thinking.finish())
                events += self._reasoning_closed() + self._open_message()
            item = self._item("".join(self._content), self._status)
            items = [self._reasoning_item("".join(self._reasoning), "completed")]
            self._final_items = [*items, item] if self._reasoning else [item]
            assert self._message_at is not None
            return events + self._message_closed(item, self._message_at)
        self._final_items = items = self._items("".join(self._parts), self._status)
        events = []
        for i, item in enumerate(items):
            if item["type"] == "reasoning":
                text = item["content"][0]["text"]
                events += [
                    self._event("response.output_item.added", output_index=i,
                                item=self._reasoning_item(None, "in_progress")),
                    self._event("response.reasoning_text.delta", item_id=self.reasoning_id,
                                output_index=i, content_index=0, delta=text),
                    self._event("response.reasoning_text.done", item_id=self.reasoning_id,
                                output_index=i, content_index=0, text=text),
                    self._event("response.output_item.done", output_index=i, item=item),
                ]  # fmt: skip
                continue
            if item["type"] == "message":
                events += self._message_opened(i)
                where = {"item_id": self.item_id, "output_index": i, "content_index": 0}
                delta = item["content"][0]["text"]
                events.append(
                    self._event("response.output_text.delta", delta=delta, logprobs=[], **where)
                )
                events += self._message_closed(item, i)
                continue
            opened = {**item, "arguments": "", "status": "in_progress"}
            where = {"item_id": item["id"], "output_index": i}
            events += [
                self._event("response.output_item.added", output_index=i, item=opened),
                self._event(
                    "response.function_call_arguments.delta", delta=item["arguments"], **where
                ),
                self._event(
                    "response.function_call_arguments.done",
                    arguments=item["arguments"],
                    name=item["name"],
                    **where,
                ),
                self._event("response.output_item.done", output_index=i, item=item),
            ]
        return events

    def end(self, usage: Usage) -> list[Json]:
        final = "response.incomplete" if self._status == "incomplete" else "response.completed"
        response = self._response(self._status, self._final_items, usage)
        return [self._event(final, response=response)]

    def response(self, results: list[ChoiceResult], usage: Usage) -> Json:
        (r,) = results
        status = "incomplete" if r.finish_reason == "length" else "completed"
        return self._response(status, self._items(r.text, status), usage)
