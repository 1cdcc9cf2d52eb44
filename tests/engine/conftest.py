"""Engine fixtures: the default model, its HF transformers twin, and an LLM factory
that checks block accounting and invariants when each test ends."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from engine import LLM
from engine.tokenizer import Tokenizer, load_tokenizer
from engine.weights import default_model_path


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return load_tokenizer(None)


@pytest.fixture(scope="session")
def hf_model() -> Any:
    """SmolLM2-135M from the same GGUF, loaded by transformers in fp32 (the reference)."""
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


def assert_engine_clean(llm: LLM) -> None:
    problems = llm.engine.check_invariants()
    assert not problems, problems
    assert llm.engine.is_idle(), (
        f"block accounting not at baseline: {llm.engine.kv.num_free_blocks} free of "
        f"{llm.engine.kv.pool.num_usable_blocks}, requests {list(llm.engine.scheduler.requests)}"
    )


@pytest.fixture
def make_llm() -> Iterator[Callable[..., LLM]]:
    """Build LLMs (fp32 by default); at teardown each must be idle and consistent."""
    made: list[LLM] = []

    def make(**kwargs: Any) -> LLM:
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("kv_cache_memory_bytes", 128 << 20)
        llm = LLM(**kwargs)
        made.append(llm)
        return llm

    yield make
    try:
        for llm in made:
            assert_engine_clean(llm)
    finally:
        for llm in made:
            llm.close()  # the other ranks of a tensor-parallel engine


@pytest.fixture(scope="session")
def default_llm() -> LLM:
    """One shared fp32 engine for tests that only read (each must leave it idle)."""
    return LLM(dtype="float32", kv_cache_memory_bytes=128 << 20)
