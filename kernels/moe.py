"""Mixture-of-experts: the router's choice, and every chosen expert's rows as one GEMM.

    weights, ids = route(router_logits, top_k, renormalize)
    out = grouped_experts(x, w13, w2, weights, ids)

`route` is the softmax router of Mixtral and Qwen3-MoE: the probabilities over all
experts in fp32, each token's `top_k` most probable, renormalized to sum to 1 when the
family does. `route_grouped` is DeepSeek-V3's: sigmoid scores, a bias that steers the
choice only, the top `top_k` of the experts in the best `topk_group` of `n_group`
groups, renormalized and scaled. `grouped_experts` runs, for each token and each of its experts e,
``down_e(silu(gate_e(x)) * up_e(x))`` weighted by the router, and sums a token's
experts. Stacked weights: w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I].

The (token, expert) pairs are sorted by expert and run as two grouped GEMMs (each
expert's rows against its own weights, read in place: on CPU our `grouped_linear`,
which streams each active expert's weight through the C++ GEMV at a decode step's
few rows, 1.4-2x torch's grouped GEMM on a Qwen3-30B-A3B layer here; torch's
`_grouped_mm` on CUDA sm_90 in bf16), so a step costs two calls whatever the number
of experts, not a Python loop over them. Where torch has no grouped GEMM the active
experts run as two batched GEMMs instead: their rows padded to the longest group,
their weights gathered (a copy). Each pair's output row goes back to its token
weighted by its router probability, summed in fp32 when the activations are narrower.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import cpu_ops, reference
from kernels.quant import QuantTensor


@dataclass(frozen=True)
class Fp8Experts:
    """A layer's experts' weights kept FP8 (an FP8 checkpoint's, or `--quantization
    fp8`): every expert's `kernels.quant` f8 tensor of one shape stacked, codes
    [E, N/8, K/G, G/4, 8, 4] and scales [E, N/8, K/G, 8]; (n, k) one expert's."""

    codes: torch.Tensor
    scales: torch.Tensor
    shape: tuple[int, int]
    group: int

    @classmethod
    def stack(cls, experts: list[QuantTensor]) -> Fp8Experts:
        first = experts[0]
        if any(e.kind != "f8" or e.layout_key != first.layout_key or e.shape != first.shape
               for e in experts):  # fmt: skip
            raise ValueError("FP8 experts stack only in one shape and layout")
        return cls(torch.stack([e.codes for e in experts]),
                   torch.stack([e.scales for e in experts]), first.shape, first.group)  # fmt: skip

    @property
    def num_experts(self) -> int:
        return int(self.codes.shape[0])

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * self.scales.element_size()

    def expert(self, e: int) -> QuantTensor:
        return QuantTensor("f8", "fp8", self.shape, self.codes[e], self.scales[e], None,
                           self.group)  # fmt: skip


Weights = torch.Tensor | Fp8Experts  # stacked [E, N, K], or kept FP8


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k] int64) from router logits [T, E]."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route_grouped(
    router_logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's router (`noaux_tc`): (weights [T, k] fp32, ids [T, k] int64) from
    router logits [T, E] and the choice bias [E]. A group's score is the sum of its two
    best biased scores; experts outside the `topk_group` best groups cannot be chosen;
    a chosen expert's weight is its unbiased sigmoid score."""
    scores = torch.sigmoid(router_logits.float())
    biased = scores + bias.float()
    t, e = biased.shape
    groups = biased.view(t, n_group, e // n_group)
    group_score = groups.topk(min(2, e // n_group), dim=-1).values.sum(-1)
    best = group_score.topk(topk_group, dim=-1).indices
    keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
    allowed = keep[:, :, None].expand_as(groups).reshape(t, e)
    ids = biased.masked_fill(~allowed, float("-inf")).topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids


def grouped_experts(
    x: torch.Tensor,
    w13: Weights,
    w2: Weights,
    weights: torch.Tensor,
    ids: torch.Tensor,
    first: int = 0,
    cpp: bool = True,
    expert_linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """[T, H]: the router-weighted sum of each token's experts (see the module). The
    weights may hold only experts `first`.. `first + E - 1` (an expert-parallel rank's):
    pairs routed to other experts are left out (another rank adds them). `cpp`: the C++
    grouped kernels may run (the kernel selection's say, `kernels.ops`).
    `expert_linear(rows, w)`: run each expert's rows through it instead of a grouped
    kernel (`--deterministic`: one whose rows sum alike however many an expert gets)."""
    experts = w13.num_experts if isinstance(w13, Fp8Experts) else w13.shape[0]
    pairs = sorted_pairs(ids, experts, first)
    if pairs is None:
        return x.new_zeros(x.shape)
    order, token, counts = pairs
    rows = x[token]
    if expert_linear is not None:
        if not isinstance(w13, torch.Tensor) or not isinstance(w2, torch.Tensor):
            raise TypeError("expert_linear runs dense experts")
        gate_up = each_expert(rows, w13, counts, expert_linear)
        down = each_expert(reference.silu_and_mul(gate_up), w2, counts, expert_linear)
        return combine_in_slot_order(x, down, weights, order)
    if isinstance(w13, Fp8Experts) and isinstance(w2, Fp8Experts):
        gate_up = fp8_grouped(rows, w13, counts, cpp)
        down = fp8_grouped(reference.silu_and_mul(gate_up), w2, counts, cpp)
    elif isinstance(w13, Fp8Experts) or isinstance(w2, Fp8Experts):
        raise TypeError("a layer's experts are FP8 in both stacks or in neither")
    elif cpp and _cpp_grouped_runs(x, w13, w2):  # CPU: our GEMV at a decode step's rows
        ends = torch.cumsum(counts, 0)
        gate_up = torch.ops.diptych_cpu.grouped_linear(rows, w13, ends)
        down = torch.ops.diptych_cpu.grouped_linear(reference.silu_and_mul(gate_up), w2, ends)
    elif _grouped_mm_runs(x):
        offs = torch.cumsum(counts, 0).to(torch.int32)
        gate_up = torch._grouped_mm(rows, w13.transpose(1, 2), offs=offs)
        down = torch._grouped_mm(reference.silu_and_mul(gate_up), w2.transpose(1, 2), offs=offs)
    else:
        down = _padded(rows, w13, w2, counts)
    return combine(x, down, weights, order, token)


def each_expert(
    rows: torch.Tensor,
    w: torch.Tensor,
    counts: torch.Tensor,
    linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """rows [P, K] sorted by expert (`counts` of each) @ each one's weight^T, an expert
    at a time through `linear`."""
    out = rows.new_empty(rows.shape[0], w.shape[1])
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            out[start : start + n] = linear(rows[start : start + n], w[e])
        start += n
    return out


def fp8_grouped(
    rows: torch.Tensor, w: Fp8Experts, counts: torch.Tensor, cpp: bool = True
) -> torch.Tensor:
    """rows [P, K] sorted by expert (`counts` of each) @ each one's FP8 weight^T: the C++
    grouped kernel on CPU (it reads each active expert's codes once, widening them in
    registers), else each active expert's weight dequantized in turn."""
    ends = torch.cumsum(counts, 0)
    if cpp and rows.device.type == "cpu" and rows.stride(-1) == 1 and cpu_ops.cpu_ops_available():
        out: torch.Tensor = torch.ops.diptych_cpu.fp8_grouped_linear(
            rows, w.codes, w.scales, ends.cpu(), w.group, w.shape[0]
        )
        return out
    out = rows.new_empty(rows.shape[0], w.shape[0])
    start = 0
    for e, end in enumerate(ends.tolist()):
        if end > start:
            out[start:end] = rows[start:end] @ w.expert(e).dequantize(rows.dtype).T
        start = end
    return out


def sorted_pairs(
    ids: torch.Tensor, experts: int, first: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The (token, expert) pairs routed to experts `first`.. `first + experts - 1`,
    grouped by expert: (their indices into ids.flatten(), their tokens, the pairs of
    each expert), or None if there are none."""
    k = ids.shape[1]
    flat = ids.reshape(-1) - first
    pairs = torch.nonzero((flat >= 0) & (flat < experts)).flatten()
    if len(pairs) == 0:
        return None
    order = pairs[torch.argsort(flat[pairs], stable=True)]
    return order, order // k, torch.bincount(flat[order], minlength=experts)


def combine(
    x: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, order: torch.Tensor,
    token: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """[T, H]: each pair's output row (`down`, in sorted order) times its router weight,
    summed into its token's row (in fp32 when the activations are narrower)."""
    acc = torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype
    pair_out = down.to(acc) * weights.reshape(-1)[order, None].to(acc)
    out = torch.zeros(x.shape, dtype=acc, device=x.device).index_add_(0, token, pair_out)
    return out.to(x.dtype)


def combine_in_slot_order(
    x: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, order: torch.Tensor
) -> torch.Tensor:
    """`combine` in a fixed order on any device: a token's k pair outputs (every pair
    routed here: `order` covers them all) times their router weights, added in the
    order of its top-k slots, never by atomics or in an order of the batch's making."""
    t, k = weights.shape
    if order.numel() != t * k:
        raise ValueError("combine_in_slot_order needs every token's k pairs")
    acc = torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype
    pairs = torch.empty((t * k, down.shape[1]), dtype=acc, device=x.device)
    pairs[order] = down.to(acc) * weights.reshape(-1)[order, None].to(acc)
    slots = pairs.view(t, k, -1)
    out = slots[:, 0].clone()
    for j in range(1, k):
        out += slots[:, j]
    return out.to(x.dtype)


def _cpp_grouped_runs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether the C++ grouped linear takes these (CPU tensors, widths the GEMV takes)."""
    return (
        x.device.type == "cpu"
        and w13.shape[2] % 16 == 0
        and w2.shape[2] % 16 == 0
        and x.dtype == w13.dtype
        and cpu_ops.cpu_ops_available()
    )


def _grouped_mm_runs(x: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM takes `x`: on CPU every float dtype; on CUDA bf16
    from sm_90."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cpu":
        return True
    return (
        x.device.type == "cuda"
        and x.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x.device)[0] >= 9
    )


def _padded(
    rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """The grouped GEMMs as two batched ones: the active experts' rows padded to the
    longest group, their weights gathered (a copy, none when all are active)."""
    active = torch.nonzero(counts).flatten()
    sizes = counts[active]
    group = torch.repeat_interleave(torch.arange(len(active), device=rows.device), sizes)
    starts = torch.cumsum(sizes, 0) - sizes
    row = torch.arange(len(rows), device=rows.device) - starts[group]
    batch = rows.new_zeros(len(active), int(sizes.max()), rows.shape[1])
    batch[group, row] = rows
    if len(active) < w13.shape[0]:
        w13, w2 = w13[active], w2[active]
    gate_up = torch.bmm(batch, w13.transpose(1, 2))
    down = torch.bmm(reference.silu_and_mul(gate_up), w2.transpose(1, 2))
    return down[group, row]
