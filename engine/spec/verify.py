"""Which drafted tokens the target model accepts: greedy, or the rejection rule that
leaves the sampled distribution exactly the target's.

One verification pass gives the target's distributions p_0..p_k at the k drafted
positions and one past them. Draft token x_i is accepted with probability
min(1, p_i(x_i) / q_i(x_i)), q_i being the draft's distribution; at the first
rejection a token is drawn from the residual norm(max(0, p_i - q_i)) and the step
ends; if all k are accepted a bonus token is drawn from p_k. Each emitted token then
has exactly the target's distribution given the tokens before it (Leviathan et al.,
2023; Chen et al., 2023). A prompt-lookup draft is a point mass (q_i(x_i) = 1): x_i
is accepted with probability p_i(x_i) and the residual is p_i without x_i.

Greedy verification is the same rule at temperature 0: the draft's prefix that
agrees with the target's argmax, then the target's own token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def accept_greedy(draft: Sequence[int], target_argmax: Sequence[int]) -> list[int]:
    """Emitted tokens: the drafted ones the target's argmax agrees with, then the
    target's token at the first disagreement (or after the last draft token).
    `target_argmax` has len(draft) + 1 entries."""
    if len(target_argmax) != len(draft) + 1:
        raise ValueError(f"{len(target_argmax)} target tokens for {len(draft)} drafted")
    out = []
    for d, t in zip(draft, target_argmax):
        out.append(int(t))
        if d != t:
            return out
    out.append(int(target_argmax[-1]))
    return out


def accept_sampled(
    draft: Sequence[int],
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Emitted tokens under the rejection rule. `target_probs` [k + 1, V]: the target's
    (already temperature/top-p shaped) distributions at the k drafted positions and
    one past them; `draft_probs` [k, V] the draft's, or None for a point-mass draft
    (prompt lookup)."""
    k = len(draft)
    if target_probs.dim() != 2 or target_probs.shape[0] != k + 1:
        raise ValueError(f"target_probs must be [{k + 1}, V], got {tuple(target_probs.shape)}")
    if draft_probs is not None and draft_probs.shape != (k, target_probs.shape[1]):
        raise ValueError(f"draft_probs must be [{k}, V], got {tuple(draft_probs.shape)}")
    p = target_probs.double()
    ids = torch.tensor(list(draft), dtype=torch.long, device=p.device)
    p_x = p[torch.arange(k, device=p.device), ids]
    if draft_probs is None:
        ratio = p_x
    else:
        q = draft_probs.double()
        q_x = q[torch.arange(k, device=p.device), ids]
        ratio = torch.where(q_x > 0, p_x / q_x.clamp_min(1e-300), torch.ones_like(p_x))
    u = torch.rand(k, dtype=torch.float64, generator=generator, device=p.device)
    rejected = (u >= ratio.clamp(max=1.0)).nonzero()
    if len(rejected) == 0:
        bonus = torch.multinomial(p[k], 1, generator=generator)
        return [*map(int, draft), int(bonus)]
    j = int(rejected[0])
    if draft_probs is None:
        residual = p[j].clone()
        residual[ids[j]] = 0.0
    else:
        residual = (p[j] - draft_probs[j].double()).clamp_min(0.0)
    if float(residual.sum()) <= 0.0:  # p == q there: any draw from p is exact
        residual = p[j]
    token = torch.multinomial(residual, 1, generator=generator)
    return [*map(int, draft[:j]), int(token)]
