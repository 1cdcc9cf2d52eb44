"""Speculative decoding with a draft model (`EngineConfig.speculative_model`,
engine/spec/draft.py): the default model in fp32 drafted by its own Q4_1 blocks. Greedy
output is identical to decoding without drafts, drafts are accepted, sampled requests
draft and are reproducible with a seed, the draft engine leaks nothing, and a draft
model of another tokenizer is refused."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from engine import LLM
from engine.spec.draft import DraftModel
from engine.weights import default_model_path
from tests.engine.test_speculative import EDIT, _run
from tests.engine.test_weights_gguf import tiny_model, write_gguf


def test_draft_model_keeps_the_output(make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(speculative_model=str(default_model_path()), speculative_quantization="gguf")
    spec = llm.engine.scheduler.speculator
    assert isinstance(spec, DraftModel)
    draft = spec.engine
    assert draft.runner.quantization and not llm.engine.runner.quantization
    ids = llm.tokenizer.apply_chat_template(EDIT)
    plain, reason, most = _run(llm, ids, max_tokens=48)
    assert most == 1 and spec.steps == 0  # the engine default is off
    fast, fast_reason, most = _run(llm, ids, max_tokens=48, num_speculative_tokens=3)
    assert fast == plain and fast_reason == reason
    # Q4_1 drafting for the fp32 model agrees on most tokens
    assert most > 1 and spec.accepted > 0.5 * spec.drafted and spec.steps < 40
    joke = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a joke."}])
    assert (
        _run(llm, joke, max_tokens=16, num_speculative_tokens=4)[0]
        == _run(llm, joke, max_tokens=16)[0]
    )
    # sampled requests draft too, stop cleanly, and a seed fixes their output: the
    # draft engine's cache is salted per request, so the second run's drafts do not
    # start from the first run's cached blocks (attended through other kernels, where
    # near-ties can split). The rule's exactness is tested on a toy chain
    # (test_spec_cores.py).
    accepted = spec.accepted
    sampled = dict(max_tokens=24, num_speculative_tokens=3, temperature=0.5, seed=3,
                   ignore_eos=True)  # fmt: skip
    first, reason, _ = _run(llm, joke, **sampled)
    assert len(first) == 24 and reason == "length" and spec.accepted > accepted
    assert _run(llm, joke, **sampled)[0] == first
    # every draft request finished and its blocks went back (cached, not leaked)
    assert draft.is_idle() and not draft.check_invariants()
    assert draft.kv.num_free_blocks == draft.kv.pool.num_usable_blocks


def test_a_draft_model_of_another_tokenizer_is_refused(tmp_path: Path) -> None:
    other = write_gguf(tmp_path / "other.gguf", tiny_model("llama"), "llama")
    with pytest.raises(ValueError, match="does not share the model's tokenizer"):
        LLM(dtype="float32", kv_cache_memory_bytes=64 << 20, speculative_model=str(other))
