"""Speculative decoding by prompt lookup in the engine: greedy output is the model's own
(fp32: identical to decoding without drafts), steps emit several tokens on repetitive
text, stops and max_tokens land inside accepted drafts exactly, and only greedy
requests draft."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.request import NewRequest

pytestmark = pytest.mark.slow

CODE = (Path(__file__).resolve().parents[2] / "engine" / "spec" / "ngram.py").read_text()[:1200]
ASK = "Repeat this code exactly, renaming `arr` to `ids`:\n\n"
EDIT = [{"role": "user", "content": ASK + CODE}]


def _run(llm: LLM, ids: list[int], **params: object) -> tuple[list[int], str | None, int]:
    """(tokens, finish reason, the most tokens one step emitted)."""
    core = llm.engine
    params.setdefault("temperature", 0)
    core.submit(NewRequest("r", ids, SamplingParams(**params)))  # type: ignore[arg-type]
    tokens: list[int] = []
    most, reason = 0, None
    while core.has_unfinished_requests():
        for o in core.step():
            tokens += o.new_token_ids
            most = max(most, len(o.new_token_ids))
            reason = o.finish_reason
    return tokens, reason, most


def test_drafts_change_the_speed_not_the_tokens(make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(num_speculative_tokens=0)
    spec = llm.engine.scheduler.speculator
    assert spec is not None
    ids = llm.tokenizer.apply_chat_template(EDIT)
    plain, reason, most = _run(llm, ids, max_tokens=96)
    assert most == 1 and spec.steps == 0  # the engine default is off
    fast, fast_reason, most = _run(llm, ids, max_tokens=96, num_speculative_tokens=4)
    assert fast == plain and fast_reason == reason
    assert most > 1 and spec.accepted > 0.5 * spec.drafted  # code quoted back
    steps = spec.steps
    story = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a joke."}])
    assert _run(llm, story, max_tokens=24, num_speculative_tokens=4)[0] == _run(
        llm, story, max_tokens=24
    )[0]
    steps = spec.steps
    logprobs = SamplingParams(temperature=0, max_tokens=24, logprobs=2, num_speculative_tokens=4)
    penalised = SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.2,
                               num_speculative_tokens=4)  # fmt: skip
    llm.generate([ids, ids], [logprobs, penalised])
    assert spec.steps == steps  # drafts would change what these report or pick


def test_sampled_requests_draft_and_stay_reproducible(make_llm: Callable[..., LLM]) -> None:
    """The rejection rule's exactness is tested on a toy chain (test_spec_cores.py);
    here: sampled requests draft, accept some, stop cleanly, and a seed still fixes
    the output."""
    llm = make_llm()
    spec = llm.engine.scheduler.speculator
    assert spec is not None
    ids = llm.tokenizer.apply_chat_template(EDIT)
    first, reason, most = _run(llm, ids, max_tokens=64, num_speculative_tokens=4,
                               temperature=0.3, seed=5)  # fmt: skip
    assert spec.accepted > 0 and most > 1 and len(first) == 64 and reason == "length"
    again, _, _ = _run(llm, ids, max_tokens=64, num_speculative_tokens=4, temperature=0.3, seed=5)
    assert again == first


def test_stops_inside_accepted_drafts(make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(num_speculative_tokens=4)  # now the engine default
    ids = llm.tokenizer.apply_chat_template(EDIT)
    plain, _, _ = _run(llm, ids, max_tokens=60, num_speculative_tokens=0)
    for n in (1, 2, 7, 33):
        got, reason, _ = _run(llm, ids, max_tokens=n)
        assert got == plain[:n] and reason == "length"
    stop = plain[40]  # a token of the quoted code, likely inside a draft
    got, reason, _ = _run(llm, ids, max_tokens=60, stop_token_ids=[stop])
    assert got == plain[: plain.index(stop) + 1] and reason == "stop"


def test_a_batch_mixing_drafts_decodes_and_prefills(make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(num_speculative_tokens=3)
    prompts = [
        llm.tokenizer.apply_chat_template(EDIT),
        llm.tokenizer.encode("The capital of France is"),
        llm.tokenizer.apply_chat_template([{"role": "user", "content": "List five colours."}]),
    ]
    params = [SamplingParams(temperature=0, max_tokens=40, num_speculative_tokens=k)
              for k in (3, 0, 3)]  # fmt: skip
    together = [r.token_ids for r in llm.generate(prompts, params)]
    plain = SamplingParams(temperature=0, max_tokens=40, num_speculative_tokens=0)
    alone = [llm.generate([p], plain)[0].token_ids for p in prompts]
    assert together == alone


def test_bf16_drafts_change_the_speed_not_the_tokens(make_llm: Callable[..., LLM]) -> None:
    """bf16 verify rows run row-invariant linears (`kernels.ops.row_invariant`): where a
    plain step's one row takes the GEMV and a 5-row step a packed GEMM (oneDNN on AMX),
    the sums' order differs and a near-tie of the code edit's would split (measured:
    at token 30 without). No prefix caching: the second run would reuse the first's
    prompt blocks and recompute only the prompt's tail, through other kernels."""
    llm = make_llm(dtype="bfloat16", enable_prefix_caching=False)
    ids = llm.tokenizer.apply_chat_template(EDIT)
    plain = _run(llm, ids, max_tokens=128)[0]
    fast, _, most = _run(llm, ids, max_tokens=128, num_speculative_tokens=4)
    assert fast == plain and most > 1
