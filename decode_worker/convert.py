"""Between the request plane's wire types and the engine's."""

from __future__ import annotations

from engine import RequestOutput, SamplingParams
from engine import TokenLogprob as EngineLogprob
from runtime.rpc.types import FinishReason, GenerateChunk, TokenLogprob, TopLogprob, Usage
from runtime.sampling import SamplingParams as WireSampling

_FINISH = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORT,
    "error": FinishReason.ERROR,
}


def engine_params(s: WireSampling) -> SamplingParams:
    """The engine's SamplingParams for a request's wire sampling parameters."""
    return SamplingParams(**s.to_kwargs())  # type: ignore[arg-type]


def wire_logprob(lp: EngineLogprob) -> TokenLogprob:
    return TokenLogprob(lp.logprob, tuple(TopLogprob(t, v) for t, v in lp.top))


def to_chunk(out: RequestOutput, remote_prefill: bool, with_usage: bool = False) -> GenerateChunk:
    finish = _FINISH.get(out.finish_reason) if out.finished and out.finish_reason else None
    usage = None
    if out.finished or with_usage:
        usage = Usage(
            prompt_tokens=out.num_prompt_tokens,
            completion_tokens=out.num_output_tokens,
            cached_tokens=out.num_cached_tokens,
            remote_prefill=remote_prefill,
        )
    return GenerateChunk(
        token_ids=tuple(out.new_token_ids),
        logprobs=tuple(wire_logprob(lp) for lp in out.new_logprobs or ()),
        finish_reason=finish,
        usage=usage,
    )
