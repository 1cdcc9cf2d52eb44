"""The engine/wire seam: every valid wire value converts, and nothing is lost on the way."""

from __future__ import annotations

import itertools

import pytest

from engine.request import RequestOutput
from engine.request import TokenLogprob as EngineLogprob
from runtime.rpc.types import FinishReason, GenerateRequest, TokenLogprob, TopLogprob
from runtime.sampling import MAX_TOP_LOGPROBS
from runtime.sampling import SamplingParams as Wire
from worker.convert import (
    engine_logprob,
    engine_params,
    first_token_params,
    new_request,
    to_chunk,
    wire_logprob,
)

# The edges of every range the wire accepts (runtime/sampling.py).
EDGES: dict[str, list[object]] = {
    "temperature": [0.0, 100.0],
    "top_p": [1e-9, 1.0],
    "top_k": [0, 2**31 - 1],
    "min_p": [0.0, 1.0],
    "seed": [None, 0, 2**64 - 1],
    "max_tokens": [None, 1, 2**31 - 1],
    "presence_penalty": [-2.0, 2.0],
    "frequency_penalty": [-2.0, 2.0],
    "repetition_penalty": [1e-9, 10.0],
    "stop_token_ids": [(), (0, 2**31 - 1)],
    "top_logprobs": [0, MAX_TOP_LOGPROBS],
}


@pytest.mark.parametrize(("name", "value"), [(k, v) for k, vs in EDGES.items() for v in vs])
def test_every_wire_edge_is_a_valid_engine_value(name: str, value: object) -> None:
    extra: dict[str, object] = {"logprobs": True} if name == "top_logprobs" else {}
    wire = Wire(**{name: value, **extra})  # type: ignore[arg-type]
    params = engine_params(wire)  # the engine's checks run here
    got = getattr(params, "logprobs" if name == "top_logprobs" else name)
    assert got == (list(value) if isinstance(value, tuple) else value)  # type: ignore[arg-type]


def test_all_fields_convert() -> None:
    wire = Wire(
        temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=11, max_tokens=9, min_tokens=2,
        stop_token_ids=(5, 6), ignore_eos=True, presence_penalty=0.5, frequency_penalty=-0.5,
        repetition_penalty=1.2, logprobs=True, top_logprobs=3,
    )  # fmt: skip
    p = engine_params(wire)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (0.7, 0.9, 40, 0.05, 11)
    assert (p.max_tokens, p.min_tokens, p.stop_token_ids, p.ignore_eos) == (9, 2, [5, 6], True)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert p.logprobs == 3
    assert engine_params(Wire()).logprobs is None
    first = first_token_params(wire)
    assert (first.max_tokens, first.ignore_eos, first.min_tokens, first.seed) == (1, True, 1, 11)
    req = new_request(GenerateRequest("r", (1, 2, 3), wire, priority=-4, cache_salt="s"))
    assert (req.request_id, list(req.prompt_token_ids), req.priority) == ("r", [1, 2, 3], -4)
    assert req.cache_salt == "s" and req.params == p and not req.hold_blocks
    assert new_request(GenerateRequest("r", (1,))).cache_salt is None


def test_logprobs_roundtrip() -> None:
    engine = EngineLogprob(7, -0.5, 0, [(7, -0.5), (3, -1.25)])
    wire = wire_logprob(engine)
    assert wire == TokenLogprob(-0.5, (TopLogprob(7, -0.5), TopLogprob(3, -1.25)))
    assert engine_logprob(7, wire) == engine


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
