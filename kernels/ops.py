"""The kernels the engine calls, dispatched by device.

CPU tensors use the C++ ops of `kernels.cpu_ops` when they build, CUDA tensors the
Triton kernels once registered, and anything else the torch references of
`kernels.reference`. `DIPTYCH_KERNELS=torch` forces the references everywhere
(`set_backend("torch")` does the same in-process).
"""

from __future__ import annotations

import os

import torch

from kernels import cpu_ops, reference

_forced: str | None = os.environ.get("DIPTYCH_KERNELS") or None


def set_backend(name: str | None) -> None:
    """Force "torch" (references) or go back to automatic dispatch with None/"auto"."""
    global _forced
    if name not in (None, "auto", "torch"):
        raise ValueError(f"kernel backend must be auto or torch, got {name!r}")
    _forced = None if name == "auto" else name


def _cpu(t: torch.Tensor) -> bool:
    return _forced != "torch" and t.device.type == "cpu" and cpu_ops.cpu_ops_available()


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    contiguous = x.is_contiguous() and (residual is None or residual.is_contiguous())
    if _cpu(x) and x.dim() == 2 and contiguous:
        y, r = torch.ops.diptych_cpu.rms_norm(x, residual, weight, eps)
        return y, r
    return reference.rms_norm(x, residual, weight, eps)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if _cpu(x) and x.stride(-1) == 1:
        torch.ops.diptych_cpu.rotary_(x, cos, sin)
    else:
        reference.rotary_(x, cos, sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if _cpu(x) and x.dim() == 2 and x.is_contiguous():
        out: torch.Tensor = torch.ops.diptych_cpu.silu_and_mul(x)
        return out
    return reference.silu_and_mul(x)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    if _cpu(k) and slots.dtype == torch.int64:
        torch.ops.diptych_cpu.store_kv(k, v, k_cache, v_cache, slots)
    else:
        reference.store_kv(k, v, k_cache, v_cache, slots)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    if _cpu(q) and q.shape[-1] % 16 == 0:
        return cpu_ops.paged_decode_attention(
            q, k_cache, v_cache, block_table, seq_lens, scale, window, out
        )
    return reference.paged_decode_attention(
        q, k_cache, v_cache, block_table, seq_lens, scale, window, out
    )


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """First index of each row's maximum, as torch.argmax(dim=-1) (NaN-free input)."""
    if _cpu(logits) and logits.dim() == 2 and logits.stride(1) == 1:
        out: torch.Tensor = torch.ops.diptych_cpu.argmax_rows(logits)
        return out
    return logits.argmax(dim=-1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight^T + bias; a few rows on CPU stream the weight with the GEMV kernel."""
    if (
        x.dim() == 2
        and x.shape[0] <= cpu_ops.SMALL_M_BEST
        and x.shape[1] % 16 == 0
        and _cpu(x)
        and x.stride(1) == 1
    ):
        return cpu_ops.small_m_linear(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)
