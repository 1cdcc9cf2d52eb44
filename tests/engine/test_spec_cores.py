"""The speculative-decoding cores: prompt-lookup drafting (engine/spec/ngram.py) and
verification (engine/spec/verify.py), whose sampled rule must leave the output
distribution exactly the target model's (checked on a toy Markov chain)."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine.spec import ngram, verify


def test_the_longest_suffix_that_occurred_before_picks_the_draft() -> None:
    ctx = [1, 2, 3, 4, 5, 9, 3, 4, 7, 8, 2, 3, 4]
    # "2 3 4" occurred at 1..3 (then 5 9 ...); "3 4" more recently at 6..7 (then 7 8)
    assert ngram.propose(ctx, 3) == [5, 9, 3]
    assert ngram.propose(ctx, 3, max_n=2) == [7, 8, 2]  # shorter suffix: most recent
    assert ngram.propose(ctx, 2, min_n=4) == []  # "4 2 3 4"... never occurred


def test_drafts_stop_at_the_end_of_the_context_and_need_a_match() -> None:
    assert ngram.propose([5, 6, 5], 4) == [6, 5]
    assert ngram.propose([1, 2, 3], 4) == []
    assert ngram.propose([7, 7, 7, 7], 3) == [7]  # the latest earlier "7 7 7" is at 0
    assert ngram.propose([1], 3) == [] and ngram.propose([], 3) == []
    assert ngram.propose([5, 6, 5], 0) == []


def test_greedy_keeps_the_agreeing_prefix_then_the_targets_token() -> None:
    assert verify.accept_greedy([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all + bonus
    assert verify.accept_greedy([4, 5, 6], [4, 9, 6, 7]) == [4, 9]
    assert verify.accept_greedy([4, 5, 6], [1, 5, 6, 7]) == [1]
    assert verify.accept_greedy([], [3]) == [3]
    with pytest.raises(ValueError, match="3 target tokens for 3 drafted"):
        verify.accept_greedy([4, 5, 6], [4, 5, 6])


V = 4


def _chain(seed: int) -> torch.Tensor:
    """A random Markov chain over V tokens: row c is p(next | c)."""
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(V, V, generator=g) * 1.5, dim=-1).double()


def _chi_square(counts: dict[tuple[int, ...], int], probs: dict[tuple[int, ...], float]) -> float:
    n = sum(counts.values())
    return sum((counts.get(c, 0) - n * p) ** 2 / (n * p) for c, p in probs.items())


@pytest.mark.parametrize(("draft_kind", "k"), [("model", 2), ("model", 3), ("lookup", 2)])
def test_sampled_verification_keeps_the_target_distribution(draft_kind: str, k: int) -> None:
    """Speculative steps from token 0 until two tokens are out: their joint
    frequency must be p(a | 0) p(b | a), whatever the draft proposed."""
    target, drafter = _chain(1), _chain(2)
    g = torch.Generator().manual_seed(3)
    counts: dict[tuple[int, ...], int] = {}
    trials = 20000
    for _ in range(trials):
        out: list[int] = []
        ctx = 0
        while len(out) < 2:
            draft, q_rows, prev = [], [], ctx
            for _ in range(k):
                if draft_kind == "model":
                    q = drafter[prev]
                    x = int(torch.multinomial(q, 1, generator=g))
                    q_rows.append(q)
                else:  # a deterministic (point-mass) draft, as prompt lookup makes
                    x = (prev + 1) % V
                draft.append(x)
                prev = x
            p_rows = torch.stack([target[c] for c in [ctx, *draft]])
            qs = torch.stack(q_rows) if q_rows else None
            emitted = verify.accept_sampled(draft, p_rows, qs, g)
            out += emitted
            ctx = emitted[-1]
        key = tuple(out[:2])
        counts[key] = counts.get(key, 0) + 1
    pairs = itertools.product(range(V), repeat=2)
    probs = {(a, b): float(target[0, a] * target[a, b]) for a, b in pairs}
    # 15 degrees of freedom: 37.7 is the 0.001 quantile's bound (the seed is fixed)
    assert _chi_square(counts, probs) < 37.7, counts


def test_sampled_verification_checks_shapes() -> None:
    p = torch.full((3, V), 1 / V)
    with pytest.raises(ValueError, match=r"target_probs must be \[2, V\]"):
        verify.accept_sampled([1], p)
    with pytest.raises(ValueError, match=r"draft_probs must be \[2, V\]"):
        verify.accept_sampled([1, 2], p, torch.full((1, V), 1 / V))
