"""`--deterministic` on the default model in bf16 (the dtype whose greedy text changed
with the batch): a request's logits, every step of them, are the same bits alone and
inside batches of 7, 31 and 63 other requests, cold and over a cached prefix, in one
prefill step and in chunks of 16 tokens; greedy tokens are the same with prompt-lookup
speculation; seeded sampling at temperature 1 draws the same tokens in any batch; an
int8 KV cache and int8 weights keep it. What has no batch-invariant kernel is refused
with its reason.

The CI's forced ISA levels run the first test too (scripts/test): each level's kernels
are batch-invariant on their own (a fleet is deterministic within one level)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.llm import LLM
from protocol.sampling import SamplingParams
from tests.kernels.test_kv_quant import needs_cpu_ops

pytestmark = needs_cpu_ops

TARGET = (
    "In a quiet village by the sea, the old lighthouse keeper told stories about ships and "
    "storms every evening, and the children listened because"
)
OTHERS = [
    f"Note {i}: the {['red', 'tall', 'old', 'quick'][i % 4]} " + "very " * (i % 11)
    + f"{['fox', 'tree', 'river', 'song'][i % 3]} was number {i * 7 % 23}."
    for i in range(63)
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, output_logits=True)


def _engine(**kw: Any) -> LLM:
    return LLM.from_config(EngineConfig(dtype="bfloat16", deterministic=True, num_blocks=512,
                                        max_num_seqs=64, **kw))  # fmt: skip


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with _engine() as engine:
        yield engine


@pytest.fixture(scope="module")
def alone(llm: LLM) -> dict[str, Any]:
    """The target's greedy tokens and logits, alone in a fresh engine (cold)."""
    r = llm.generate([TARGET], GREEDY)[0]
    assert r.logits is not None
    return {"tokens": r.token_ids, "logits": torch.stack(r.logits)}


def _in_batch(llm: LLM, n: int, params: SamplingParams = GREEDY) -> Any:
    """The target's result inside a batch of n others (placed in their middle)."""
    batch = [*OTHERS[: n // 2], TARGET, *OTHERS[n // 2 : n]]
    return llm.generate(batch, params)[n // 2]


def _same(result: Any, alone: dict[str, Any]) -> None:
    assert result.token_ids == alone["tokens"]
    assert torch.equal(torch.stack(result.logits), alone["logits"])


@pytest.mark.parametrize("others", [7, 31, 63])
def test_logits_are_the_same_alone_and_in_batches(
    llm: LLM, alone: dict[str, Any], others: int
) -> None:
    """After the first, the target's prompt is in the prefix cache: only its tail is
    computed, beside the others' whole prompts."""
    _same(_in_batch(llm, others), alone)
    assert llm.engine.snapshot().prefix_hit_rate > 0


def test_chunked_and_uncached_prefill_gives_the_same_logits(alone: dict[str, Any]) -> None:
    with _engine(max_num_batched_tokens=16, enable_prefix_caching=False) as chunked:
        _same(_in_batch(chunked, 7), alone)
        _same(chunked.generate([TARGET], GREEDY)[0], alone)


def test_prompt_lookup_speculation_keeps_the_tokens(llm: LLM) -> None:
    prompt = "Repeat after me: one two three four five, one two three four five, one two"
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = llm.generate([prompt], params)[0].token_ids
    with _engine(num_speculative_tokens=3) as spec:
        drafted = _in_batch_of(spec, prompt, params)
        assert drafted == plain
        assert spec.engine.snapshot().spec_accepted > 0


def _in_batch_of(llm: LLM, prompt: str, params: SamplingParams) -> list[int]:
    out = llm.generate([OTHERS[0], prompt, OTHERS[1]], params)
    return list(out[1].token_ids)


def test_seeded_sampling_draws_the_same_tokens_in_any_batch(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=1234, ignore_eos=True)
    first = llm.generate([TARGET], params)[0].token_ids
    assert _in_batch(llm, 31, params).token_ids == first
    assert _in_batch(llm, 7, params).token_ids == first


def test_seeded_structured_output_is_the_same_in_any_batch(llm: LLM) -> None:
    """The grammar masks the row's own logits; its draws are the row's own."""
    from frontend.structured import json_schema_grammar

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=99,
                            grammar=json_schema_grammar(schema))  # fmt: skip
    first = llm.generate([TARGET], params)[0]
    assert _in_batch(llm, 31, params).token_ids == first.token_ids


def test_an_int8_cache_and_int8_weights_stay_batch_invariant() -> None:
    with _engine(kv_cache_dtype="int8", quantization="int8") as q:
        r = q.generate([TARGET], GREEDY)[0]
        assert r.logits is not None
        _same(_in_batch(q, 63), {"tokens": r.token_ids, "logits": torch.stack(r.logits)})


def test_lora_adapters_stay_batch_invariant(tmp_path: Path) -> None:
    """The target on one adapter: alone, then beside requests on another adapter and on
    the base model, over its cached prefix."""
    from benchmarks.lora_adapters import SPECS, make_adapters, shape_model
    from protocol.lora import AdapterRef

    paths = make_adapters(shape_model(), tmp_path, (SPECS[1], SPECS[2]))
    mine, other = (AdapterRef(name, str(p)) for name, p in paths.items())
    with _engine(enable_lora=True, max_loras=2) as llm:
        r = llm.generate([TARGET], GREEDY, lora=mine)[0]
        assert r.logits is not None
        alone = {"tokens": r.token_ids, "logits": torch.stack(r.logits)}
        assert alone["tokens"] != llm.generate([TARGET], GREEDY)[0].token_ids  # it acts
        batch = [OTHERS[0], OTHERS[1], TARGET, OTHERS[2], OTHERS[3], OTHERS[4]]
        loras = [other, None, mine, other, None, mine]
        _same(llm.generate(batch, GREEDY, lora=loras)[2], alone)


@pytest.mark.parametrize(
    "kw,reason",
    [
        ({"dtype": "float32"}, "bfloat16"),
        ({"cpu_weight_prepack": False}, "packed weights"),
    ],
)
def test_what_has_no_batch_invariant_kernel_is_refused(kw: dict[str, Any], reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        LLM.from_config(EngineConfig(**{"dtype": "bfloat16", "deterministic": True, **kw}))
