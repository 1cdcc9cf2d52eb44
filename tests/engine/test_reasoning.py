"""Reasoning models in the engine: the thinking budget, the count, the grammar after
thinking, and a migrated request's thinking resumed. A tiny random Qwen3 (fp32, greedy)
whose thinking only a budget ends, prompted through the frontend's own preparation, and
SmolLM2 with a template that opens a thinking block, whose markers are several tokens."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from engine.llm import LLM
from engine.tokenizer import load_tokenizer
from frontend.generation import _for_attempt
from frontend.message import message
from frontend.model_formats import ModelFormats
from frontend.protocol import (
    ChatCompletionRequest,
    PreparedRequest,
    parse,
    prepare_chat,
)
from runtime.rpc import GenerateRequest
from tests.tiny_qwen3 import tiny_qwen3

CHAT = [{"role": "user", "content": "What is 2 + 2? Think first."}]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    path = tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"))
    llm = LLM(str(path), dtype="float32", num_blocks=512)
    yield llm
    llm.close()


def _prepare(llm: LLM, formats: ModelFormats | None = None, **body: object) -> PreparedRequest:
    req = {"model": "m", "messages": CHAT, "temperature": 0, **body}
    formats = formats or ModelFormats.resolve(llm.tokenizer)
    return prepare_chat(
        parse(ChatCompletionRequest, json.dumps(req).encode()), llm.tokenizer, 4096,
        llm.engine.grammar_compiler(), formats,
    )  # fmt: skip


@pytest.mark.parametrize("budget", [0, 16, 128])
def test_the_budget_ends_thinking_and_an_answer_follows(qwen3: LLM, budget: int) -> None:
    formats = ModelFormats.resolve(qwen3.tokenizer)
    assert formats.thinking is not None and formats.thinking.name == "qwen3"
    p = _prepare(qwen3, max_reasoning_tokens=budget, max_tokens=budget + 24)
    # Qwen3's template leaves thinking to the model: the frontend opened the block
    assert p.sampling.reasoning_open
    assert qwen3.tokenizer.decode(list(p.prompt_token_ids[-3:]), False).endswith("<think>\n")
    (out,) = qwen3.generate([list(p.prompt_token_ids)], p.sampling)
    end = list(formats.end_ids)
    at = next(i for i in range(len(out.token_ids)) if out.token_ids[i : i + len(end)] == end)
    assert out.num_reasoning_tokens == at + len(end) <= budget + len(end)
    assert len(out.token_ids) > at + len(end)  # the answer follows
    msg, _ = message(qwen3.tokenizer.decode(out.token_ids, False), p)
    assert msg["content"] and msg["content"].strip()
    assert (msg["reasoning_content"] or "") == qwen3.tokenizer.decode(out.token_ids[:at], False)


def test_thinking_is_counted_without_a_budget_and_skipped_when_switched_off(qwen3: LLM) -> None:
    p = _prepare(qwen3, max_tokens=24)
    assert not p.sampling.reasoning_open and p.sampling.max_reasoning_tokens is None
    (out,) = qwen3.generate([list(p.prompt_token_ids)], p.sampling)
    assert out.num_reasoning_tokens == 0  # it did not open a block: all answer
    off = _prepare(qwen3, max_tokens=8, max_reasoning_tokens=64,
                   chat_template_kwargs={"enable_thinking": False})  # fmt: skip
    assert not off.sampling.reasoning_open  # the template closed the block already
    (out,) = qwen3.generate([list(off.prompt_token_ids)], off.sampling)
    assert out.num_reasoning_tokens == 0
    effort = _prepare(qwen3, max_tokens=40, reasoning_effort="low")
    assert effort.sampling.max_reasoning_tokens == ModelFormats().effort_budgets["low"]


def test_a_grammar_constrains_the_answer_only(qwen3: LLM) -> None:
    p = _prepare(qwen3, max_reasoning_tokens=16, max_tokens=64, guided_choice=["yes", "no"])
    (out,) = qwen3.generate([list(p.prompt_token_ids)], p.sampling)
    assert out.finish_reason == "stop" and out.num_reasoning_tokens == 17
    msg, _ = message(out.text, p)
    assert msg["content"] in ("yes", "no")
    assert len(qwen3.tokenizer.encode(msg["reasoning_content"], add_special_tokens=False)) > 4


def test_a_migrated_request_resumes_its_thinking_and_budget(qwen3: LLM) -> None:
    p = _prepare(qwen3, max_reasoning_tokens=16, max_tokens=40, guided_choice=["yes", "no"])
    (whole,) = qwen3.generate([list(p.prompt_token_ids)], p.sampling)
    assert len(whole.token_ids) > 17  # the answer came after the end marker
    for cut in (5, 16, 17):  # inside, at the budget (the marker next), just past the marker
        request = GenerateRequest("r", p.prompt_token_ids, p.sampling)
        moved = _for_attempt(request, whole.token_ids[:cut], 1, None)
        assert moved is not None and moved.sampling.output_replay == cut
        (rest,) = qwen3.generate([list(moved.prompt_token_ids)], moved.sampling)
        assert whole.token_ids[:cut] + rest.token_ids == whole.token_ids, cut
        assert rest.num_reasoning_tokens == whole.num_reasoning_tokens == 17


def test_several_token_markers_on_smollm2() -> None:
    """SmolLM2 with a template whose generation prompt opens a thinking block: its
    markers are several ordinary tokens, forced in turn when the budget is spent."""
    llm = LLM(None, dtype="bfloat16", num_blocks=256)
    try:
        tok = llm.tokenizer
        tok.hf_tokenizer.chat_template = (
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
            "{% endfor %}<|im_start|>assistant\n<think>\n"
        )
        formats = ModelFormats.resolve(tok)
        assert formats.thinking is not None and formats.thinking.name == "deepseek_r1"
        assert len(formats.end_ids) > 1
        p = _prepare(llm, formats, max_reasoning_tokens=16, max_tokens=48)
        assert p.sampling.reasoning_open
        (out,) = llm.generate([list(p.prompt_token_ids)], p.sampling)
        assert 0 < out.num_reasoning_tokens <= 16 + len(formats.end_ids)
        msg, _ = message(tok.decode(out.token_ids), p)
        assert msg["reasoning_content"] and msg["content"] and msg["content"].strip()
    finally:
        llm.close()


def test_max_reasoning_tokens_needs_a_reasoning_model() -> None:
    from frontend.errors import BadRequest

    tok = load_tokenizer(None)
    body = {"model": "m", "messages": CHAT, "max_reasoning_tokens": 8}
    with pytest.raises(BadRequest, match="reasoning models") as e:
        prepare_chat(parse(ChatCompletionRequest, json.dumps(body).encode()), tok, 4096)
    assert e.value.param == "max_reasoning_tokens"
    # reasoning_effort is ignored where there is nothing to budget, as clients send it
    body = {"model": "m", "messages": CHAT, "reasoning_effort": "high"}
    p = prepare_chat(parse(ChatCompletionRequest, json.dumps(body).encode()), tok, 4096)
    assert p.sampling.max_reasoning_tokens is None and p.thinking is None


