"""Pieces of the frontend without a server: the router, the migration request, token
bytes, request parsing."""

from __future__ import annotations

import pytest

from engine.tokenizer import Tokenizer, load_tokenizer
from frontend.errors import BadRequest
from frontend.generation import _for_attempt
from frontend.logprobs import TokenTexts, completion_logprobs
from frontend.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    parse,
    prepare_chat,
    prepare_completion,
)
from frontend.router import LeastLoadedRouter, RouteRequest, WorkerView
from protocol.sampling import SamplingParams
from runtime.rpc import GenerateRequest, LoadReport, TokenLogprob, TopLogprob
from runtime.worker_info import WorkerInfo


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer(None)


def view(wid: str, in_flight: int = 0, running: int | None = None) -> WorkerView:
    load = None if running is None else LoadReport(running_requests=running)
    return WorkerView(wid, WorkerInfo(wid, "decode", "m", grpc_address="h:1"), in_flight, load)


def test_least_loaded_prefers_idle_then_alternates() -> None:
    r = LeastLoadedRouter()
    req = RouteRequest("r", (1, 2, 3))
    assert r.select(req, [view("a", 2), view("b", 1), view("c", 3)]) == "b"
    picks = [r.select(req, [view("a"), view("b")]) for _ in range(4)]
    assert sorted(picks) == ["a", "a", "b", "b"] and picks[0] != picks[1]


def test_load_reports_count_other_frontends_requests() -> None:
    req = RouteRequest("r", (1,))
    workers = [view("a", in_flight=1, running=5), view("b", in_flight=2, running=2)]
    assert LeastLoadedRouter(use_load_reports=True).select(req, workers) == "b"
    assert LeastLoadedRouter(use_load_reports=False).select(req, workers) == "a"


def test_migration_request_replays_tokens_with_the_budget_left() -> None:
    sampling = SamplingParams(temperature=0, max_tokens=10, min_tokens=4)
    req = GenerateRequest("cmpl-1", (1, 2, 3), sampling)
    assert _for_attempt(req, [], 0, None) is req
    retry = _for_attempt(req, [], 1, None)
    assert retry is not None and retry.request_id == "cmpl-1~1"
    assert retry.prompt_token_ids == (1, 2, 3) and retry.sampling == sampling
    moved = _for_attempt(req, [7, 8, 9], 2, None)
    assert moved is not None and moved.prompt_token_ids == (1, 2, 3, 7, 8, 9)
    assert moved.sampling.max_tokens == 7 and moved.sampling.min_tokens == 1
    assert _for_attempt(req, list(range(10)), 1, None) is None  # budget used up
    unbounded = GenerateRequest("c", (1, 2, 3), SamplingParams(max_tokens=None))
    assert _for_attempt(unbounded, [5, 6], 1, 5) is None  # the context is full
    constrained = GenerateRequest("g", (1, 2), SamplingParams(grammar="start: /a+/"))
    first = _for_attempt(constrained, [5, 6], 1, None)
    assert first is not None and first.sampling.output_replay == 2  # the grammar resumes
    again = _for_attempt(first, [7], 1, None)
    assert again is not None and again.sampling.output_replay == 3
    assert moved.sampling.output_replay == 3  # what a grammar or a thinking count replays
    # a migrated request for a LoRA adapter keeps its adapter
    adapted = GenerateRequest("l", (1, 2), sampling, lora_name="sql", lora_path="/a/sql")
    elsewhere = _for_attempt(adapted, [5], 1, None)
    assert elsewhere is not None and elsewhere.lora == adapted.lora
    assert elsewhere.lora is not None and elsewhere.lora.name == "sql"


def test_token_bytes_of_partial_characters(tok: Tokenizer) -> None:
    texts = TokenTexts(tok)
    text = "naïve 😀 café"
    ids = tok.encode(text, add_special_tokens=False)
    raw = b"".join(bytes(texts.get(t)[1]) for t in ids)
    assert raw == text.encode()
    assert any("\ufffd" in texts.text(t) for t in ids)  # the emoji spans several tokens


def test_completion_logprobs_always_hold_the_sampled_token(tok: Tokenizer) -> None:
    texts = TokenTexts(tok)
    a, b = tok.encode(" Paris", add_special_tokens=False)[0], tok.encode(" the")[0]
    lp = TokenLogprob(a, -2.0, 0, (TopLogprob(b, -0.5),))
    out = completion_logprobs(texts, [a], [lp], text_offset=10)
    assert out["top_logprobs"] == [{" the": -0.5, " Paris": -2.0}]
    assert out["text_offset"] == [10] and out["token_logprobs"] == [-2.0]
    inf = completion_logprobs(texts, [a], [TokenLogprob(a, float("-inf"))], 0)
    assert inf["token_logprobs"] == [-9999.0]


def test_prepare_maps_parameters(tok: Tokenizer) -> None:
    body = parse(
        CompletionRequest,
        b'{"model": "m", "prompt": [1, 2, 3], "top_k": -1, "top_p": 0, "seed": -1,'
        b' "stop": "x", "stop_token_ids": [5], "logprobs": 0, "priority": -3}',
    )
    p = prepare_completion(body, tok, 100)
    assert p.priority == -3
    s = p.sampling
    # passed through as declared: top_p 0 is greedy, top_k -1 is off, a negative seed is
    # the engine's to map
    assert (s.temperature, s.top_p, s.top_k, s.seed) == (1.0, 0.0, -1, -1) and s.greedy
    assert s.max_tokens == 16 and s.stop_token_ids == (5,) and s.stop == ("x",)
    assert s.logprobs == 0
    chat = parse(
        ChatCompletionRequest,
        b'{"model": "m", "messages": [{"role": "developer", "content": "Be brief."},'
        b' {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],'
        b' "max_completion_tokens": 5, "max_tokens": 9}',
    )
    p = prepare_chat(chat, tok, None)
    assert p.sampling.max_tokens == 5 and p.sampling.logprobs is None
    assert tok.decode(list(p.prompt_token_ids)).count("Be brief.") == 1
    with pytest.raises(BadRequest, match="context length") as e:
        prepare_chat(chat, tok, len(p.prompt_token_ids) + 2)
    assert e.value.param == "max_completion_tokens"


def test_a_body_too_big_for_the_context_is_refused_from_its_text_alone(tok: Tokenizer) -> None:
    import json

    from frontend.protocol import refuse_oversized_body

    limit = 64 * tok.max_token_chars  # max_model_len 64: the most text that can fit

    def check(body: object, fields: tuple[str, ...], max_len: int | None = 64) -> None:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        refuse_oversized_body(raw, fields, tok, max_len)

    huge = "word " * limit
    refused = [
        ({"model": "m", "prompt": huge}, ("prompt",), "prompt"),
        ({"model": "m", "prompt": [huge]}, ("prompt",), "prompt"),
        ({"messages": [{"role": "user", "content": huge}]}, ("messages",), "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": huge}]}]},
         ("prompt", "messages"), "messages"),
    ]  # fmt: skip
    for body, fields, param in refused:
        with pytest.raises(BadRequest) as e:
            check(body, fields)
        assert (e.value.code, e.value.param) == ("context_length_exceeded", param)
    # a big body whose text fits, one this cannot read, or no known window: left to the
    # validation (and the checks after tokenizing) that follow
    check({"prompt": "a short prompt", "stop": ["x" * limit]}, ("prompt",))
    check(b"{" + b" " * (2 * limit), ("prompt",))
    check([huge], ("prompt",))
    check({"prompt": huge}, ("prompt",), max_len=None)
    check({"prompt": "a" * limit, "stop": ["x" * limit]}, ("prompt",))  # at the bound


def test_every_api_sampling_field_reaches_the_wire_unchanged(tok: Tokenizer) -> None:
    """Each SamplingParams field the API takes under its own name (api=True) goes from a
    request body to the prepared sampling parameters as given, out of range is a 400
    naming it; iterated from the declaration, so a new field is covered by name."""
    import dataclasses
    import json

    from frontend.model_formats import ModelFormats
    from frontend.protocol import SAMPLING_API
    from frontend.reasoning import PARSERS
    from protocol.sampling import SamplingParams
    from tests.protocol.test_sampling import other_value

    # a reasoning model's markers, for max_reasoning_tokens
    thinks = ModelFormats(PARSERS["qwen3"], start_ids=(5,), end_ids=(6,))
    fields = {f.name: f for f in dataclasses.fields(SamplingParams)}
    for name in SAMPLING_API:
        value = other_value(fields[name])
        shown = list(value) if isinstance(value, tuple) else value
        body = {"model": "m", "prompt": [1, 2, 3], name: shown}
        request = parse(CompletionRequest, json.dumps(body).encode())
        p = prepare_completion(request, tok, 100, formats=thinks)
        assert getattr(p.sampling, name) == value, name
    bad = parse  # the declared range at the edge
    with pytest.raises(BadRequest) as e:
        bad(CompletionRequest, b'{"model": "m", "prompt": [1], "typical_p": 0}')
    assert e.value.param == "typical_p"


def test_the_constraint_fields_are_the_ones_find_constraint_reads() -> None:
    """A request that sets none of CONSTRAINT_FIELDS skips frontend/structured.py: each of
    them is a request field, and setting any one alone asks for a constraint."""
    from frontend.structured import CONSTRAINT_FIELDS, find_constraint

    assert set(ChatCompletionRequest.model_fields) >= CONSTRAINT_FIELDS
    valid = {
        "response_format": {"type": "json_object"},
        "structured_outputs": {"regex": "a+"},
        "guided_json": {"type": "object"},
        "guided_regex": "a+",
        "guided_choice": ["a", "b"],
        "guided_grammar": 'root ::= "a"',
    }
    assert set(valid) == CONSTRAINT_FIELDS
    for name, value in valid.items():
        body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}])
        assert find_constraint(body) is None
        setattr(body, name, value)
        assert name in body.model_fields_set
        assert find_constraint(body) is not None, name
