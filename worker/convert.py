"""A Generate request as the engine takes it, and the engine's outputs as the request
plane's chunks. Both sides share the leaf types (`protocol`: sampling parameters,
logprobs, finish reasons, the KV layout), so nothing here converts a value; it only
regroups fields.

    wire (runtime/)                  engine (engine/)
    GenerateRequest            ->    NewRequest
    GenerateChunk + Usage      <-    RequestOutput
"""

from __future__ import annotations

from engine.request import NewRequest, RequestOutput
from protocol.outcomes import FinishReason
from protocol.sampling import SamplingParams
from runtime.rpc.types import GenerateChunk, GenerateRequest, Usage


def new_request(request: GenerateRequest) -> NewRequest:
    """A Generate request as the engine takes it."""
    return NewRequest(
        request.request_id,
        request.prompt_token_ids,
        request.sampling,
        priority=request.priority,
        cache_salt=request.cache_salt or None,
    )


def first_token_params(s: SamplingParams) -> SamplingParams:
    """Parameters that sample exactly the first token as the decode worker would: the
    same filters and seed, one token, EOS not ending it (the decode worker decides what
    its first token ends)."""
    return s.replace(max_tokens=1, ignore_eos=True, min_tokens=min(s.min_tokens, 1))


def to_chunk(out: RequestOutput, remote_prefill: bool, with_usage: bool = False) -> GenerateChunk:
    finish = FinishReason(out.finish_reason) if out.finished and out.finish_reason else None
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
        logprobs=tuple(out.new_logprobs or ()),
        finish_reason=finish,
        usage=usage,
    )
