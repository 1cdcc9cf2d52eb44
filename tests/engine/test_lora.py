"""Multi-LoRA in the engine, against transformers + peft in fp32 (SmolLM2-135M with
eight adapters `peft` makes here: ranks 8 and 16, different target modules, rsLoRA;
transformers' Llama holds the weights the engine's GGUF reader gives, which
test_parity_hf.py holds to transformers' own GGUF load):

- each adapter's greedy tokens equal transformers + peft's, and differ from the base's;
- one batch of 8 adapters plus the base gives every request the tokens it gets alone,
  in steps that mix adapters;
- paging: 2 device slots and 3 host copies for 8 adapters in rotation: everything
  completes with the same tokens, the waits for a slot counted;
- the adapter is part of the block-hash chain: no prefix is shared across adapters or
  with the base, and one is shared within an adapter;
- bad adapters are refused with their reason.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.lora_adapters import (
    SPECS,
    Spec,
    greedy,
    greedy_with_adapter,
    make_adapter,
    make_adapters,
    reference_model,
)
from engine import LLM, SamplingParams
from engine.lora import load_adapter
from protocol.errors import InvalidInput
from protocol.lora import AdapterRef
from tests.engine.conftest import assert_engine_clean

pytestmark = pytest.mark.slow

MAX_NEW = 12
# two prompts: transformers + peft's reference (eight adapters, a forward a token) is
# most of the module's time
TEXTS = ["def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def hf_model() -> Any:
    return reference_model()


@pytest.fixture(scope="module")
def adapters(hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, AdapterRef]:
    root = tmp_path_factory.mktemp("lora")
    return {name: AdapterRef(name, str(p)) for name, p in make_adapters(hf_model, root).items()}


@pytest.fixture(scope="module")
def prompts(tokenizer: Any) -> list[list[int]]:
    return [tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def reference(
    hf_model: Any, adapters: dict[str, AdapterRef], prompts: list[list[int]]
) -> dict[str | None, list[list[int]]]:
    """transformers (+ peft) greedy tokens: None is the base model."""
    refs: dict[str | None, list[list[int]]] = {None: greedy(hf_model, prompts, MAX_NEW)}
    for name, ref in adapters.items():
        refs[name] = greedy_with_adapter(hf_model, Path(ref.path), prompts, MAX_NEW)
    return refs


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    engine = LLM(dtype="float32", kv_cache_memory_bytes=128 << 20, enable_lora=True, max_loras=8)
    yield engine
    assert_engine_clean(engine)


def _params() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def test_each_adapter_matches_transformers_and_peft(
    llm: LLM, adapters: dict[str, AdapterRef], prompts: list[list[int]],
    reference: dict[str | None, list[list[int]]],
) -> None:  # fmt: skip
    base = [r.token_ids for r in llm.generate(prompts, _params())]
    assert base == reference[None]
    for name, ref in adapters.items():
        got = [r.token_ids for r in llm.generate(prompts, _params(), lora=ref)]
        assert got == reference[name], name
        # not vacuous: the adapter changes what the model says
        assert any(g != b for g, b in zip(got, base)), name


def test_a_mixed_batch_gives_each_request_its_tokens_alone(
    llm: LLM, adapters: dict[str, AdapterRef], prompts: list[list[int]],
    reference: dict[str | None, list[list[int]]],
) -> None:  # fmt: skip
    names: list[str | None] = [None, *adapters]
    batch = [p for _ in names for p in prompts]
    loras = [None if n is None else adapters[n] for n in names for _ in prompts]
    before = llm.engine.loras.mixed_steps if llm.engine.loras else 0
    results = llm.generate(batch, _params(), lora=loras)
    for i, name in enumerate(names):
        got = [r.token_ids for r in results[i * len(prompts) : (i + 1) * len(prompts)]]
        assert got == reference[name], name
    assert llm.engine.loras is not None
    # every decode step held all nine (27 requests in one batch)
    assert llm.engine.loras.mixed_steps - before >= MAX_NEW - 1


def test_paging_with_two_slots_completes_every_request(
    adapters: dict[str, AdapterRef], prompts: list[list[int]],
    reference: dict[str | None, list[list[int]]],
) -> None:  # fmt: skip
    llm = LLM(dtype="float32", kv_cache_memory_bytes=128 << 20, enable_lora=True, max_loras=2,
              max_cpu_loras=3)  # fmt: skip
    try:
        names = [n for _ in range(2) for n in adapters]  # 8 adapters in rotation, twice
        batch = [prompts[i % len(prompts)] for i in range(len(names))]
        loras = [adapters[n] for n in names]
        results = llm.generate(batch, _params(), lora=loras)
        for i, (name, res) in enumerate(zip(names, results)):
            assert res.token_ids == reference[name][i % len(prompts)], name
            assert res.finish_reason == "length"
        snap = llm.engine.snapshot()
        assert sum(s.slot_waits for s in snap.loras.values()) >= 6
        assert sum(s.loads for s in snap.loras.values()) >= 8
        assert sum(s.evictions for s in snap.loras.values()) >= 6
        assert len(snap.lora_resident) <= 2
        assert llm.engine.loras is not None and len(llm.engine.loras.host) <= 3
        assert_engine_clean(llm)
    finally:
        llm.close()


def test_the_adapter_is_part_of_the_block_hash_chain(
    llm: LLM, adapters: dict[str, AdapterRef], tokenizer: Any
) -> None:
    long = tokenizer.encode("A long shared system prompt that fills several blocks. " * 6)
    a, b = adapters["ad-qv8"], adapters["ad-all16"]
    params = SamplingParams(temperature=0, max_tokens=1)

    def cached(lora: AdapterRef | None) -> int:
        return llm.generate([long], params, lora=lora)[0].num_cached_tokens

    assert cached(a) == 0
    assert cached(None) == 0  # the base model does not read a's KV
    assert cached(b) == 0  # nor does another adapter
    assert cached(a) >= 16 * ((len(long) - 1) // 16)  # a reads its own
    assert cached(None) > 0  # and the base its own
    moved = AdapterRef(a.name, a.path + "/")  # the same name from another directory
    assert cached(moved) == 0


def test_bad_adapters_are_refused_with_the_reason(
    llm: LLM, hf_model: Any, tmp_path: Path, adapters: dict[str, AdapterRef]
) -> None:
    prompt = [[1, 2, 3]]

    def refused(ref: AdapterRef, match: str) -> None:
        with pytest.raises(InvalidInput, match=match):
            llm.generate(prompt, _params(), lora=ref)

    refused(AdapterRef("missing", str(tmp_path / "nowhere")), "cannot read adapter_config.json")
    big = make_adapter(hf_model, Spec("big", 32, 32, ("q_proj",)), tmp_path / "big", seed=1)
    big.unload()
    refused(AdapterRef("big", str(tmp_path / "big")), "rank 32.*--max-lora-rank 16")
    # a trained embedding (modules_to_save) would give other tokens: refused
    copy = tmp_path / "saves"
    copy.mkdir()
    src = Path(adapters["ad-qv8"].path)
    cfg = json.loads((src / "adapter_config.json").read_text())
    cfg["modules_to_save"] = ["embed_tokens"]
    (copy / "adapter_config.json").write_text(json.dumps(cfg))
    (copy / "adapter_model.safetensors").write_bytes(
        (src / "adapter_model.safetensors").read_bytes()
    )
    refused(AdapterRef("saves", str(copy)), "modules_to_save")
    # one of another model's shapes
    with pytest.raises(InvalidInput, match=r"not a LoRA A/B"):
        bad = tmp_path / "empty"
        bad.mkdir()
        (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
        import torch
        from safetensors.torch import save_file

        save_file({"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 4)},
                  str(bad / "adapter_model.safetensors"))  # fmt: skip
        load_adapter("empty", bad, 16)
    assert llm.engine.is_idle()


def test_an_engine_without_lora_refuses_an_adapter(
    default_llm: LLM, adapters: dict[str, AdapterRef]
) -> None:
    with pytest.raises(InvalidInput, match="--enable-lora"):
        default_llm.generate([[1, 2, 3]], _params(), lora=adapters["ad-qv8"])
    assert default_llm.engine.is_idle()


def test_specs_cover_ranks_and_modules() -> None:
    """The adapters these tests make: ranks 8 and 16, every target module, rsLoRA."""
    assert {s.rank for s in SPECS} == {8, 16}
    assert {t for s in SPECS for t in s.targets} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
    }  # fmt: skip
    assert any(s.rslora for s in SPECS)
