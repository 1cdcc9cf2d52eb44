"""LoRA deltas of a mixed batch: every row adds its own adapter's B(A x) to a linear's
output, whatever adapter (or none) the other rows of the step use.

    lora_add_(out, x, a, b, slots, bounds)

One linear's adapters live in device slots (`engine.lora.slots`), stacked:

    a [S, J*R, K]   slot s's A matrices of the linear's J output slices (a fused q/k/v
                    has three, gate/up two, o and down one), each padded to R rows
    b [S, R, N]     slot s's B matrices, transposed (rank-major) and scaled by
                    alpha / r: columns bounds[j]..bounds[j+1] belong to slice j and
                    read its R rank values
    slots [T]       the slot of each row of x, -1 for a row of the base model

For each row t with s = slots[t] >= 0: v = a[s] @ x[t] (J*R values, fp32), then
out[t, n] += sum_r b[s, r, n] * v[j(n) * R + r], the sums in fp32 and the result
rounded once to out's dtype. Padded rank rows are zero, so a rank-8 adapter in a rank-16
stack adds nothing for them.

One call serves a batch of any mix of adapters, never a loop over adapters: on CPU
`diptych_cpu::lora_add_` (csrc/lora_cpu.cpp: the rows grouped by slot in small tiles
that share their slot's weight reads, SGMV-like), on the Triton path a shrink and an
expand kernel (`kernels/triton/lora.py`: each row gathers its slot's weights,
Punica's BGMV). `lora_add_reference` is the
torch definition they are tested against (grouped by slot, a loop over the step's
adapters: a reference, not a hot path).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch


def check(
    out: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
    bounds: Sequence[int],
) -> int:
    """Validate the arguments of `lora_add_`; return R (the padded rank)."""
    if x.dim() != 2 or out.dim() != 2 or out.shape[0] != x.shape[0]:
        raise ValueError(f"lora: x [T, K] and out [T, N], got {tuple(x.shape)}, {tuple(out.shape)}")
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[2] != x.shape[1]:
        raise ValueError(f"lora: a [S, J*R, K] and b [S, R, N], got {tuple(a.shape)}, "
                         f"{tuple(b.shape)} for K={x.shape[1]}")  # fmt: skip
    rank, n = int(b.shape[1]), int(b.shape[2])
    j = len(bounds) - 1
    if j < 1 or bounds[0] != 0 or bounds[-1] != n or list(bounds) != sorted(bounds):
        raise ValueError(f"lora: bounds must rise from 0 to N={n}, got {list(bounds)}")
    if a.shape[1] != j * rank or out.shape[1] != n:
        raise ValueError(f"lora: a holds {a.shape[1]} rank rows for {j} slices of rank {rank}")
    if slots.dim() != 1 or slots.shape[0] != x.shape[0] or slots.dtype not in (
        torch.int32, torch.int64
    ):  # fmt: skip
        raise ValueError("lora: slots must be int32/int64 [T]")
    if x.dtype != a.dtype or a.dtype != b.dtype:
        raise ValueError(f"lora: x, a and b must share a dtype ({x.dtype}, {a.dtype}, {b.dtype})")
    return rank


def lora_add_reference(
    out: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
    bounds: Sequence[int],
) -> torch.Tensor:
    """`out` with every adapter row's delta added (in place; see the module)."""
    rank = check(out, x, a, b, slots, bounds)
    if not x.shape[0]:
        return out
    for s in torch.unique(slots).tolist():
        if s < 0:
            continue
        rows = (slots == s).nonzero().squeeze(1)
        v = x[rows].float() @ a[s].float().t()  # [m, J*R]
        delta = torch.empty(rows.numel(), out.shape[1], dtype=torch.float32, device=x.device)
        for j, (lo, hi) in enumerate(itertools.pairwise(bounds)):
            delta[:, lo:hi] = v[:, j * rank : (j + 1) * rank] @ b[s, :, lo:hi].float()
        out[rows] = (out[rows].float() + delta).to(out.dtype)
    return out
