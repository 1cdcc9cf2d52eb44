"""Tool calling: ``tools`` and ``tool_choice`` in, ``tool_calls`` out.

The tools reach the model through its chat template when the template renders them
(it mentions ``tools``); a template that does not (SmolLM2's, among others) gets them
in a system message in the common Hermes form, and earlier calls and results in the
conversation are written back in that form. The model calls a tool in its own format
(frontend/tool_formats.py: Hermes, Llama 3 JSON, Mistral, Qwen3-Coder XML,
DeepSeek-V3; ``--tool-call-parser``, by default the one its chat template writes), e.g.

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``tool_choice``:

* ``"none"``: the tools are not shown; plain text comes back;
* ``"auto"`` (the default with tools): the output is parsed for such calls; text
  outside them is the message's content, and so is a call naming no given tool;
* ``"required"``: the output is constrained (structured output) to a JSON list of one
  or more calls, each naming a given tool with arguments that match its schema;
* ``{"type": "function", "function": {"name": ...}}``: constrained to that tool's
  arguments, so they always validate.

``parallel_tool_calls: false`` keeps the first call only.

Streamed (:class:`ToolStream`): with ``auto`` text streams as content (a partial marker
at the end of a chunk is held back), and each call as OpenAI streams one: a delta with
its index, id and whole name once the name is complete, then fragments of its
arguments as the model writes them; the deltas of any chunking add up to the parse of
the whole output. A named tool streams its arguments as they are generated, as OpenAI
does; ``required`` sends its calls whole at the end. The OpenAI client assembles the
``tool_calls`` deltas as it does OpenAI's.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from frontend.errors import BadRequest
from frontend.structured import Constraint
from frontend.tool_formats import FORMATS, Parse, ToolFormat

Json = dict[str, Any]


@dataclass(frozen=True)
class ToolMode:
    choice: str  # auto, required, named
    names: tuple[str, ...]
    named: str | None = None
    parser: str = "hermes"  # the output's call format (frontend/tool_formats.py)
    parallel: bool = True  # False: the first call only
    tools: tuple[Json, ...] = field(default=(), compare=False)  # their schemas

    def format(self) -> ToolFormat:
        return FORMATS[self.parser](self.tools)


def check_tools(
    tools: list[Json] | None,
    tool_choice: str | Json | None,
    parser: str = "hermes",
    parallel: bool | None = None,
) -> ToolMode | None:
    """The request's tool mode (None: no tool calls possible); a 400 for bad shapes.
    ``parser``: the format the model writes calls in; ``parallel``: the request's
    ``parallel_tool_calls`` (None: true)."""
    if tool_choice == "none" or not tools:
        if isinstance(tool_choice, dict) or tool_choice == "required":
            raise BadRequest("tool_choice needs tools, none were given", param="tool_choice")
        return None
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if tool.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRequest(
                "each tool must be {'type': 'function', 'function': {'name': ...}}",
                param=f"tools[{i}]",
            )
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise BadRequest(
                "function parameters must be a JSON schema object", param=f"tools[{i}]"
            )
        names.append(fn["name"])
    extra: Json = {"parser": parser, "parallel": parallel is not False, "tools": tuple(tools)}
    if tool_choice in (None, "auto"):
        return ToolMode("auto", tuple(names), **extra)
    if tool_choice == "required":
        return ToolMode("required", tuple(names), **extra)
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type") != "function" or name not in names:
            raise BadRequest(
                f"tool_choice must name one of the tools ({', '.join(names)})",
                param="tool_choice",
            )
        return ToolMode("named", tuple(names), name, **extra)
    raise BadRequest(
        "tool_choice must be 'none', 'auto', 'required' or a named function",
        param="tool_choice",
    )


def constraint(mode: ToolMode | None, tools: list[Json]) -> Constraint | None:
    """The output constraint that enforces ``required`` and named choices."""
    if mode is None or mode.choice == "auto":
        return None
    schemas = {t["function"]["name"]: _parameters(t) for t in tools}
    if mode.choice == "named":
        assert mode.named is not None
        return Constraint("json_schema", schemas[mode.named], "tool_choice")
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": schema},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, schema in schemas.items()
    ]
    array = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    return Constraint("json_schema", array, "tool_choice")


def _parameters(tool: Json) -> Json:
    params: Json = tool["function"].get("parameters") or {"type": "object"}
    return params


def template_renders_tools(template: str | None) -> bool:
    return bool(template) and "tools" in (template or "")


def with_tools_in_prompt(messages: list[Json], tools: list[Json]) -> list[Json]:
    """Messages for a template that ignores ``tools``: the tools in the system message,
    earlier calls and results as text the model can read."""
    specs = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    preface = (
        "You may call one or more functions to assist with the user query. The available "
        f"functions, as JSON signatures:\n<tools>\n{specs}\n</tools>\n"
        "To call a function, reply with a JSON object naming it and its arguments, in "
        "<tool_call></tool_call> tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <arguments-object>}\n</tool_call>'
    )
    out: list[Json] = []
    for m in messages:
        m = dict(m)
        if m.get("role") == "assistant" and m.get("tool_calls"):
            text = m.get("content") or ""
            for call in m.pop("tool_calls"):
                fn = call.get("function", {})
                args = fn.get("arguments", "{}")
                with contextlib.suppress(ValueError):
                    args = json.loads(args) if isinstance(args, str) else args
                payload = json.dumps({"name": fn.get("name"), "arguments": args})
                text += f"<tool_call>\n{payload}\n</tool_call>"
            m["content"] = text
        elif m.get("role") == "tool":
            m = {
                "role": "tool",
                "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>",
            }
        out.append(m)
    if out and out[0].get("role") == "system":
        out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{preface}"}
    else:
        out.insert(0, {"role": "system", "content": preface})
    return out


def parse_calls(text: str, mode: ToolMode) -> tuple[str | None, list[Json]]:
    """(content, tool_calls) of a finished output."""
    if mode.choice == "named":
        return None, [_call(mode.named or "", text)]
    if mode.choice == "required":
        try:
            items = json.loads(text)
        except ValueError:
            return text, []  # cut short by max_tokens: the text as it is
        calls = [_call(i["name"], json.dumps(i["arguments"])) for i in items]
        return None, calls[:1] if not mode.parallel else calls
    content, found = _assemble(mode.format().parse(text, True), mode)
    if not found:
        return text, []
    return (content if content.strip() else None), [_call(n, a) for n, a in found]


def _assemble(parse: Parse, mode: ToolMode) -> tuple[str, list[tuple[str, str]]]:
    """A parse's content and its calls of given tools, as (name, arguments so far). A
    call whose name is known to be no tool's is content once it is complete."""
    content: list[str] = []
    calls: list[tuple[str, str]] = []
    for item in parse.items:
        if isinstance(item, str):
            content.append(item)
        elif item.name is None or item.name not in mode.names:
            if item.complete:
                content.append(item.raw)
        elif mode.parallel or not calls:
            calls.append((item.name, item.arguments))
    return "".join(content), calls


def _call(name: str, arguments: str, call_id: str | None = None) -> Json:
    return {
        "id": call_id or _call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolStream:
    """One streamed choice's output with tools in play: what may be sent now, and what
    at the end. Deltas are the ``delta`` objects of chat chunks."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self._format = mode.format()
        self._text = ""  # auto and required: the output so far
        self._content = 0  # auto: characters of content sent
        self._sent: list[tuple[str, int]] = []  # auto: each call's id and argument chars sent
        self._call: Json | None = None  # named: the call being streamed

    def push(self, text: str) -> Json | None:
        if not text:
            return None
        if self.mode.choice == "named":
            if self._call is None:
                self._call = _call(self.mode.named or "", "")
                first = {**self._call, "function": {"name": self.mode.named, "arguments": text}}
                return {"tool_calls": [{"index": 0, **first}]}
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
        self._text += text
        if self.mode.choice == "required":
            return None
        return self._delta(final=False)

    def _delta(self, final: bool) -> Json | None:
        content, calls = _assemble(self._format.parse(self._text, final), self.mode)
        out: Json = {}
        if len(content) > self._content:
            out["content"] = content[self._content :]
            self._content = len(content)
        deltas = []
        for i, (name, args) in enumerate(calls):
            if i == len(self._sent):
                call = _call(name, args)
                self._sent.append((call["id"], len(args)))
                deltas.append({"index": i, **call})
            elif len(args) > self._sent[i][1]:
                deltas.append({"index": i, "function": {"arguments": args[self._sent[i][1] :]}})
                self._sent[i] = (self._sent[i][0], len(args))
        if deltas:
            out["tool_calls"] = deltas
        return out or None

    def finish(self) -> tuple[list[Json], bool]:
        """The deltas left to send, and whether the choice called a tool."""
        if self.mode.choice == "named":
            if self._call is None:  # no text at all: an empty call, as generated
                call = _call(self.mode.named or "", "")
                return [{"tool_calls": [{"index": 0, **call}]}], True
            return [], True
        if self.mode.choice == "required":
            content, calls = parse_calls(self._text, self.mode)
            out: list[Json] = [{"content": content}] if content else []
            if calls:
                out.append({"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]})
            return out, bool(calls)
        last = self._delta(final=True)
        out = []
        if last and "content" in last:
            out.append({"content": last["content"]})
        if last and "tool_calls" in last:
            out.append({"tool_calls": last["tool_calls"]})
        return out, bool(self._sent)
