"""Bad input raises a clear exception, allocates nothing, and the engine keeps serving."""

from __future__ import annotations

import pytest

from engine import LLM, DuplicateRequestError, NewRequest, SamplingParams


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", num_blocks=40, max_model_len=400)


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _baseline(llm: LLM) -> list[int]:
    return llm.generate([[504, 3575, 282, 4649, 314]], GREEDY)[0].token_ids


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ([], "prompt is empty"),
        ("", "prompt is empty"),
        ([1] * 400, "context window is 400"),
        ([1] * 2000, "context window is 400"),
        ([-1, 5], r"token ids must be integers in \[0, 49152\)"),
        ([49152], r"token ids must be integers in \[0, 49152\)"),
        ([5, 1.0], r"token ids must be integers in \[0, 49152\)"),
        ([5, "6"], r"token ids must be integers in \[0, 49152\)"),
    ],
)
def test_bad_prompt_rejected(llm: LLM, prompt: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate([[7, 8, 9], prompt], GREEDY)  # type: ignore[list-item]
    assert llm.engine.is_idle() and not llm.engine.check_invariants()


def test_prompt_larger_than_pool() -> None:
    small = LLM(dtype="float32", num_blocks=6, max_model_len=4096, enable_prefix_caching=False)
    # the context window is capped to the pool, so the pool is what the error names
    assert small.engine.max_model_len == 5 * 16
    with pytest.raises(ValueError, match="context window is 80"):
        small.generate([[5] * 100], GREEDY)
    assert small.engine.is_idle()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1},
        {"top_p": -0.1},
        {"top_p": 1.5},
        {"top_k": -2},
        {"min_p": 2},
        {"max_tokens": 0},
        {"presence_penalty": 3},
        {"repetition_penalty": 0},
        {"logprobs": 21},
        {"temperature": float("nan")},
        {"stop_token_ids": [-3]},
    ],
)
def test_invalid_sampling_params(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):  # the message names the field
        SamplingParams(**kwargs)


def test_stop_token_outside_vocab(llm: LLM) -> None:
    with pytest.raises(ValueError, match="stop_token_ids outside the vocabulary"):
        llm.generate([[1, 2]], SamplingParams(stop_token_ids=[10**6]))


def test_abort_unknown_request(llm: LLM) -> None:
    with pytest.raises(KeyError, match="unknown request id 'nope'"):
        llm.engine.abort_request("nope")


def test_duplicate_request_id(llm: LLM) -> None:
    llm.engine.submit(NewRequest("dup", [1, 2, 3], GREEDY))
    with pytest.raises(DuplicateRequestError, match="already in use"):
        llm.engine.submit(NewRequest("dup", [4, 5], GREEDY))
    with pytest.raises(DuplicateRequestError):  # also while waiting for a remote prefill
        llm.engine.submit(NewRequest("dup", [4, 5], GREEDY), remote_min_uncached=1)
    llm.engine.abort_request("dup")
    assert llm.engine.is_idle()


def test_engine_keeps_serving_during_bad_input(llm: LLM) -> None:
    """A request in flight is unaffected by rejected ones arriving mid-generation."""
    expected = _baseline(llm)
    core = llm.engine
    tokens: list[int] = []

    def step() -> None:
        for out in core.step():
            if out.request_id == "good":
                tokens.extend(out.new_token_ids)

    core.submit(NewRequest("good", [504, 3575, 282, 4649, 314], GREEDY))
    step()
    for bad in ([], [1] * 5000, [99999]):
        with pytest.raises(ValueError):
            core.submit(NewRequest("bad", bad, GREEDY))
    with pytest.raises(KeyError):
        core.abort_request("bad")
    core.submit(NewRequest("other", [1, 2, 3], GREEDY))
    step()
    core.abort_request("other")
    while core.has_unfinished_requests():
        step()
    assert tokens == expected
    assert core.is_idle() and not core.check_invariants()
