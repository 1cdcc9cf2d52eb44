"""Structured output and logit_bias in the engine, on the real default model."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import torch

from engine import LLM, SamplingParams
from engine.grammar import GrammarError, unpack_masks
from frontend.structured import json_schema_grammar

# Objects, arrays with bounds, enums, integers with ranges, nested.
NESTED_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 10},
            "minItems": 1,
            "maxItems": 3,
        },
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", num_blocks=512)


def _chat(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )


def test_unpack_masks_bit_order() -> None:
    masks = torch.zeros(2, 2, dtype=torch.int32)
    masks[0, 0] = 1 | (1 << 9)  # tokens 0 and 9
    masks[1, 1] = -(1 << 31)  # the sign bit: token 63
    allowed = unpack_masks(masks, 70)
    assert allowed.shape == (2, 70)
    assert allowed[0].nonzero().flatten().tolist() == [0, 9]
    assert allowed[1].nonzero().flatten().tolist() == [63]  # 64..69: past the masks


def test_nested_schema_at_high_temperature_always_validates(llm: LLM) -> None:
    grammar = json_schema_grammar(NESTED_SCHEMA)
    prompt = _chat(llm, "Describe a fictional person as JSON.")
    params = [
        SamplingParams(temperature=1.2, seed=seed, max_tokens=256, grammar=grammar)
        for seed in range(16)
    ]
    outs = llm.generate([prompt] * 16, params)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), NESTED_SCHEMA)
    assert len({o.text for o in outs}) > 12  # sampled, not forced to one answer


def test_regex_and_choice(llm: LLM) -> None:
    from frontend.structured import Constraint, _grammar

    regex = _grammar(Constraint("regex", "[0-9]{3}-[0-9]{4}", "x"))
    choice = _grammar(Constraint("choice", ["red", "green", "blue"], "x"))
    prompt = _chat(llm, "Give me a phone number.")
    outs = llm.generate(
        [prompt] * 4,
        [
            SamplingParams(temperature=1.0, seed=1, max_tokens=30, grammar=regex),
            SamplingParams(temperature=0, max_tokens=30, grammar=regex),
            SamplingParams(temperature=1.0, seed=2, max_tokens=30, grammar=choice),
            # the grammar can only end after "red" etc.; min_tokens does not hold it open
            SamplingParams(temperature=0, max_tokens=30, min_tokens=20, grammar=choice),
        ],
    )
    assert all(re.fullmatch("[0-9]{3}-[0-9]{4}", o.text) for o in outs[:2])
    assert outs[2].text in ("red", "green", "blue") and outs[3].text in ("red", "green", "blue")
    assert all(o.finish_reason == "stop" for o in outs)


def test_unconstrained_neighbours_are_unchanged(llm: LLM) -> None:
    """A constrained request in the batch changes nothing for the others (greedy)."""
    plain = _chat(llm, "Name three rivers.")
    alone = llm.generate(plain, SamplingParams(temperature=0, max_tokens=24))[0].text
    grammar = json_schema_grammar(NESTED_SCHEMA)
    outs = llm.generate(
        [plain, _chat(llm, "A person as JSON."), plain],
        [
            SamplingParams(temperature=0, max_tokens=24),
            SamplingParams(temperature=0.8, seed=3, max_tokens=200, grammar=grammar),
            SamplingParams(temperature=0, max_tokens=24),
        ],
    )
    assert outs[0].text == alone and outs[2].text == alone
    jsonschema.validate(json.loads(outs[1].text), NESTED_SCHEMA)


def test_replay_resumes_a_migrated_output(llm: LLM) -> None:
    grammar = json_schema_grammar(NESTED_SCHEMA)
    prompt = _chat(llm, "A person as JSON.")
    whole = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=200, grammar=grammar))[0]
    done = whole.token_ids[:7]  # what a failed worker had streamed
    rest = llm.generate(
        prompt + done,
        SamplingParams(temperature=0, max_tokens=200, grammar=grammar, output_replay=len(done)),
    )[0]
    assert done + rest.token_ids == whole.token_ids
    with pytest.raises(GrammarError):  # output the grammar never allowed
        bad = llm.tokenizer.encode("hello")
        llm.generate(
            prompt + bad,
            SamplingParams(max_tokens=5, grammar=grammar, output_replay=len(bad)),
        )


def test_logit_bias(llm: LLM) -> None:
    prompt = _chat(llm, "Say something.")
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4))[0].token_ids
    token = llm.tokenizer.encode(" banana")[0]
    forced = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=4, logit_bias={token: 100.0})
    )[0]
    assert forced.token_ids == [token] * 4
    banned = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=4, logit_bias={base[0]: -100.0})
    )[0]
    assert banned.token_ids[0] != base[0]


def test_a_grammar_failure_is_its_own_requests_with_a_short_message(llm: LLM) -> None:
    """A grammar whose mask computation fails mid-generation ends its own request with
    llguidance's first line (not its parser state and grammar), and the matcher is never
    read while a mask is being computed (that raised 'Already mutably borrowed' and the
    worker failed every running request)."""
    from engine.grammar import GrammarState

    state = llm.engine.grammar_compiler().state(
        json_schema_grammar({"type": "string", "maxLength": 40})
    )
    quote = llm.tokenizer.encode('"', add_special_tokens=False)[0]
    letter = llm.tokenizer.encode("a", add_special_tokens=False)[0]
    state.mask()
    state.accept(quote)
    for _ in range(200):  # read right after each accept, while its mask is computed
        assert not state.stopped
        state.mask()
        state.accept(letter)
        if state.error:
            break
    assert state.error is None or state.error.startswith("the output constraint failed")

    class Failing:
        def is_stopped(self) -> bool:
            return False

        def unsafe_compute_mask_ptr(self, ptr: int, size: int) -> None:
            raise ValueError("lexer error: too many expressions constructed\n<state>...</state>")

    broken = GrammarState(Failing(), llm.tokenizer.vocab_size)
    assert broken.mask().numel() == broken.num_words
    assert broken.error == (
        "the output constraint failed: lexer error: too many expressions constructed"
    )
    assert not broken.stopped
