"""Mixture-of-experts: the router's choice, and every chosen expert's rows as one GEMM.

    weights, ids = route(router_logits, top_k, renormalize)
    out = grouped_experts(x, w13, w2, weights, ids)

`route` is the softmax router of Mixtral and Qwen3-MoE: the probabilities over all
experts in fp32, each token's `top_k` most probable, renormalized to sum to 1 when the
family does. `grouped_experts` runs, for each token and each of its experts e,
``down_e(silu(gate_e(x)) * up_e(x))`` weighted by the router, and sums a token's
experts. Stacked weights: w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I].

The (token, expert) pairs are sorted by expert, and the experts that received any are
run together: their rows gathered into one [A, M, H] batch (A active experts, M the
most rows any of them got, the others' padding zero), then two batched GEMMs
(`torch.bmm`), so a step costs two GEMM calls whatever the number of experts, not a
Python loop over them. The active experts' weights are gathered for the GEMMs (a copy;
none when every expert is active): this is the torch path every device runs until
the grouped kernels that read each expert in place exist. Each pair's output row goes back to its token weighted by its
router probability, summed in fp32 when the activations are narrower.
"""

from __future__ import annotations

import torch

from kernels import reference


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k] int64) from router logits [T, E]."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """[T, H]: the router-weighted sum of each token's experts (see the module)."""
    t, h = x.shape
    k = ids.shape[1]
    if t == 0:
        return x.new_zeros(0, h)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, tokens in order
    expert = flat[order]
    token = order // k
    active, counts = torch.unique_consecutive(expert, return_counts=True)
    group = torch.repeat_interleave(torch.arange(len(active), device=x.device), counts)
    starts = torch.cumsum(counts, 0) - counts
    row = torch.arange(len(order), device=x.device) - starts[group]
    rows = x.new_zeros(len(active), int(counts.max()), h)
    rows[group, row] = x[token]
    if len(active) < w13.shape[0]:  # the active experts' weights, gathered
        w13, w2 = w13[active], w2[active]
    gate_up = torch.bmm(rows, w13.transpose(1, 2))
    act = reference.silu_and_mul(gate_up)
    down = torch.bmm(act, w2.transpose(1, 2))
    acc = torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype
    pair_out = down[group, row].to(acc) * weights.reshape(-1)[order, None].to(acc)
    out = torch.zeros(t, h, dtype=acc, device=x.device).index_add_(0, token, pair_out)
    return out.to(x.dtype)
