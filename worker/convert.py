"""The one seam between the engine's types and the control plane's wire types.

    wire (runtime/)                          engine (engine/)
    GenerateRequest + SamplingParams   ->    NewRequest + SamplingParams
    the first token's sampling         ->    SamplingParams that sample exactly it
    TokenLogprob (+ the token id)     <->    TokenLogprob
    GenerateChunk + Usage              <-    RequestOutput
    KvLayout (discovery record)        <-    KVLayout (its hash computed by the engine)

Every wire value was validated when it was decoded; the wire's ranges are a subset of
the engine's (tests/worker/test_convert.py checks the boundaries), so a valid wire
request always converts.
"""

from __future__ import annotations

import dataclasses

from engine.kv_cache.layout import KVLayout
from engine.request import NewRequest, RequestOutput
from engine.request import TokenLogprob as EngineLogprob
from engine.sampling_params import SamplingParams
from runtime.rpc.types import (
    FinishReason,
    GenerateChunk,
    GenerateRequest,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from runtime.sampling import SamplingParams as WireSampling
from runtime.worker_info import KvLayout

_FINISH = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORT,
    "error": FinishReason.ERROR,
}


def engine_params(s: WireSampling) -> SamplingParams:
    """The engine's parameters for a request's wire sampling parameters."""
    return SamplingParams(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        seed=s.seed,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty,
        stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        min_tokens=s.min_tokens,
        logprobs=s.top_logprobs if s.logprobs else None,
        logit_bias=dict(s.logit_bias),
        grammar=s.grammar,
        grammar_replay=s.grammar_replay,
        num_speculative_tokens=s.num_speculative_tokens,
    )


def new_request(request: GenerateRequest) -> NewRequest:
    """A Generate request as the engine takes it."""
    return NewRequest(
        request.request_id,
        request.prompt_token_ids,
        engine_params(request.sampling),
        priority=request.priority,
        cache_salt=request.cache_salt or None,
    )


def first_token_params(s: WireSampling) -> SamplingParams:
    """Parameters that sample exactly the first token as the decode worker would: the
    same filters and seed, one token, EOS not ending it (the decode worker decides what
    its first token ends)."""
    return dataclasses.replace(
        engine_params(s), max_tokens=1, ignore_eos=True, min_tokens=min(s.min_tokens, 1)
    )


def wire_logprob(lp: EngineLogprob) -> TokenLogprob:
    return TokenLogprob(lp.logprob, tuple(TopLogprob(t, v) for t, v in lp.top))


def engine_logprob(token_id: int, lp: TokenLogprob) -> EngineLogprob:
    """The engine's record of a sampled token's logprob (the wire leaves out the rank)."""
    return EngineLogprob(token_id, lp.logprob, 0, [(t.token_id, t.logprob) for t in lp.top])


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


def wire_layout(layout: KVLayout) -> KvLayout:
    """The KV layout as a discovery record publishes it."""
    return KvLayout(
        block_size=layout.block_size,
        num_blocks=layout.num_blocks,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        dtype=layout.dtype,
        layout_hash=layout.layout_hash,
    )
