"""The engine/wire seam: both sides share protocol's types, so a request reaches the
engine with every field, and the engine's outputs become chunks without loss."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from decode_worker.worker import new_request, to_chunk
from engine.request import NewRequest, RequestOutput
from prefill_worker.worker import first_token_params
from protocol.logprobs import TokenLogprob, TopLogprob
from protocol.lora import AdapterRef
from protocol.outcomes import FinishReason
from protocol.sampling import SamplingParams
from runtime.rpc.types import GenerateRequest, chunk_from_pb, chunk_to_pb


def test_a_request_reaches_the_engine_with_every_field() -> None:
    sampling = SamplingParams(temperature=0.7, seed=11, max_tokens=9, min_tokens=2, logprobs=3)
    wire = GenerateRequest(
        "r", (1, 2, 3), sampling, priority=-4, cache_salt="s", session_id="conversation-7",
        lora_name="sql", lora_path="/adapters/sql",
    )  # fmt: skip
    req = new_request(wire)
    assert req.lora == AdapterRef("sql", "/adapters/sql")
    mapped = {"sampling": "params"}  # the only field the engine names otherwise
    # the LoRA adapter's two fields reach the engine as one AdapterRef (checked above)
    adapter = {"lora_name", "lora_path"}
    # fields marked local travel beside the request (the call's trace context, kept by
    # the worker's spans), never to the engine: by name, so a new one is a choice
    local = {f.name for f in dataclasses.fields(GenerateRequest) if f.metadata.get("local")}
    assert local == {"traceparent"}, local
    # and fields the worker itself reads before the engine (a peer to pull a prefix from)
    worker = {f.name for f in dataclasses.fields(GenerateRequest) if f.metadata.get("worker")}
    assert worker == {"kv_peer", "kv_peer_blocks"}, worker
    local |= worker
    engine_fields = {f.name for f in dataclasses.fields(NewRequest)}
    for f in dataclasses.fields(GenerateRequest):
        if f.name in local or f.name in adapter:
            continue
        name = mapped.get(f.name, f.name)
        assert name in engine_fields, f"GenerateRequest.{f.name} does not reach the engine"
        got = getattr(req, name)
        want = getattr(wire, f.name)
        assert (tuple(got) if f.name == "prompt_token_ids" else got) == want, f.name
    assert req.params is sampling and not req.hold_blocks
    bare = new_request(GenerateRequest("r", (1,)))
    assert bare.cache_salt is None and bare.session_id is None  # "" on the wire: none
    assert bare.lora is None


def test_the_first_token_is_sampled_as_the_decode_worker_would() -> None:
    s = SamplingParams(temperature=0.7, top_k=40, seed=11, max_tokens=9, min_tokens=2)
    first = first_token_params(s)
    assert (first.max_tokens, first.ignore_eos, first.min_tokens) == (1, True, 1)
    for f in dataclasses.fields(SamplingParams):
        if f.name not in ("max_tokens", "ignore_eos", "min_tokens"):
            assert getattr(first, f.name) == getattr(s, f.name), f.name


@pytest.mark.parametrize(
    ("reason", "first"), list(itertools.product(["stop", "length", None], [0, 1]))
)
def test_chunks_carry_usage_on_the_first_and_the_last(reason: str | None, first: int) -> None:
    out = RequestOutput(
        "r", [4], finished=reason is not None, finish_reason=reason,
        num_prompt_tokens=10, num_cached_tokens=8, num_output_tokens=3,
    )  # fmt: skip
    chunk = to_chunk(out, remote_prefill=True, with_usage=bool(first))
    assert chunk.token_ids == (4,)
    assert chunk.finish_reason == (FinishReason(reason) if reason else None)
    if reason or first:
        assert chunk.usage is not None and chunk.usage.cached_tokens == 8
        assert chunk.usage.remote_prefill and chunk.usage.completion_tokens == 3
    else:
        assert chunk.usage is None


def test_logprobs_cross_the_wire_whole() -> None:
    lps = [
        TokenLogprob(7, -0.5, 1, (TopLogprob(7, -0.5), TopLogprob(3, -1.25))),
        TokenLogprob(9, -2.0, 4, ()),
    ]
    out = RequestOutput("r", [7, 9], finished=False, new_logprobs=lps)
    chunk = to_chunk(out, remote_prefill=False)
    back = chunk_from_pb(chunk_to_pb(chunk))
    assert not isinstance(back, tuple)
    assert [(lp.token_id, lp.rank, lp.top) for lp in back.logprobs] == [
        (lp.token_id, lp.rank, lp.top) for lp in lps
    ]
    assert [lp.logprob for lp in back.logprobs] == pytest.approx([lp.logprob for lp in lps])
