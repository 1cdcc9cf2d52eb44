"""The OpenAI surface beyond the basics, through the official openai client, on a real
`diptych serve` aggregated (no prefill workers) and disaggregated (1 prefill + 1 decode,
prompts past 32 tokens prefilled remotely, so the first token of a constrained request
is sampled under its grammar on the prefill worker)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.e2e.conftest import BASE_FLAGS
from tests.e2e.serving import Server, scrape

pytestmark = pytest.mark.slow

# Small, so that outputs stay short (the nested schema of tests/engine/test_grammar.py
# runs 50 seeds in-process; here the path through both modes is what is tested).
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
# Long enough (with the template's default system prompt) to be prefilled remotely.
ASK = [{"role": "user", "content": "Invent a person and describe them as a JSON object."}]


def _fresh(seed: int) -> list[dict[str, str]]:
    """ASK behind a system message no earlier request shares (no prefix-cache hit, so
    the whole prompt is prefilled remotely in disaggregated mode)."""
    system = f"Session {seed}. You write JSON that describes fictional people for a test suite."
    return [{"role": "system", "content": system}, *ASK]


RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}


@pytest.fixture(scope="module", params=["aggregated", "disaggregated"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    flags = [*BASE_FLAGS] + (["--prefill-workers", "0"] if request.param == "aggregated" else [])
    s = Server(tmp_path_factory.mktemp(request.param), *flags)
    s.mode = request.param  # type: ignore[attr-defined]
    yield s
    assert s.stop() == 0, "".join(s.log[-30:])


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _remote(server: Server) -> float:
    return server.metrics("decode-0").get('diptych_worker_requests_total{prefill="remote"}', 0.0)


def test_json_schema_at_high_temperature(client, model, server) -> None:  # type: ignore[no-untyped-def]
    before = _remote(server)
    for seed in range(3):
        out = client.chat.completions.create(
            model=model, messages=_fresh(seed), max_tokens=100, temperature=1.2, seed=seed,
            response_format=RESPONSE_FORMAT,
        )  # fmt: skip
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content or ""), SCHEMA)
    stream = client.chat.completions.create(
        model=model, messages=_fresh(99), max_tokens=100, temperature=1.2, seed=99,
        response_format=RESPONSE_FORMAT, stream=True,
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    remote = _remote(server) - before
    assert remote == (4 if server.mode == "disaggregated" else 0)  # type: ignore[attr-defined]


def test_json_object_regex_choice_grammar(client, model) -> None:  # type: ignore[no-untyped-def]
    capital = 'Reply with a JSON object whose key "capital" holds the capital of France.'
    out = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": capital}], max_tokens=60,
        temperature=0, response_format={"type": "json_object"},
    )  # fmt: skip
    assert out.choices[0].finish_reason == "stop"  # free-form keys: only a budget bounds them
    assert isinstance(json.loads(out.choices[0].message.content or ""), dict)
    phone = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "A phone number?"}], max_tokens=20,
        temperature=0.8, seed=2, extra_body={"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}},
    )  # fmt: skip
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", phone.choices[0].message.content or "")
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Sky colour?"}], max_tokens=10,
        stream=True, extra_body={"guided_choice": ["red", "blue", "green"]},
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text in ("red", "blue", "green")
    grammar = 'start: "yes" | "no" | "maybe " NUMBER\nNUMBER: /[0-9]+/'
    done = client.completions.create(
        model=model, prompt="Is it raining? Answer:", max_tokens=10, temperature=1.0, seed=4,
        extra_body={"guided_grammar": grammar},
    )  # fmt: skip
    assert re.fullmatch(r"yes|no|maybe [0-9]+", done.choices[0].text)


def test_bad_schema_is_a_400(client, model) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model, messages=ASK, max_tokens=5,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}},
        )  # fmt: skip
    assert "cannot be compiled" in str(e.value)


def test_logit_bias_echo_stop_token_ids_min_tokens(client, model, server) -> None:  # type: ignore[no-untyped-def]
    tok = httpx.post(server.url + "/tokenize", json={"prompt": " banana"}).json()
    banana = tok["tokens"][-1]
    out = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=3, temperature=0, logit_bias={str(banana): 100}
    )
    assert out.choices[0].message.content == " banana" * 3
    stream = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=3, temperature=0, logit_bias={str(banana): 100},
        stream=True,
    )  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == " banana" * 3
    plain = client.completions.create(model=model, prompt="One, two,", max_tokens=8, temperature=0)
    first = httpx.post(
        server.url + "/tokenize",
        json={"prompt": plain.choices[0].text, "add_special_tokens": False},
    ).json()["tokens"][0]
    stopped = client.completions.create(
        model=model, prompt="One, two,", max_tokens=8, temperature=0, echo=True,
        extra_body={"stop_token_ids": [first]},
    )  # fmt: skip
    assert stopped.choices[0].text.startswith("One, two,")
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage is not None and stopped.usage.completion_tokens == 1
    chunks = list(
        client.completions.create(
            model=model, prompt="One, two,", max_tokens=8, temperature=0, echo=True, stream=True,
            stream_options={"include_usage": True}, extra_body={"stop_token_ids": [first]},
        )
    )  # fmt: skip
    assert chunks[0].choices[0].text == "One, two,"  # the echo comes first
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 1
    long = client.completions.create(
        model=model, prompt="One, two,", max_tokens=8, temperature=0,
        extra_body={"min_tokens": 8, "ignore_eos": False},
    )  # fmt: skip
    assert long.usage is not None and long.usage.completion_tokens == 8
    chunks = list(
        client.completions.create(
            model=model, prompt="One, two,", max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"min_tokens": 8},
        )
    )  # fmt: skip
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


def test_models_tokenize_detokenize(client, model, server) -> None:  # type: ignore[no-untyped-def]
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    tok = httpx.post(
        server.url + "/tokenize",
        json={"model": model, "messages": ASK, "return_token_strs": True},
    ).json()
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) > 10
    assert tok["max_model_len"] > 0
    text = httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert ASK[0]["content"] in text and "<|im_start|>" in text
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_responses_api(client, model) -> None:  # type: ignore[no-untyped-def]
    r = client.responses.create(
        model=model, input="Say hello.", instructions="Answer in one word.", max_output_tokens=5,
        temperature=0,
    )  # fmt: skip
    assert r.output_text and r.usage is not None and r.usage.output_tokens <= 5
    assert r.status in ("completed", "incomplete")
    stream = client.responses.create(
        model=model, input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi!"}]}],
        max_output_tokens=5, temperature=0, stream=True,
    )  # fmt: skip
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added",
    ]  # fmt: skip
    assert kinds[-1] in ("response.completed", "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    structured = client.responses.create(
        model=model, input=ASK, max_output_tokens=100, temperature=1.0,
        text={"format": {"type": "json_schema", "name": "person", "schema": SCHEMA}},
    )  # fmt: skip
    jsonschema.validate(json.loads(structured.output_text), SCHEMA)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=model, input="x", previous_response_id="resp_1")


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 20}},
            "required": ["zone"],
        },
    },
}
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_tool_choice_named_and_required(client, model) -> None:  # type: ignore[no-untyped-def]
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(
        model=model, messages=WEATHER_ASK, tools=[WEATHER, TIME], tool_choice=named,
        max_tokens=60, temperature=1.0, seed=5,
    )  # fmt: skip
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    params = WEATHER["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), params)
    pieces = []
    for chunk in client.chat.completions.create(
        model=model, messages=WEATHER_ASK, tools=[WEATHER, TIME], tool_choice=named,
        max_tokens=60, temperature=1.0, seed=5, stream=True,
    ):  # fmt: skip
        for c in chunk.choices:
            pieces += [d.function.arguments or "" for d in c.delta.tool_calls or [] if d.function]
    assert len(pieces) > 1  # the arguments stream as they are generated
    assert "".join(pieces) == call.function.arguments  # same seed, same call
    stream = client.chat.completions.create(
        model=model, messages=WEATHER_ASK, tools=[WEATHER, TIME], tool_choice="required",
        max_tokens=120, temperature=1.0, seed=6, stream=True,
    )  # fmt: skip
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += (d.function and d.function.name) or ""
                entry["arguments"] += (d.function and d.function.arguments) or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and calls
    for entry in calls.values():
        tool = {"get_weather": WEATHER, "get_time": TIME}[entry["name"]]
        jsonschema.validate(json.loads(entry["arguments"]), tool["function"]["parameters"])


def test_tool_results_back_in_the_conversation(client, model) -> None:  # type: ignore[no-untyped-def]
    history = [
        *WEATHER_ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    out = client.chat.completions.create(
        model=model, messages=history, tools=[WEATHER], max_tokens=30, temperature=0
    )
    message = out.choices[0].message
    assert message.content or message.tool_calls  # auto: text, or a parsed call
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=model, messages=WEATHER_ASK, tools=[WEATHER], max_tokens=5,
            tool_choice={"type": "function", "function": {"name": "no_such_tool"}},
        )  # fmt: skip


def _cached_prompt_tokens(server: Server) -> float:
    samples = scrape(server.url)
    return sum(v for k, v in samples.items() if k.startswith("diptych_frontend_cached_prompt"))


def test_n_choices_share_the_prompt(client, model, server) -> None:  # type: ignore[no-untyped-def]
    prompt = "Session n. " + " ".join(f"item{i}" for i in range(60)) + ". Continue the list:"
    before = _cached_prompt_tokens(server)
    out = client.completions.create(
        model=model, prompt=prompt, n=4, max_tokens=8, temperature=1.0, seed=7,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert len({c.text for c in out.choices}) > 1  # seeds 7, 8, 9, 10
    assert out.usage is not None and out.usage.completion_tokens == 32
    prompt_tokens = out.usage.prompt_tokens
    # choices 1-3 found the prompt's full blocks cached where choice 0 computed them
    shared = _cached_prompt_tokens(server) - before
    assert shared >= 3 * ((prompt_tokens - 1) // 16) * 16
    again = client.completions.create(
        model=model, prompt=prompt, n=4, max_tokens=8, temperature=1.0, seed=7,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # reproducible
    stream = client.chat.completions.create(
        model=model, messages=ASK, n=3, max_tokens=6, temperature=1.0, seed=1, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    texts, finished, usage = ["", "", ""], set(), None
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
        usage = chunk.usage or usage
    assert finished == {0, 1, 2} and all(texts)
    assert usage is not None and usage.completion_tokens == 18
    used = server.metrics("decode-0")["diptych_worker_kv_used_blocks"]
    assert used == 0  # every choice's blocks went back


def test_responses_function_tools(client, model) -> None:  # type: ignore[no-untyped-def]
    fn = WEATHER["function"]
    tool = {"type": "function", "name": fn["name"], "description": fn["description"],
            "parameters": fn["parameters"]}  # fmt: skip
    r = client.responses.create(
        model=model, input="Weather in Oslo?", tools=[tool], max_output_tokens=60,
        tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
    )  # fmt: skip
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), fn["parameters"])
    events = list(
        client.responses.create(
            model=model, input="Weather in Oslo?", tools=[tool], max_output_tokens=80,
            tool_choice="required", temperature=0.7, stream=True, extra_body={"seed": 3},
        )
    )  # fmt: skip
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done and events[-1].type == "response.completed"
    calls = [i for i in events[-1].response.output if i.type == "function_call"]
    assert [c.arguments for c in calls] == [e.arguments for e in done]
    followup = client.responses.create(
        model=model, tools=[tool], max_output_tokens=20, temperature=0,
        input=[
            {"role": "user", "content": "Weather in Oslo?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name,
             "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "4 C, rain"},
        ],
    )  # fmt: skip
    assert followup.status in ("completed", "incomplete") and followup.output
