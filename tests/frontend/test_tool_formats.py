"""Every tool-call format and reasoning parser, streamed in any chunking (pure).

Each sample output is fed to a stream one character at a time, at every single split,
and at random chunk boundaries; the deltas, reassembled as the OpenAI client does
(content concatenated, each call's name from its first delta and its arguments
concatenated), must equal the parse of the whole text, which is checked against the
calls the sample means.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from frontend import reasoning
from frontend.tool_formats import FORMATS, default_format, markers
from frontend.tools import ToolMode, ToolStream, parse_calls

Json = dict[str, Any]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                           "metric": {"type": "boolean"}, "tags": {"type": "array"}},
        },
    },
}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
TOOLS = (WEATHER, TIME)
NAMES = ("get_weather", "get_time")

PARIS = {"city": "Paris", "days": 3}
QUOTED = {"city": 'Sa"o\\ Paulo\n', "metric": True, "tags": ["a", "}"]}

# (format, output text, content, calls as (name, arguments object))
SAMPLES: list[tuple[str, str, str | None, list[tuple[str, Json]]]] = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "Paris", "days": 3}}\n</tool_call>', "Let me check.\n", [("get_weather", PARIS)]),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": ' + json.dumps(QUOTED) +
     '}</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', None,
     [("get_weather", QUOTED), ("get_time", {})]),
    ("hermes", "no call <tool here", "no call <tool here", []),
    ("hermes", '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "nope", "arguments": {}}</tool_call>', []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', None,
     [("get_weather", PARIS)]),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {}}; '
     '{"name": "get_weather", "parameters": ' + json.dumps(QUOTED) + "}", None,
     [("get_time", {}), ("get_weather", QUOTED)]),
    ("llama3_json", "It is sunny <|python", "It is sunny <|python", []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("mistral", 'Checking. [TOOL_CALLS][{"name": "get_weather", "arguments": '
     '{"city": "Paris", "days": 3}}, {"name": "get_time", "arguments": {}}]', "Checking. ",
     [("get_weather", PARIS), ("get_time", {})]),
    ("mistral", "[TOOL_CALLS]get_weather[ARGS]" + json.dumps(QUOTED) +
     "[TOOL_CALLS]get_time[ARGS]{}", None, [("get_weather", QUOTED), ("get_time", {})]),
    ("mistral", "a [TOOL list", "a [TOOL list", []),
    ("qwen3_coder", "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
     "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", "Sure.\n",
     [("get_weather", PARIS)]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\n"
     + QUOTED["city"] + "\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
     '<parameter=tags>\n["a", "}"]\n</parameter>\n</function>\n</tool_call><tool_call>\n'
     "<function=get_time>\n</function>\n</tool_call>", None,
     [("get_weather", QUOTED), ("get_time", {})]),
    ("deepseek_v3", "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
     "get_weather\n```json\n" + json.dumps(PARIS) + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     "Checking.", [("get_weather", PARIS)]),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
     + json.dumps(QUOTED) + "<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}"
     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", None,
     [("get_weather", QUOTED), ("get_time", {})]),
]  # fmt: skip


def _chunkings(text: str) -> list[list[str]]:
    out = [list(text), [text]]
    out += [[text[:i], text[i:]] for i in range(1, len(text))]
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return out


def _reassemble(deltas: list[Json]) -> tuple[str | None, list[tuple[str, str]], list[str]]:
    content, calls, ids = "", {}, []
    for d in deltas:
        content += d.get("content") or ""
        for c in d.get("tool_calls") or ():
            if c["index"] not in calls:
                assert c["index"] == len(calls) and c["function"]["name"]  # name first
                calls[c["index"]] = [c["function"]["name"], ""]
                ids.append(c["id"])
            else:
                assert "name" not in c["function"] and "id" not in c
            calls[c["index"]][1] += c["function"]["arguments"]
    return (content if content.strip() else None), [tuple(c) for c in calls.values()], ids


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: s[0])
def test_streamed_deltas_reassemble_to_the_whole_parse(sample: tuple[Any, ...]) -> None:
    parser, text, content, expected = sample
    mode = ToolMode("auto", NAMES, parser=parser, tools=TOOLS)
    whole_content, whole = parse_calls(text, mode)
    assert whole_content == content
    want = [(c["function"]["name"], c["function"]["arguments"]) for c in whole]
    assert [(name, json.loads(args)) for name, args in want] == expected
    for chunks in _chunkings(text):
        stream = ToolStream(mode)
        deltas = [d for d in map(stream.push, chunks) if d is not None]
        rest, called = stream.finish()
        got_content, got_calls, ids = _reassemble(deltas + rest)
        assert (got_content, got_calls) == (whole_content, want), chunks
        assert called == bool(want) and len(set(ids)) == len(ids)


@pytest.mark.parametrize("parser", sorted(FORMATS))
def test_parallel_tool_calls_false_keeps_the_first_call(parser: str) -> None:
    text = next(t for p, t, _, calls in SAMPLES if p == parser and len(calls) == 2)
    mode = ToolMode("auto", NAMES, parser=parser, parallel=False, tools=TOOLS)
    _, calls = parse_calls(text, mode)
    assert len(calls) == 1
    stream = ToolStream(mode)
    deltas = [d for d in map(stream.push, list(text)) if d is not None]
    _, streamed, _ = _reassemble(deltas + stream.finish()[0])
    assert streamed == [(calls[0]["function"]["name"], calls[0]["function"]["arguments"])]


def test_names_stream_first_and_arguments_as_they_come() -> None:
    stream = ToolStream(ToolMode("auto", NAMES, parser="qwen3_coder", tools=TOOLS))
    assert stream.push("<tool_call>\n<function=get_wea") is None
    head = stream.push("ther>\n<parameter=city>\nPar")
    assert head is not None
    (call,) = head["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Par'}
    assert stream.push("is\n</parameter>\n</function>") == {
        "tool_calls": [{"index": 0, "function": {"arguments": 'is"}'}}]
    }


def test_default_formats_follow_the_chat_template() -> None:
    assert default_format(None) == "hermes"
    assert default_format("{{ '<tool_call>' }}") == "hermes"
    assert default_format("<tool_call><function=x><parameter=y>") == "qwen3_coder"
    assert default_format("[TOOL_CALLS] [AVAILABLE_TOOLS]") == "mistral"
    assert default_format("<｜tool▁calls▁begin｜>") == "deepseek_v3"
    assert default_format("<|python_tag|> ipython") == "llama3_json"
    assert "<tool_call>" in markers("hermes") and "[ARGS]" in markers("mistral")


# -- reasoning ---------------------------------------------------------------------------

R1 = reasoning.PARSERS["deepseek_r1"]
QWEN3 = reasoning.PARSERS["qwen3"]

THINKING = [
    # (format, prompt opens a block, output, reasoning, content)
    (QWEN3, False, "<think>\nLet me add.\n</think>\n\n2 + 2 = 4.", "\nLet me add.\n", "2 + 2 = 4."),
    (QWEN3, False, "  Just 4.", "", "  Just 4."),
    (QWEN3, False, "<thinking> is a tag", "", "<thinking> is a tag"),
    (QWEN3, True, "Hmm </thi", "Hmm </thi", ""),
    (QWEN3, True, "a</think>b", "a", "b"),
    (R1, False, "I think 4.</think>It is 4.", "I think 4.", "It is 4."),
    (R1, False, "never closed", "never closed", ""),
    (R1, True, "</think>\n\n", "", ""),
    (R1, False, "<think>x</think>y <think> z", "x", "y <think> z"),
]


@pytest.mark.parametrize("case", THINKING, ids=lambda c: c[2][:12] if isinstance(c, tuple) else "")
def test_reasoning_splits_the_same_in_any_chunking(case: tuple[Any, ...]) -> None:
    fmt, opened, text, want_reasoning, want_content = case
    whole = reasoning.split(text, fmt, opened)
    assert (whole.reasoning, whole.content) == (want_reasoning, want_content)
    for chunks in _chunkings(text):
        stream = reasoning.ReasoningStream(fmt, opened)
        parts = [stream.push(c) for c in chunks] + [stream.finish()]
        assert (
            "".join(p.reasoning for p in parts), "".join(p.content for p in parts)
        ) == (want_reasoning, want_content), chunks


def test_prompts_that_open_a_block_and_default_parsers() -> None:
    assert QWEN3.opened_by("<|im_start|>assistant\n<think>\n")
    assert not QWEN3.opened_by("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not QWEN3.opened_by("<|im_start|>assistant\n")
    assert reasoning.default_parser("{% if enable_thinking %}<think>") == "qwen3"
    assert reasoning.default_parser("{{ '<think>\\n' }}") == "deepseek_r1"
    assert reasoning.default_parser("{{ messages }}") is None


def test_a_reasoning_models_message_streams_as_it_parses_whole() -> None:
    """Thinking, then text and a tool call: streamed in any chunking, the deltas add up
    to the whole output's message."""
    from frontend.message import MessageStream, message
    from frontend.protocol import PreparedRequest
    from protocol.sampling import SamplingParams

    sampling = SamplingParams(reasoning_start=(1,), reasoning_end=(2,))
    prepared = PreparedRequest((5,), sampling, True, False, thinking=QWEN3,
                               tool_mode=ToolMode("auto", NAMES, tools=TOOLS))  # fmt: skip
    text = ('<think>\nWeather: call it.\n</think>\n\nChecking.<tool_call>{"name": '
            '"get_weather", "arguments": {"city": "Paris", "days": 3}}</tool_call>')  # fmt: skip
    whole, called = message(text, prepared)
    assert called and whole["reasoning_content"] == "\nWeather: call it.\n"
    assert whole["content"] == "Checking."
    want = [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]]
    for chunks in _chunkings(text):
        stream = MessageStream(prepared)
        deltas = [d for d in map(stream.push, chunks) if d is not None]
        rest, streamed_called = stream.finish()
        deltas += rest
        thought = "".join(d.get("reasoning_content") or "" for d in deltas)
        content, calls, _ = _reassemble(deltas)
        assert (thought, content, calls, streamed_called) == (
            whole["reasoning_content"], whole["content"], want, True
        ), chunks
