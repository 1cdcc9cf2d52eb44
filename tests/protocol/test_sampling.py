"""SamplingParams, declared once: every field's range holds where it is built, and every
field survives each way it travels (the Generate RPC, the prefill queue, the engine),
checked by iterating the declaration, so a new field is covered by name."""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any

import pytest

from decode_worker.worker import new_request
from protocol.declare import bounds, hints
from protocol.errors import InvalidInput
from protocol.sampling import SamplingParams
from runtime.queue.messages import RemotePrefillRequest
from runtime.rpc.types import GenerateRequest, request_from_bytes, request_to_bytes

FIELDS = [f for f in dataclasses.fields(SamplingParams) if f.init]
HINTS = hints(SamplingParams)


def _base(hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) in (typing.Union, type(int | None)) else hint


def other_value(f: dataclasses.Field[Any]) -> Any:
    """A valid value of field `f` that is not its default."""
    hint, b = _base(HINTS[f.name]), bounds(f)
    if f.name == "grammar":
        return "start: /[a-z]+/"
    if hint is bool:
        return not f.default
    if hint is int:
        lo = int(b.lo) if b.lo is not None else 0
        return lo + 1 if f.default != lo + 1 else lo + 2
    if hint is float:
        lo = -1.0 if b.lo is None else b.lo
        hi = lo + 2.0 if b.hi is None else b.hi
        return (lo + hi) / 2 if (lo + hi) / 2 != f.default else (lo + 3 * hi) / 4
    if hint is str:
        return "x"
    origin = typing.get_origin(hint)
    if origin is tuple:
        item = typing.get_args(hint)[0]
        return ("stop here", "###") if item is str else (3, 5, 8)
    if origin is dict:
        return {7: -1.5, 11: 2.0}
    raise AssertionError(f"no test value for {f.name}: {hint}")


_NEEDS_END = ("max_reasoning_tokens", "reasoning_open")  # a reasoning model's fields


def with_other(name: str) -> SamplingParams:
    extra: dict[str, Any] = {"reasoning_end": (5,)} if name in _NEEDS_END else {}
    f = next(f for f in FIELDS if f.name == name)
    return SamplingParams(**{name: other_value(f), **extra})


def everything_changed() -> SamplingParams:
    values = {f.name: other_value(f) for f in FIELDS}
    values["max_tokens"] = 100  # above min_tokens
    return SamplingParams(**values)


def _travels(p: SamplingParams) -> list[SamplingParams]:
    """p after each way it travels."""
    rpc = request_from_bytes(request_to_bytes(GenerateRequest("r", (1, 2, 3), p))).sampling
    queued = RemotePrefillRequest(
        request_id="r", prompt_token_ids=(1, 2, 3), sampling=p, decode_worker_id="d",
        decode_incarnation_id="i", transfer_agent="a", dst_block_ids=(1,),
        num_cached_tokens=0, deadline=2e9, kv_layout_hash="h",
    )  # fmt: skip
    queue = RemotePrefillRequest.decode(queued.encode()).sampling
    engine = new_request(GenerateRequest("r", (1,), p)).params
    return [rpc, queue, engine]


@pytest.mark.parametrize("name", [f.name for f in FIELDS])
def test_each_field_survives_every_way_it_travels(name: str) -> None:
    p = with_other(name)
    assert getattr(p, name) != getattr(SamplingParams(), name)
    for got in _travels(p):
        assert getattr(got, name) == getattr(p, name), name
        assert got == p


def test_all_fields_at_once_survive() -> None:
    p = everything_changed()
    for got in _travels(p):
        assert got == p
        for f in FIELDS:
            assert getattr(got, f.name) == getattr(p, f.name), f.name


RANGED = [f for f in FIELDS if bounds(f).lo is not None or bounds(f).hi is not None]


@pytest.mark.parametrize("name", [f.name for f in RANGED])
def test_each_range_is_its_declaration_inclusive_and_exclusive(name: str) -> None:
    f = next(f for f in RANGED if f.name == name)
    b, hint = bounds(f), _base(HINTS[name])
    item = typing.get_args(hint)[0] if typing.get_origin(hint) in (tuple, dict) else hint
    wrap = {tuple: lambda v: (v,), dict: lambda v: {1: v}}.get(typing.get_origin(hint), lambda v: v)

    def build(v: Any) -> SamplingParams:
        extra: dict[str, Any] = {"reasoning_end": (5,)} if name in _NEEDS_END else {}
        extra |= {"max_tokens": None} if name == "min_tokens" else {}
        return SamplingParams(**{name: wrap(v), **extra})

    step = 1 if item is int else 1e-6
    for edge, outside in ((b.lo, -step), (b.hi, step)):
        if edge is None:
            continue
        value = item(edge)
        if edge == b.lo and b.lo_open:
            with pytest.raises(InvalidInput, match=name):
                build(value)
        else:
            assert getattr(build(value), name) == wrap(value)
        with pytest.raises(InvalidInput, match=name):
            build(item(edge + outside) if item is int else edge + outside * max(1, abs(edge)))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_k": True}, "top_k"),
        ({"stop": ("",)}, "stop"),
        ({"stop": ("x" * 1025,)}, "stop"),
        ({"stop_token_ids": tuple(range(257))}, "stop_token_ids"),
        ({"logit_bias": {i: 1.0 for i in range(301)}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"max_reasoning_tokens": 2}, "max_reasoning_tokens is for reasoning models"),
        ({"grammar": ""}, "grammar"),
    ],
)
def test_bad_values_name_their_field(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        SamplingParams(**changes)


def test_normalised_shapes() -> None:
    p = SamplingParams(stop="end", stop_token_ids=[1, 2], logit_bias=[(3, 1)])  # type: ignore[arg-type]
    assert p.stop == ("end",) and p.stop_token_ids == (1, 2) and p.logit_bias == {3: 1.0}
    assert SamplingParams(top_p=0.0).greedy and SamplingParams(top_k=1).greedy
    assert not SamplingParams().greedy and SamplingParams(temperature=0).greedy


def test_a_peer_cannot_send_an_unknown_or_out_of_range_field() -> None:
    from runtime.rpc.types import decode_sampling

    with pytest.raises(InvalidInput, match="no field"):
        decode_sampling(b'{"temperature": 1.0, "typical_q": 0.5}')
    with pytest.raises(InvalidInput, match="temperature"):
        decode_sampling(b'{"temperature": 7}')
    with pytest.raises(InvalidInput, match="logit_bias"):
        decode_sampling(b'{"logit_bias": {"x": 1}}')
    with pytest.raises(InvalidInput, match="JSON"):
        decode_sampling(b"\xff")
    assert decode_sampling(b"{}") == SamplingParams()  # a missing field: its default
