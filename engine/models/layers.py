"""Building blocks of the Llama family: RMSNorm and rotary position embedding."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kernels import ops
from kernels.cpu_ops import PackedWeight
from kernels.quant import ROWS, QuantTensor, cat_rows


class Linear(nn.Linear):
    """nn.Linear whose matmul goes through `kernels.ops.linear` (GEMV kernel at decode).

    `packed` is an optional second copy of the weight laid out for batched decode (see
    `LlamaForCausalLM.prepack_weights`); it is not a parameter and never saved.

    `quant` holds the weight kept quantized instead (`set_quant`): one tensor per run of
    rows sharing a layout (a fused q/k/v of Q4_K and Q6_K parts has two).
    """

    packed: PackedWeight | None = None
    quant: tuple[QuantTensor, ...] = ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x)

    def run(self, x: torch.Tensor, fp32_out: bool = False) -> torch.Tensor:
        """forward, optionally returning fp32 sums (the head's logits)."""
        if self.quant:
            if len(self.quant) == 1:
                return ops.quant_linear(x, self.quant[0], self.bias, fp32_out)
            out = torch.cat([ops.quant_linear(x, q, None, fp32_out) for q in self.quant], -1)
            return out if self.bias is None else out + self.bias
        return ops.linear(x, self.weight, self.bias, self.packed, fp32_out)

    def set_quant(self, parts: list[QuantTensor]) -> None:
        """Keep the weight as `parts` (stacked rows, in order) and drop the dense one."""
        if sum(p.shape[0] for p in parts) != self.out_features or any(
            p.shape[1] != self.in_features for p in parts
        ):
            raise ValueError(f"quantized parts do not make a {self.out_features}x"
                             f"{self.in_features} weight")  # fmt: skip
        runs: list[list[QuantTensor]] = []
        for p in parts:
            last = runs[-1] if runs else None
            if last and last[0].layout_key == p.layout_key and last[-1].shape[0] % ROWS == 0:
                last.append(p)
            else:
                runs.append([p])
        self.quant = tuple(cat_rows(r) if len(r) > 1 else r[0] for r in runs)
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)
        self.packed = None


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back, as the HF reference does.

    `forward(x, residual)` fuses the residual add: it returns (norm(x + residual),
    x + residual), so a decoder layer carries the residual stream without extra ops.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize over the last dim, any leading shape."""
        flat = x.reshape(-1, x.shape[-1])
        return ops.rms_norm(flat, None, self.weight, self.eps)[0].view(x.shape)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None = None
) -> torch.Tensor:
    """Inverse frequencies of rotary embedding, with llama3/linear scaling. Computed on
    the CPU whatever device a model is built under: on the meta device these ops run
    torch's Python decompositions, whose import cost seconds of every start."""
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu")
    inv = 1.0 / (theta ** (steps.float() / head_dim))
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv / factor
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling {kind!r}")


class RotaryEmbedding:
    """Half-split (HF/NeoX) rotary embedding; cos/sin computed once per step."""

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: dict[str, Any] | None,
        device: torch.device | None = None,
    ) -> None:
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling).to(device)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 [T, d/2] tables for `kernels.ops.rotary_`."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos(), freqs.sin()
