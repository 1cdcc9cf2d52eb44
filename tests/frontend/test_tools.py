"""Tool-call parsing and prompting (pure)."""

from __future__ import annotations

import json

import pytest

from frontend.errors import BadRequest
from frontend.tools import ToolMode, ToolStream, check_tools, parse_calls, with_tools_in_prompt

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def test_auto_parses_hermes_calls_and_keeps_the_rest_as_content() -> None:
    mode = ToolMode("auto", ("f", "g"))
    text = 'Sure.<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    text += '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    content, calls = parse_calls(text, mode)
    assert [c["function"]["name"] for c in calls] == ["f"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": 1}
    # a call of no given tool is text the model wrote
    assert content == 'Sure.<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    assert parse_calls("just text", mode) == ("just text", [])


def test_required_and_named_outputs() -> None:
    text = '[{"name": "f", "arguments": {"a": 2}}]'
    content, calls = parse_calls(text, ToolMode("required", ("f",)))
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"a": 2}
    _, calls = parse_calls('{"a": 3}', ToolMode("named", ("f",), "f"))
    assert calls[0]["function"] == {"name": "f", "arguments": '{"a": 3}'}


def test_modes_and_errors() -> None:
    assert check_tools(None, None) is None and check_tools([TOOL], "none") is None
    assert check_tools([TOOL], None) == ToolMode("auto", ("f",))
    with pytest.raises(BadRequest):
        check_tools(None, "required")
    with pytest.raises(BadRequest):
        check_tools([TOOL], {"type": "function", "function": {"name": "g"}})
    with pytest.raises(BadRequest):
        check_tools([{"type": "function", "function": {}}], "auto")


def test_tools_in_prompt_for_templates_without_tools() -> None:
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
        ]},
        {"role": "tool", "tool_call_id": "1", "content": "42"},
    ]  # fmt: skip
    out = with_tools_in_prompt(messages, [TOOL])
    assert out[0]["role"] == "system" and '"name": "f"' in out[0]["content"]
    assert out[2]["content"] == '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    assert out[3]["content"] == "<tool_response>\n42\n</tool_response>"


def test_streaming_auto_sends_text_until_a_call_begins() -> None:
    s = ToolStream(ToolMode("auto", ("f",)))
    assert s.push("Let me check <to") == {"content": "Let me check "}  # a tag may begin
    assert s.push('ol_call>{"name": "f", "argu') is not None  # the name, at once
    assert s.push('ments": {"x": 2}}</tool_call>') == {
        "tool_calls": [{"index": 0, "function": {"arguments": '{"x": 2}'}}]
    }
    assert s.finish() == ([], True)
    plain = ToolStream(ToolMode("auto", ("f",)))
    assert plain.push("a <") == {"content": "a "}
    assert plain.push(" b") == {"content": "< b"}  # not a tag after all
    assert plain.finish() == ([], False)


def test_streaming_a_named_tool_streams_its_arguments() -> None:
    s = ToolStream(ToolMode("named", ("f",), "f"))
    first = s.push('{"x"')
    assert first is not None
    (call,) = first["tool_calls"]
    assert call["index"] == 0 and call["id"].startswith("call_")
    assert call["function"] == {"name": "f", "arguments": '{"x"'}
    assert s.push(": 1}") == {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}
    assert s.finish() == ([], True)
