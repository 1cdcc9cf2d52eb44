"""SamplingParams validation: every bad value is a ValueError naming the parameter, and a
valid one reaches torch (the seed) in an engine Request."""

from __future__ import annotations

import math

import pytest

from engine.request import Request
from protocol.sampling import MAX_LOGPROBS, SamplingParams

INVALID: list[tuple[str, object]] = [
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("max_tokens", 2.0),
    ("max_tokens", "8"),
    ("temperature", -0.01),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", "0.7"),
    ("temperature", None),
    ("temperature", 2.01),
    ("top_p", -0.5),
    ("top_p", 1.0001),
    ("top_p", math.nan),
    ("top_p", math.inf),
    ("top_k", -2),
    ("top_k", 2.5),
    ("top_k", "3"),
    ("min_p", -0.01),
    ("min_p", 1.01),
    ("min_p", math.nan),
    ("presence_penalty", 2.01),
    ("presence_penalty", -2.01),
    ("presence_penalty", math.nan),
    ("presence_penalty", -math.inf),
    ("frequency_penalty", 2.5),
    ("frequency_penalty", -2.5),
    ("frequency_penalty", math.inf),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.nan),
    ("repetition_penalty", math.inf),
    ("seed", 1.5),
    ("seed", "42"),
    ("logprobs", -1),
    ("logprobs", MAX_LOGPROBS + 1),
    ("logprobs", 1.0),
    ("min_tokens", -1),
    ("min_tokens", 0.5),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1, 2.0]),
    ("stop_token_ids", ["3"]),
    ("stop", [""]),
    ("stop", ""),
    ("stop", [3]),
    ("stop", ["ok", None]),
]


@pytest.mark.parametrize(("name", "value"), INVALID, ids=[f"{n}={v!r}" for n, v in INVALID])
def test_invalid_value_raises_naming_the_parameter(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})  # type: ignore[arg-type]


# Booleans are ints to Python but never a meaningful count, seed or id; the float
# parameters already refuse them (temperature=True is an error), the integer ones must too.
BOOL_AS_INT = [
    ("max_tokens", True),
    ("top_k", True),
    ("seed", False),
    ("logprobs", True),
    ("min_tokens", True),
    ("stop_token_ids", [True]),
]


def test_booleans_are_not_integers() -> None:
    accepted = []
    for name, value in BOOL_AS_INT:
        try:
            SamplingParams(**{name: value})  # type: ignore[arg-type]
        except ValueError as e:
            assert name in str(e)
        else:
            accepted.append(f"{name}={value!r}")
    assert accepted == [], f"accepted booleans as integers: {accepted}"


@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p", "presence_penalty"])
def test_booleans_are_not_floats(name: str) -> None:
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: True})  # type: ignore[arg-type]


def test_seed_outside_64_bits_is_rejected_up_front() -> None:
    """A seed torch cannot take must fail validation, not later inside Request()."""
    accepted = []
    for seed in (2**64, -(2**63) - 1, 10**30):
        try:
            SamplingParams(seed=seed)
        except ValueError as e:
            assert "seed" in str(e)
        else:
            accepted.append(seed)
    assert accepted == [], f"seeds outside [-2**63, 2**64) accepted: {accepted}"


def test_min_tokens_above_max_tokens() -> None:
    with pytest.raises(ValueError, match=r"min_tokens \(5\) must not exceed max_tokens \(4\)"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_messages_carry_the_bad_value() -> None:
    with pytest.raises(ValueError, match=r"top_p must be in \[0\.0, 1\.0\], got 1\.5"):
        SamplingParams(top_p=1.5)


VALID: list[dict[str, object]] = [
    {},
    {"max_tokens": 1},
    {"max_tokens": None},
    {"max_tokens": None, "min_tokens": 10_000},
    {"max_tokens": 7, "min_tokens": 7},
    {"temperature": 0},
    {"temperature": 0.0},
    {"temperature": 1e-6},
    {"temperature": 2.0},
    {"top_p": 0.0},
    {"top_p": 1.0},
    {"top_p": 1},
    {"top_p": 1e-9},
    {"top_k": -1},
    {"top_k": 0},
    {"top_k": 1},
    {"top_k": 10**9},
    {"min_p": 0.0},
    {"min_p": 1.0},
    {"presence_penalty": -2.0, "frequency_penalty": 2.0},
    {"presence_penalty": 2, "frequency_penalty": -2},
    {"repetition_penalty": 1e-6},
    {"repetition_penalty": 10.0},
    {"seed": 0},
    {"seed": -1},
    {"seed": 2**64 - 1},
    {"seed": -(2**63)},
    {"logprobs": 0},
    {"logprobs": MAX_LOGPROBS},
    {"logprobs": None},
    {"min_tokens": 0},
    {"stop_token_ids": []},
    {"stop_token_ids": [0, 151_643]},
    {"stop_token_ids": (1, 2)},
    {"stop": []},
    {"stop": ["\n", "###"]},
    {"stop": "END"},
    {"ignore_eos": True, "skip_special_tokens": False, "output_logits": True},
]


@pytest.mark.parametrize("kw", VALID, ids=[repr(k) for k in VALID])
def test_valid_edge_values_are_accepted(kw: dict) -> None:
    p = SamplingParams(**kw)  # type: ignore[arg-type]
    for k, v in kw.items():
        if k == "stop" and isinstance(v, str):
            assert p.stop == (v,)
        elif k in ("stop_token_ids", "stop"):
            assert p.stop_token_ids == tuple(v) if k == "stop_token_ids" else p.stop == tuple(v)  # type: ignore[call-overload]
        else:
            assert getattr(p, k) == v
    # a request can be built from any valid parameters (the seed reaches torch here)
    Request("r", [1, 2, 3], p, max_model_len=64)


def test_defaults() -> None:
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (16, 1.0, 1.0, 0, 0.0)
    assert p.logprobs is None and p.seed is None and p.stop == () and p.stop_token_ids == ()
    assert not p.greedy and not p.needs_penalties


def test_list_arguments_are_copied() -> None:
    ids = [1, 2]
    p = SamplingParams(stop_token_ids=ids)  # type: ignore[arg-type]
    ids.append(3)
    assert p.stop_token_ids == (1, 2)
    bias = {1: 2.0}
    q = SamplingParams(logit_bias=bias)
    bias[5] = 1.0
    assert q.logit_bias == {1: 2.0} and SamplingParams().logit_bias == {}


@pytest.mark.parametrize(
    ("kw", "greedy"),
    [
        ({"temperature": 0.0}, True),
        ({"temperature": 0}, True),
        ({"temperature": 0.8, "top_k": 1}, True),
        ({"temperature": 0.8}, False),
        ({"temperature": 0.8, "top_k": 2}, False),
        ({"temperature": 1e-6}, False),
    ],
)
def test_greedy_property(kw: dict, greedy: bool) -> None:
    assert SamplingParams(**kw).greedy is greedy


@pytest.mark.parametrize(
    ("kw", "needs"),
    [
        ({}, False),
        ({"presence_penalty": 0.1}, True),
        ({"frequency_penalty": -0.1}, True),
        ({"repetition_penalty": 1.01}, True),
        ({"repetition_penalty": 1.0, "presence_penalty": 0.0}, False),
    ],
)
def test_needs_penalties_property(kw: dict, needs: bool) -> None:
    assert SamplingParams(**kw).needs_penalties is needs


def test_request_caps_max_tokens_to_the_context_window() -> None:
    p = SamplingParams(max_tokens=100)
    assert Request("a", [1] * 10, p, max_model_len=50).max_tokens == 40
    assert Request("b", [1] * 10, SamplingParams(max_tokens=5), max_model_len=50).max_tokens == 5
    unbounded = SamplingParams(max_tokens=None)
    assert Request("c", [1] * 10, unbounded, max_model_len=50).max_tokens == 40


def test_request_stop_ids_include_eos_unless_ignored() -> None:
    p = SamplingParams(stop_token_ids=[3])
    assert Request("a", [1], p, eos_token_ids=(2,), max_model_len=9).stop_ids == {2, 3}
    p = SamplingParams(stop_token_ids=[3], ignore_eos=True)
    assert Request("a", [1], p, eos_token_ids=(2,), max_model_len=9).stop_ids == {3}
