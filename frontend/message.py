"""One chat choice's output text as the message the API returns: a reasoning model's
thinking (``reasoning_content``, frontend/reasoning.py), then its answer, where tool
calls are parsed (``tool_calls``, frontend/tools.py) and the rest is ``content``.

:class:`MessageStream` does it delta by delta for a streamed choice, :func:`message`
for a whole output; both give the same message for the same text.
"""

from __future__ import annotations

from typing import Any

from frontend.protocol import PreparedRequest
from frontend.reasoning import Parts, ReasoningStream, split
from frontend.tools import ToolStream, parse_calls

Json = dict[str, Any]


class MessageStream:
    def __init__(self, prepared: PreparedRequest) -> None:
        fmt = prepared.thinking
        opened = prepared.sampling.reasoning_open
        self._thinking = ReasoningStream(fmt, opened) if fmt is not None else None
        mode = prepared.tool_mode
        self._tools = ToolStream(mode) if mode is not None else None

    def push(self, text: str) -> Json | None:
        """The delta's fields for new output text (None: nothing to send yet)."""
        if not text:
            return None
        parts = self._thinking.push(text) if self._thinking is not None else Parts(content=text)
        return self._fields(parts)

    def _fields(self, parts: Parts) -> Json | None:
        out: Json = {}
        if parts.reasoning:
            out["reasoning_content"] = parts.reasoning
        if parts.content:
            if self._tools is not None:
                out |= self._tools.push(parts.content) or {}
            else:
                out["content"] = parts.content
        return out or None

    def finish(self) -> tuple[list[Json], bool]:
        """The deltas left at the end, and whether the choice called a tool."""
        out = []
        if self._thinking is not None:
            last = self._fields(self._thinking.finish())
            if last:
                out.append(last)
        if self._tools is None:
            return out, False
        deltas, called = self._tools.finish()
        return out + deltas, called


def message(text: str, prepared: PreparedRequest) -> tuple[Json, bool]:
    """A whole output's message, and whether it called a tool."""
    fmt = prepared.thinking
    parts = split(text, fmt, prepared.sampling.reasoning_open) if fmt else Parts(content=text)
    out: Json = {"role": "assistant", "content": parts.content}
    if fmt is not None:
        out["reasoning_content"] = parts.reasoning or None
        if not parts.content and parts.reasoning:
            out["content"] = None  # it only thought (cut short)
    if prepared.tool_mode is None:
        return out, False
    content, calls = parse_calls(parts.content, prepared.tool_mode)
    out["content"], out["tool_calls"] = content, calls
    return out, bool(calls)
