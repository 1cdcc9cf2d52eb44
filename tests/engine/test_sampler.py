"""Sampler: greedy, the shape of the sampling distribution, penalties, logprobs, seeds.

Small vocabularies and many rows per call: one batched call of N identical rows draws N
independent samples, so the distribution checks are statistical yet fast and seeded.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import pytest
import torch

from engine.model_runner import Sampler, _apply_penalties, _top_k_top_p
from engine.request import Request
from protocol.sampling import SamplingParams

EOS = 7


def make_req(
    params: SamplingParams | None = None,
    prompt: Sequence[int] = (1, 2),
    output: Sequence[int] = (),
    rid: str = "r",
    **kw: object,
) -> Request:
    params = params or SamplingParams(**kw)  # type: ignore[arg-type]
    r = Request(rid, list(prompt), params, eos_token_ids=(EOS,), max_model_len=1000)
    for t in output:
        r.append_token(t)
    return r


def draw(logits_row: Sequence[float], n: int, seed: int = 0, **kw: object) -> torch.Tensor:
    """n independent draws for one request's logits row: the counts per token."""
    req = make_req(**kw)
    logits = torch.tensor([list(logits_row)] * n, dtype=torch.float32)
    out = Sampler(seed)(logits, [req] * n)
    return torch.bincount(torch.tensor(out.token_ids), minlength=len(logits_row))


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum().item()
    keep = probs > 0
    exp = probs[keep] * n
    return float((((counts[keep] - exp) ** 2) / exp).sum())


# chi-square critical value for df <= 7 at p ~ 1e-6 is about 35; generous on purpose
CHI2_BOUND = 40.0
N = 20_000


# -- greedy ------------------------------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 50, generator=g)
    reqs = [make_req(temperature=0.0, rid=f"g{i}") for i in range(3)] + [
        make_req(top_k=1, temperature=1.3, rid=f"k{i}") for i in range(3)
    ]
    for seed in (0, 1, 2):
        out = Sampler(seed)(logits, reqs)
        assert out.token_ids == logits.argmax(dim=-1).tolist()
        assert out.logprobs == [None] * 6


def test_greedy_rows_stay_greedy_in_a_sampled_batch() -> None:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(8, 30, generator=g)
    reqs = [
        make_req(temperature=0.0) if i % 2 else make_req(temperature=1.5, top_k=5, top_p=0.9)
        for i in range(8)
    ]
    for seed in range(5):
        got = Sampler(seed)(logits, reqs).token_ids
        assert [got[i] for i in range(1, 8, 2)] == logits[1::2].argmax(dim=-1).tolist()


def test_sampler_does_not_modify_the_logits() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 20, generator=g)
    copy = logits.clone()
    reqs = [
        make_req(repetition_penalty=1.5, presence_penalty=1.0, output=[3, 4]),
        make_req(min_tokens=2, temperature=0.8),
        make_req(temperature=0.0, frequency_penalty=0.5, output=[1]),
    ]
    Sampler()(logits, reqs)
    assert torch.equal(logits, copy)


# -- the distribution --------------------------------------------------------------------------

LOGITS = [2.0, 1.0, 0.5, 0.0, -1.0]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_sampling_matches_softmax(temperature: float) -> None:
    counts = draw(LOGITS, N, temperature=temperature)
    probs = torch.softmax(torch.tensor(LOGITS) / temperature, dim=-1)
    assert chi2(counts, probs) < CHI2_BOUND
    # the check has power: the untempered (or wrongly tempered) distribution fails it
    other = torch.softmax(torch.tensor(LOGITS) / (temperature * 1.5), dim=-1)
    assert chi2(counts, other) > 5 * CHI2_BOUND


def test_seeded_rows_follow_the_same_distribution() -> None:
    reqs = [make_req(temperature=1.0, seed=1000 + i, rid=f"s{i}") for i in range(4000)]
    logits = torch.tensor([LOGITS] * len(reqs))
    counts = torch.bincount(torch.tensor(Sampler()(logits, reqs).token_ids), minlength=5)
    assert chi2(counts, torch.softmax(torch.tensor(LOGITS), dim=-1)) < CHI2_BOUND


def renormalized(probs: list[float], keep: set[int]) -> torch.Tensor:
    p = torch.tensor([x if i in keep else 0.0 for i, x in enumerate(probs)])
    return p / p.sum()


@pytest.mark.parametrize("k", [1, 2, 3, 5, 10])
def test_top_k_draws_only_from_the_k_best(k: int) -> None:
    logits = [0.3, 2.0, -1.0, 1.0, 0.5]  # ranked: 1, 3, 4, 0, 2
    ranked = [1, 3, 4, 0, 2]
    counts = draw(logits, N, top_k=k)
    keep = set(ranked[:k])
    assert {i for i, c in enumerate(counts.tolist()) if c} <= keep
    probs = torch.softmax(torch.tensor(logits), dim=-1).tolist()
    assert chi2(counts, renormalized(probs, keep)) < CHI2_BOUND


PROBS = [0.05, 0.5, 0.15, 0.3]  # ranked: 1 (.5), 3 (.3), 2 (.15), 0 (.05)


@pytest.mark.parametrize(
    ("top_p", "keep"),
    [
        (1e-6, {1}),  # never empty
        (0.45, {1}),
        (0.55, {1, 3}),
        (0.7, {1, 3}),
        (0.9, {1, 3, 2}),
        (0.97, {0, 1, 2, 3}),
        (1.0, {0, 1, 2, 3}),
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_p(top_p: float, keep: set[int]) -> None:
    logits = [math.log(p) for p in PROBS]
    counts = draw(logits, N, top_p=top_p)
    assert {i for i, c in enumerate(counts.tolist()) if c} == keep
    assert chi2(counts, renormalized(PROBS, keep)) < CHI2_BOUND


def test_top_p_exactly_reached_keeps_the_smaller_set() -> None:
    # two equal tokens of probability exactly 0.5: one of them alone reaches top_p=0.5
    counts = draw([0.0, 0.0], N // 4, top_p=0.5)
    assert sorted(counts.tolist()) == [0, N // 4]
    counts = draw([0.0, 0.0], N // 4, top_p=0.51)
    assert (counts > N // 10).all()


@pytest.mark.parametrize(
    ("min_p", "temperature", "keep"),
    [
        (0.05, 1.0, {0, 1, 2, 3}),
        (0.2, 1.0, {1, 2, 3}),  # threshold 0.1
        (0.5, 1.0, {1, 3}),  # threshold 0.25
        (0.7, 1.0, {1}),  # threshold 0.35
        (1.0, 1.0, {1}),
        # after temperature 2 the probs are about .12 .38 .21 .29: threshold .19 drops only 0
        (0.5, 2.0, {1, 2, 3}),
    ],
)
def test_min_p_drops_tokens_below_a_fraction_of_the_best(
    min_p: float, temperature: float, keep: set[int]
) -> None:
    logits = [math.log(p) for p in PROBS]
    counts = draw(logits, N, min_p=min_p, temperature=temperature)
    assert {i for i, c in enumerate(counts.tolist()) if c} == keep
    tempered = torch.softmax(torch.tensor(logits) / temperature, dim=-1).tolist()
    assert chi2(counts, renormalized(tempered, keep)) < CHI2_BOUND


def test_top_k_and_top_p_combine() -> None:
    logits = [math.log(p) for p in PROBS]
    # top_k=3 keeps {1,3,2} renormalized to .526 .316 .158; top_p .8 then keeps {1,3}
    counts = draw(logits, N, top_k=3, top_p=0.8)
    assert {i for i, c in enumerate(counts.tolist()) if c} == {1, 3}
    assert chi2(counts, renormalized(PROBS, {1, 3})) < CHI2_BOUND


def test_top_p_one_is_a_no_op_beside_a_filtered_row() -> None:
    """A row with top_p=1 (filter off) must keep every token even when another row of
    the batch uses top-p: its distribution may not depend on its batch mates."""
    logits = torch.tensor([[20.0, 0.0, -5.0, -10.0]] * 2)
    out = _top_k_top_p(logits, [0, 0], [1.0, 0.5])
    assert torch.equal(out[0], logits[0])
    # same when the row uses top-k only
    out = _top_k_top_p(logits, [3, 0], [1.0, 0.5])
    assert torch.isfinite(out[0]).tolist() == [True, True, True, False]


# -- penalties ---------------------------------------------------------------------------------


def hf_repetition(logits: torch.Tensor, ids: list[int], penalty: float) -> torch.Tensor:
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    proc = RepetitionPenaltyLogitsProcessor(penalty)
    return proc(torch.tensor([ids]), logits[None].clone())[0]


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_is_hf(penalty: float) -> None:
    logits = torch.tensor([1.5, -2.0, 0.0, 3.0, -0.5, 0.7, -3.0, 2.2])
    prompt, output = [0, 1, 1], [4, 5, 1]
    req = make_req(prompt=prompt, output=output, repetition_penalty=penalty)
    got = _apply_penalties(logits[None].clone(), [req])[0]
    want = hf_repetition(logits, prompt + output, penalty)
    assert torch.allclose(got, want)
    # by hand: positive logits divided, negative multiplied, unseen tokens untouched
    seen = set(prompt + output)
    for t in range(8):
        x = logits[t].item()
        expect = (x / penalty if x > 0 else x * penalty) if t in seen else x
        assert got[t].item() == pytest.approx(expect)


def test_repetition_penalty_changes_the_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.5, -1.0, 0.0]])
    assert Sampler()(logits, [make_req(temperature=0.0, prompt=[0])]).token_ids == [0]
    req = make_req(temperature=0.0, prompt=[0], repetition_penalty=1.5)  # 3.0 -> 2.0
    assert Sampler()(logits, [req]).token_ids == [1]
    req = make_req(temperature=0.0, prompt=[3], output=[0], repetition_penalty=1.5)
    assert Sampler()(logits, [req]).token_ids == [1]  # output tokens count too


def test_presence_and_frequency_penalties_are_openai() -> None:
    logits = torch.tensor([1.0, 2.0, -1.0, 0.5, 0.0, 3.0])
    prompt, output = [5, 0], [2, 2, 3, 2]
    for pres, freq in [(0.25, 0.5), (-1.0, 0.0), (0.0, -0.3), (2.0, 2.0)]:
        req = make_req(prompt=prompt, output=output, presence_penalty=pres, frequency_penalty=freq)
        got = _apply_penalties(logits[None].clone(), [req])[0]
        counts = [output.count(t) for t in range(6)]
        want = torch.tensor(
            [logits[t].item() - freq * counts[t] - pres * (counts[t] > 0) for t in range(6)]
        )
        assert torch.allclose(got, want), (pres, freq)
        assert got[5] == logits[5] and got[0] == logits[0]  # prompt tokens are not penalized


def test_penalties_apply_per_row() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0]] * 3)
    reqs = [
        make_req(output=[2], presence_penalty=1.0),
        make_req(output=[2]),  # no penalty: untouched, whatever its neighbours do
        make_req(output=[0, 0], frequency_penalty=1.0),
    ]
    got = _apply_penalties(logits.clone(), reqs)
    assert got.tolist() == [[1.0, 2.0, 2.0], [1.0, 2.0, 3.0], [-1.0, 2.0, 3.0]]


def test_presence_penalty_steers_greedy_away_from_repeats() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.8]])
    req = make_req(temperature=0.0, output=[1], presence_penalty=0.5)
    assert Sampler()(logits, [req]).token_ids == [2]


# -- min_tokens --------------------------------------------------------------------------------


def test_min_tokens_bans_stop_ids_until_reached() -> None:
    logits = torch.tensor([[0.0, 1.0, 5.0, 0.0, 0.0, 0.0, 0.0, 6.0]])  # EOS=7 best, then 2
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2])
    for n_out, expect in [(0, 1), (1, 1), (2, 7)]:
        req = make_req(params, output=[3] * n_out)
        assert Sampler()(logits, [req]).token_ids == [expect], n_out
    # ignore_eos: EOS is not a stop id, so it is not banned, only the listed stop ids are
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2], ignore_eos=True)
    assert Sampler()(logits, [make_req(params)]).token_ids == [7]


def test_min_tokens_ban_holds_under_sampling() -> None:
    counts = draw([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 3.0], N // 4, min_tokens=1)
    assert counts[EOS] == 0
    assert (counts[:EOS] > 0).all()
    counts = draw([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 3.0], N // 4, min_tokens=0)
    assert counts[EOS] > N // 8


# -- logprobs ----------------------------------------------------------------------------------


def test_logprobs_are_of_the_raw_logits() -> None:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(5, 32, generator=g) * 2
    reqs = [
        make_req(temperature=0.7, top_k=5, repetition_penalty=1.7, logprobs=3, output=[1, 2]),
        make_req(temperature=0.0, logprobs=0),
        make_req(temperature=1.0),  # no logprobs
        make_req(temperature=1.3, presence_penalty=2.0, logprobs=20, output=[4, 4]),
        make_req(temperature=0.0, min_tokens=5, logprobs=1, stop_token_ids=[0]),
    ]
    raw = torch.log_softmax(logits, dim=-1)
    for seed in range(10):
        out = Sampler(seed)(logits, reqs)
        for i, (req, tok, lp) in enumerate(zip(reqs, out.token_ids, out.logprobs)):
            n = req.sampling_params.logprobs
            if n is None:
                assert lp is None
                continue
            assert lp is not None and lp.token_id == tok
            assert lp.logprob == pytest.approx(raw[i, tok].item(), abs=1e-5)
            assert lp.rank == 1 + int((raw[i] > raw[i, tok]).sum())
            assert len(lp.top) == n
            vals, idx = raw[i].topk(n) if n else (torch.tensor([]), torch.tensor([]))
            assert [t for t, _ in lp.top] == idx.tolist()
            assert [v for _, v in lp.top] == pytest.approx(vals.tolist(), abs=1e-5)
            assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:]))
    # greedy rank is 1 unless min_tokens banned the argmax
    out = Sampler()(logits, reqs)
    assert out.logprobs[1] is not None and out.logprobs[1].rank == 1
    banned = out.logprobs[4]
    assert banned is not None and banned.token_id not in (0, EOS)


# -- seeds -------------------------------------------------------------------------------------

VOCAB = 16


def _seeded_run(seed: int, steps: int, mates: bool, sampler_seed: int, order_seed: int) -> list:
    """Tokens of a seeded request over `steps` calls, alone or among random batch mates."""
    logits_gen = torch.Generator().manual_seed(99)  # the same logits row at each step
    rng = random.Random(order_seed)
    mates_gen = torch.Generator().manual_seed(order_seed)
    me = make_req(temperature=0.9, seed=seed, presence_penalty=0.3, rid="me")
    sampler = Sampler(sampler_seed)
    got = []
    for _ in range(steps):
        row = torch.randn(VOCAB, generator=logits_gen)
        batch = [me]
        rows = [row]
        if mates:
            for j in range(rng.randrange(0, 6)):
                kind = rng.randrange(4)
                kw: dict = [
                    {"temperature": 0.0},
                    {"temperature": 1.0},
                    {"temperature": 0.5, "top_k": 3, "top_p": 0.8},
                    {"temperature": 1.0, "seed": rng.randrange(100)},
                ][kind]
                batch.append(make_req(rid=f"m{j}", **kw))
                rows.append(torch.randn(VOCAB, generator=mates_gen))
            perm = list(range(len(batch)))
            rng.shuffle(perm)
            batch = [batch[p] for p in perm]
            rows = [rows[p] for p in perm]
        out = sampler(torch.stack(rows), batch)
        tok = out.token_ids[batch.index(me)]
        me.append_token(tok)
        got.append(tok)
    return got


def test_seed_gives_the_same_tokens_whatever_the_batch() -> None:
    alone = _seeded_run(1234, 30, mates=False, sampler_seed=0, order_seed=0)
    for sampler_seed, order_seed in [(1, 1), (2, 7), (3, 42)]:
        assert _seeded_run(1234, 30, True, sampler_seed, order_seed) == alone
    assert len(set(alone)) > 3  # it really sampled


def test_different_seeds_give_different_tokens() -> None:
    runs = {s: _seeded_run(s, 30, mates=False, sampler_seed=0, order_seed=0) for s in range(4)}
    assert len({tuple(r) for r in runs.values()}) == 4


def test_unseeded_rows_follow_the_sampler_seed() -> None:
    logits = torch.zeros(64, VOCAB)
    reqs = [make_req(temperature=1.0)] * 64
    a = Sampler(5)(logits, reqs).token_ids
    assert Sampler(5)(logits, reqs).token_ids == a
    assert Sampler(6)(logits, reqs).token_ids != a


@pytest.mark.gpu
def test_sampling_on_cuda_logits() -> None:
    """Seeded and unseeded sampling must work on device logits (the runner's are)."""
    logits = torch.randn(4, 100, device="cuda")
    reqs = [
        make_req(temperature=0.8, seed=1, rid="a"),
        make_req(temperature=0.8, rid="b"),
        make_req(temperature=0.0, repetition_penalty=1.2, output=[3], rid="c"),
        make_req(temperature=1.0, top_p=0.9, top_k=10, min_p=0.05, logprobs=2, rid="d"),
    ]
    out = Sampler()(logits, reqs)
    assert len(out.token_ids) == 4 and all(0 <= t < 100 for t in out.token_ids)
    again = Sampler(7)(logits, [make_req(temperature=0.8, seed=1, rid="a")])
    assert again.token_ids[0] == out.token_ids[0]


# -- through the engine ------------------------------------------------------------------------


@pytest.mark.slow
def test_seeded_request_through_the_engine(make_llm) -> None:  # type: ignore[no-untyped-def]
    """The runner reorders rows (decodes first) and preemption recomputes: a seeded
    request's tokens must not care. A 3-block pool forces preemption in the batch."""
    llm = make_llm(num_blocks=4, block_size=16)
    prompt = "Once upon a time, in a small village by the sea,"
    seeded = SamplingParams(temperature=1.0, seed=77, max_tokens=6)
    alone = llm.generate(prompt, seeded)[0].token_ids
    mates = [
        ("The capital of France is a city called", SamplingParams(temperature=0.0, max_tokens=6)),
        (prompt, seeded),
        ("def fibonacci(n):\n    if n < 2:", SamplingParams(temperature=0.8, max_tokens=6)),
    ]
    results = llm.generate([p for p, _ in mates], [s for _, s in mates])
    assert llm.engine.scheduler.num_preemptions > 0
    assert results[1].token_ids == alone


# -- typical sampling ---------------------------------------------------------------------------


@pytest.mark.parametrize("mass", [0.1, 0.5, 0.9, 0.999])
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_typical_p_keeps_what_hfs_typical_warper_keeps(mass: float, temperature: float) -> None:
    """The distribution drawn from is HF's TypicalLogitsWarper's, row by row, beside a
    request that does not ask for it (left whole) and a greedy one."""
    from transformers.generation.logits_process import TypicalLogitsWarper

    from engine.model_runner import shaped

    gen = torch.Generator().manual_seed(int(mass * 1000))
    logits = torch.randn(3, 50, generator=gen) * 3
    params = [SamplingParams(typical_p=mass, temperature=temperature), SamplingParams(),
              SamplingParams(typical_p=mass, temperature=0)]  # fmt: skip
    _, probs = shaped(logits.clone(), params, [False, False, True])
    want = torch.softmax(TypicalLogitsWarper(mass)(None, logits[:1] / temperature), dim=-1)[0]
    assert torch.allclose(probs[0], want, atol=1e-6)
    assert 1 <= int((probs[0] > 0).sum()) < 50 or mass > 0.99
    assert torch.allclose(probs[1], torch.softmax(logits[1], dim=-1))  # typical_p = 1
    assert int((probs[2] > 0).sum()) == 50  # a greedy row is not filtered


def test_typical_p_draws_follow_the_kept_distribution() -> None:
    logits = [math.log(p) for p in PROBS]  # entropy 1.14 nats: surprises .05 -> 1.86 off
    counts = draw(logits, N, typical_p=0.5)
    kept = {i for i, c in enumerate(counts.tolist()) if c}
    from transformers.generation.logits_process import TypicalLogitsWarper

    want = torch.softmax(TypicalLogitsWarper(0.5)(None, torch.tensor([logits]))[0], dim=-1)
    assert kept == {i for i, p in enumerate(want.tolist()) if p > 0}
    assert chi2(counts, want) < CHI2_BOUND
