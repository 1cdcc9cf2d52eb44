"""The tool-call formats models write, parsed as the text grows (``--tool-call-parser``).

* ``hermes``: Hermes, Qwen2.5 and Qwen3 (and the form this frontend teaches a model
  whose template ignores tools): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
* ``llama3_json``: Llama 3.1-3.3: the whole output is ``{"name": ..., "parameters": {...}}``
  (after an optional ``<|python_tag|>``), several calls separated by ``;``;
* ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (tokenizer v3),
  or ``[TOOL_CALLS]name[ARGS]{...}`` per call (v11 and later);
* ``qwen3_coder``: Qwen3-Coder's XML, ``<tool_call><function=name><parameter=key>
  value</parameter>...</function></tool_call>``: the arguments become a JSON object,
  each value typed by the tool's parameter schema (a string unless it says otherwise);
* ``deepseek_v3``: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>name``
  then the arguments in a json code fence, ``<｜tool▁call▁end｜>``; and DeepSeek-V3.1's
  ``<｜tool▁call▁begin｜>name<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``.

A format's ``parse(text, final)`` reads an output so far into items, in order: text
(the message's content) and calls. It only ever *extends* what it returned for a
shorter text: a text item grows, a call gains its name (once the whole name is there)
and then argument text, never retracting any. Text that could still turn into a marker
is held back until it is known, the end of a call's arguments until the arguments are
complete. So :class:`frontend.tools.ToolStream` sends the difference between two parses
as deltas (a call's name first, then argument fragments), and whatever the chunking the
deltas add up to the parse of the whole output. Only the last item of a parse can
still change; ``parse`` returns where it starts so the stream re-reads no more than it.
Arguments are the model's own JSON text where it wrote JSON (not re-serialized).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

Json = dict[str, Any]

_DECODER = json.JSONDecoder()


@dataclass
class Call:
    name: str | None = None  # None until the whole name is there
    arguments: str = ""  # JSON text so far
    raw: str = ""  # the call's source text (content again if its name is not a tool)
    complete: bool = False


@dataclass
class Parse:
    items: list[str | Call] = field(default_factory=list)

    def text(self, s: str) -> None:
        if not s:
            return
        if self.items and isinstance(self.items[-1], str):
            self.items[-1] += s
        else:
            self.items.append(s)

    def call(self, c: Call) -> None:
        self.items.append(c)


def held(text: str, markers: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of a marker."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if m.startswith(text[-k:]):
                best = k
                break
    return best


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


# -- a JSON call object: {"name": "...", "arguments" | "parameters": {...}} ---------------

_HEAD = re.compile(
    r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*(,\s*"(?:arguments|parameters)"\s*:\s*)?'
)


def json_call(text: str, start: int, closed: bool) -> tuple[Call, int | None]:
    """The call object at ``text[start]`` (a ``{``) so far, and the offset after it once
    it is complete. ``closed``: nothing more will come (the format's closing marker or
    the end of the output): an object left open is what it is."""
    raw_end = None
    try:
        obj, raw_end = _DECODER.raw_decode(text, start)
    except ValueError:
        obj = None
    m = _HEAD.match(text, start)
    name = json.loads(f'"{m.group(1)}"') if m else None
    args, args_at = "", m.end() if m and m.group(2) else None
    if obj is not None and isinstance(obj, dict):
        value = obj.get("arguments", obj.get("parameters", {}))
        if args_at is not None:
            args = text[args_at : _DECODER.raw_decode(text, args_at)[1]]
        else:
            args = json.dumps(value, ensure_ascii=False)
        if name is None and isinstance(obj.get("name"), str):
            name = obj["name"]
        return Call(name, args, text[start:raw_end], complete=True), raw_end
    if args_at is not None and args_at < len(text) and text[args_at] in "{[":
        args = text[args_at:]  # an open value: all of the text so far is inside it
    end = len(text) if closed else None
    return Call(name, args, text[start:], complete=closed), end


def _object_list(text: str, i: int, out: Parse, sep: str, close: str, final: bool) -> int:
    """Call objects from ``text[i]`` on, separated by ``sep`` and ended by ``close`` (if
    given); returns where the list ended (``len(text)`` while it may go on)."""
    while True:
        j = _skip_ws(text, i)
        if j >= len(text):
            return len(text)
        if close and text[j] == close:
            return j + 1
        if text[j] != "{":
            return j
        call, end = json_call(text, j, final)
        out.call(call)
        if end is None:
            return len(text)
        k = _skip_ws(text, end)
        if k >= len(text):
            return len(text)
        if text[k] == sep:
            i = k + 1
        elif close and text[k] == close:
            return k + 1
        else:
            return k


# -- the formats ----------------------------------------------------------------------------


def _tagged(text: str, final: bool, start: str, end: str,
            read: Callable[[str, int, bool, str], Call]) -> Parse:  # fmt: skip
    """Calls in start ... end blocks with text between them: `read(the text up to the
    block's end, where its body starts, whether the block is done, its source)` reads
    one block's call."""
    out, i = Parse(), 0
    while i < len(text):
        at = text.find(start, i)
        if at < 0:
            keep = 0 if final else held(text[i:], [start])
            out.text(text[i : len(text) - keep])
            break
        out.text(text[i:at])
        close = text.find(end, at)
        stop = close if close >= 0 else len(text)
        after = close + len(end) if close >= 0 else len(text)
        out.call(read(text[:stop], at + len(start), close >= 0 or final, text[at:after]))
        if close < 0:
            break
        i = after
    return out


class Hermes:
    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> Parse:
        return _tagged(text, final, self.start, self.end, self._call)

    @staticmethod
    def _call(text: str, body: int, done: bool, raw: str) -> Call:
        j = _skip_ws(text, body)
        call = json_call(text, j, done)[0] if j < len(text) and text[j] == "{" else Call()
        call.raw, call.complete = raw, call.complete or done
        return call


class Llama3Json:
    name = "llama3_json"
    tag = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> Parse:
        out = Parse()
        j = _skip_ws(text, 0)
        if j >= len(text):  # nothing but whitespace yet
            if final:
                out.text(text)
            return out
        if text.startswith(self.tag, j):
            j = _skip_ws(text, j + len(self.tag))
        elif text[j] != "{":
            if final or not self.tag.startswith(text[j:]):  # plain text, not a call
                out.text(text)
            return out
        if j < len(text) and text[j] != "{":
            out.text(text[j:])
            return out
        k = _object_list(text, j, out, ";", "", final)
        out.text(text[k:])
        return out


class Mistral:
    name = "mistral"
    tag, args_tag = "[TOOL_CALLS]", "[ARGS]"

    def parse(self, text: str, final: bool) -> Parse:
        out = Parse()
        at = text.find(self.tag)
        if at < 0:
            keep = 0 if final else held(text, [self.tag])
            out.text(text[: len(text) - keep])
            return out
        out.text(text[:at])
        i = at
        while i < len(text) and text.startswith(self.tag, i):
            j = _skip_ws(text, i + len(self.tag))
            if j >= len(text):
                return out
            if text[j] == "[":  # v3: a JSON list of call objects
                i = _object_list(text, j + 1, out, ",", "]", final)
                continue
            named = text.find(self.args_tag, j)
            if named < 0:  # v11: name[ARGS]{...}, the name still coming
                out.call(Call(raw=text[i:], complete=final))
                return out
            a = _skip_ws(text, named + len(self.args_tag))
            call = Call(text[j:named].strip(), raw=text[i:])
            if a < len(text) and text[a] == "{":
                inner, end = json_call(text, a, final)  # the object is the arguments
                call.arguments, call.complete = inner.raw, inner.complete
                if end is not None:
                    call.raw = text[i:end]
                out.call(call)
                if end is None:
                    return out
                i = end
            else:
                call.complete = final
                out.call(call)
                return out
        rest = text[i:]
        out.text(rest[: len(rest) - (0 if final else held(rest, [self.tag]))])
        return out


class DeepSeekV3:
    name = "deepseek_v3"
    begin, end = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    call_begin, sep, call_end = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
    _markers = (call_begin, end)

    def parse(self, text: str, final: bool) -> Parse:
        out = Parse()
        at = text.find(self.begin)
        if at < 0:
            keep = 0 if final else held(text, [self.begin])
            out.text(text[: len(text) - keep])
            return out
        out.text(text[:at])
        i = at + len(self.begin)
        while True:
            j = _skip_ws(text, i)
            if not text.startswith(self.call_begin, j):
                if text.startswith(self.end, j):
                    j += len(self.end)
                rest = text[j:]
                out.text(rest[: len(rest) - (0 if final else held(rest, self._markers))])
                return out
            call, i = self._call(text, j, final)
            out.call(call)
            if not call.complete or i >= len(text):
                return out

    def _call(self, text: str, at: int, final: bool) -> tuple[Call, int]:
        body = at + len(self.call_begin)
        close = text.find(self.call_end, body)
        stop = close if close >= 0 else len(text)
        after = close + len(self.call_end) if close >= 0 else len(text)
        done = close >= 0 or final
        call = Call(raw=text[at:after], complete=done)
        sep = text.find(self.sep, body, stop)
        if sep < 0:
            return call, after
        head, rest = text[body:sep].strip(), sep + len(self.sep)
        if head == "function":  # V3: the name on its own line, then a json fence
            line = text.find("\n", rest, stop)
            if line < 0 and not done:
                return call, after
            call.name = text[rest : stop if line < 0 else line].strip()
            rest = stop if line < 0 else line + 1
        else:  # V3.1: the name before the separator
            call.name = head
        inner = text[:stop]
        brace = inner.find("{", rest)
        if brace < 0:
            call.arguments = "{}" if done else ""
            return call, after
        try:
            call.arguments = inner[brace : _DECODER.raw_decode(inner, brace)[1]]
        except ValueError:  # still open: all of it is inside the value
            call.arguments = inner[brace:]
        return call, after


class Qwen3Coder:
    """Qwen3-Coder's XML calls, their parameters typed by the tools' schemas."""

    name = "qwen3_coder"
    start, end = "<tool_call>", "</tool_call>"
    _FUNC = re.compile(r"\s*<function=([^>\n]*)>")
    _PARAM = re.compile(r"\s*<parameter=([^>\n]*)>")

    def __init__(self, tools: Sequence[Json] = ()) -> None:
        self._types: dict[str, dict[str, Any]] = {}
        for t in tools:
            fn = t.get("function", t)
            props = (fn.get("parameters") or {}).get("properties") or {}
            self._types[fn.get("name", "")] = {k: (v or {}).get("type") for k, v in props.items()}

    def parse(self, text: str, final: bool) -> Parse:
        return _tagged(text, final, self.start, self.end, self._call)

    def _call(self, text: str, i: int, done: bool, raw: str) -> Call:
        call = Call(raw=raw, complete=done)
        m = self._FUNC.match(text, i)
        if m is None:
            return call
        call.name, i = m.group(1).strip(), m.end()
        types = self._types.get(call.name, {})
        parts: list[str] = []
        while True:
            p = self._PARAM.match(text, i)
            if p is None:
                break
            key, body = p.group(1).strip(), p.end()
            if body < len(text) and text[body] == "\n":
                body += 1
            close = text.find("</parameter>", body)
            head = ("{" if not parts else ", ") + json.dumps(key, ensure_ascii=False) + ": "
            kind = types.get(key) or "string"
            if close < 0:  # the value is still coming: a string streams
                value = text[body:]
                if not done:
                    value = value[: len(value) - held(value, ["\n</parameter>", "</parameter>"])]
                if kind == "string" and (value or not done):
                    parts.append(head + '"' + json.dumps(value, ensure_ascii=False)[1:-1])
                    if done:
                        parts.append('"')
                elif done:
                    parts.append(head + _typed(value, kind))
                break
            value = text[body:close].removesuffix("\n")
            parts.append(head + _typed(value, kind))
            i = close + len("</parameter>")
        if done or text.startswith("</function>", _skip_ws(text, i)):
            parts.append("}" if parts else "{}")
        call.arguments = "".join(parts)
        return call


_KINDS: dict[str, tuple[type, ...]] = {
    "integer": (int,), "number": (int, float), "boolean": (bool,), "object": (dict,),
    "array": (list,), "null": (type(None),),
}  # fmt: skip


def _typed(value: str, kind: str) -> str:
    """A parameter's JSON: a string as is; a value of another type (the schema's, or
    any JSON where the schema names none it knows) parsed, or kept a string if it is not
    one."""
    if kind != "string":
        try:
            parsed = json.loads(value.strip())
        except ValueError:
            return json.dumps(value, ensure_ascii=False)
        kinds = _KINDS.get(kind)
        is_bool = isinstance(parsed, bool)
        if kinds is None or (isinstance(parsed, kinds) and (is_bool == (kind == "boolean"))):
            return json.dumps(parsed, ensure_ascii=False)
    return json.dumps(value, ensure_ascii=False)


ToolFormat = Hermes | Llama3Json | Mistral | DeepSeekV3 | Qwen3Coder

FORMATS: dict[str, Callable[[Sequence[Json]], ToolFormat]] = {
    "hermes": lambda tools: Hermes(),
    "llama3_json": lambda tools: Llama3Json(),
    "mistral": lambda tools: Mistral(),
    "qwen3_coder": Qwen3Coder,
    "deepseek_v3": lambda tools: DeepSeekV3(),
}


def default_format(template: str | None) -> str:
    """The format a chat template's own tool-call markup names (``hermes``, the form
    this frontend teaches, when it names none)."""
    t = template or ""
    if "<function=" in t and "<parameter=" in t:
        return "qwen3_coder"
    if "<tool_call>" in t:
        return "hermes"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "tool▁calls▁begin" in t:
        return "deepseek_v3"
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama3_json"
    return "hermes"


def markers(name: str) -> tuple[str, ...]:
    """The format's marker strings (tokens a detokenizer must keep even if special)."""
    fmt = {"hermes": Hermes, "llama3_json": Llama3Json, "mistral": Mistral,
           "qwen3_coder": Qwen3Coder, "deepseek_v3": DeepSeekV3}[name]  # fmt: skip
    found = [v for k, v in vars(fmt).items() if isinstance(v, str) and k != "name"]
    return tuple(found)
