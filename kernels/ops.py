"""The kernels the engine calls, dispatched by the device of their tensors.

    backend   CUDA tensors              CPU tensors
    auto      Triton (kernels.triton)   C++ ops (kernels.cpu_ops) when they build
    torch     torch references          torch references
    triton    Triton                    Triton through its interpreter (tests)

`DIPTYCH_KERNELS=auto|torch|triton` picks the backend when this module is imported;
`set_backend()` changes it in-process. The torch references of `kernels.reference`
cover everything else: other devices, shapes a kernel does not take, and ops with
no kernel of their own on a path (linear and argmax on CUDA are cuBLAS/torch). Auto
on CUDA without the triton package falls back to the references, with a warning.
Forcing "triton" onto CPU tensors needs TRITON_INTERPRET=1 set before the kernels
are first imported (see `kernels.triton`); otherwise it raises.

Index tensors (block tables, slot mappings, sequence lengths, block ids) may be
int32 or int64 on every path; see `kernels.triton.contract`.
"""

from __future__ import annotations

import logging
import os
import threading
from types import ModuleType

import torch

from kernels import cpu_ops, reference

log = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "triton")


def _parse(name: str | None) -> str:
    value = (name or "auto").strip().lower()
    if value not in BACKENDS:
        raise ValueError(
            f"kernel backend must be one of {', '.join(BACKENDS)} "
            f"(DIPTYCH_KERNELS or kernels.ops.set_backend), got {name!r}"
        )
    return value


_backend = _parse(os.environ.get("DIPTYCH_KERNELS"))
_triton_lock = threading.Lock()
_triton: dict[str, ModuleType | None] = {}


def set_backend(name: str | None) -> None:
    """Force the references ("torch") or the Triton kernels on every device ("triton"),
    or go back to dispatch by device with "auto" or None."""
    global _backend
    _backend = _parse(name)


def get_backend() -> str:
    return _backend


def _triton_module() -> ModuleType | None:
    """kernels.triton, imported (and its kernels defined) on first use; None without triton."""
    if "mod" not in _triton:
        with _triton_lock:
            if "mod" not in _triton:
                try:
                    import kernels.triton as kt

                    _triton["mod"] = kt
                except ImportError as e:
                    log.warning("Triton kernels unavailable (%s); CUDA uses the torch path", e)
                    _triton["mod"] = None
    return _triton["mod"]


def triton_available() -> bool:
    """Whether the Triton kernels import (this defines them: see kernels.triton)."""
    return _triton_module() is not None


def triton_runs_on(device: torch.device) -> bool:
    """Whether the Triton kernels can take tensors on `device`: CUDA, or any device
    once they were defined for the interpreter."""
    kt = _triton_module()
    return kt is not None and (device.type == "cuda" or bool(kt.INTERPRETED))


def _require_triton(t: torch.Tensor, arithmetic: bool) -> ModuleType:
    kt = _triton_module()
    if kt is None:
        raise RuntimeError("the Triton kernel backend needs the triton package")
    if t.device.type != "cuda" and not kt.INTERPRETED:
        raise RuntimeError(
            f"Triton kernels got {t.device.type} tensors: off CUDA they run only in Triton's "
            "interpreter; set TRITON_INTERPRET=1 before kernels.triton is first imported"
        )
    if arithmetic and kt.INTERPRETED and t.dtype == torch.bfloat16:
        raise RuntimeError(
            "Triton's interpreter computes bfloat16 wrongly; use float32 or float16 there"
        )
    return kt


def _path(t: torch.Tensor, arithmetic: bool = True) -> str:
    """Which implementation an op on tensors like `t` runs: "triton", "cpu" (the C++
    ops) or "torch" (the references)."""
    if _backend == "torch":
        return "torch"
    if _backend == "triton":
        _require_triton(t, arithmetic)
        return "triton"
    if t.is_cuda:
        return "triton" if triton_available() else "torch"
    if t.device.type == "cpu" and cpu_ops.cpu_ops_available():
        return "cpu"
    return "torch"


def _cpu_only(t: torch.Tensor) -> bool:
    """The C++ path of an op that has no Triton kernel (argmax, linear)."""
    return _backend == "auto" and t.device.type == "cpu" and cpu_ops.cpu_ops_available()


def _kt() -> ModuleType:
    kt = _triton_module()
    assert kt is not None  # _path said "triton"
    return kt


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    path = _path(x)
    if path == "triton" and _kt().rms_norm_supports(x, residual, weight):
        y, r = _kt().rms_norm(x, residual, weight, eps)
        return y, r
    contiguous = x.is_contiguous() and (residual is None or residual.is_contiguous())
    if path == "cpu" and x.dim() == 2 and contiguous:
        y, r = torch.ops.diptych_cpu.rms_norm(x, residual, weight, eps)
        return y, r
    return reference.rms_norm(x, residual, weight, eps)


def rotary_(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
) -> None:
    """Rotate x [T, heads, D] in place; half-split pairs (i, i + D/2), or (2i, 2i + 1)
    with `interleaved`. cos/sin fp32 [T, D/2]."""
    path = _path(x)
    if path == "triton" and x.dim() == 3 and x.stride(-1) == 1:
        _kt().rotary_(x, cos, sin, interleaved)
    elif path == "cpu" and not interleaved and x.stride(-1) == 1:
        torch.ops.diptych_cpu.rotary_(x, cos, sin)
    elif interleaved:
        reference.rotary_interleaved_(x, cos, sin)
    else:
        reference.rotary_(x, cos, sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    path = _path(x)
    if path != "torch" and x.dim() == 2 and x.stride(1) == 1:
        if path == "triton":
            out: torch.Tensor = _kt().silu_and_mul(x)
            return out
        if x.is_contiguous():
            out = torch.ops.diptych_cpu.silu_and_mul(x)
            return out
    return reference.silu_and_mul(x)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Write k/v [T, KVH, D] into caches [blocks, block, KVH, D] at `slots`; -1 skipped."""
    path = _path(k, arithmetic=False)
    if path == "triton":
        _kt().store_kv(k, v, k_cache, v_cache, slots)
    elif path == "cpu" and slots.dtype == torch.int64:
        torch.ops.diptych_cpu.store_kv(k, v, k_cache, v_cache, slots)
    else:
        reference.store_kv(k, v, k_cache, v_cache, slots)


def unified_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention of a ragged batch (prefill, chunks after a cached prefix,
    decodes) over caches that already hold this step's K/V; see
    `kernels.triton.unified_attention` for the layout. `max_query_len` and
    `max_seq_len` are host-side upper bounds (they size tiles; no device sync)."""
    if _path(q) == "triton":
        result: torch.Tensor = _kt().unified_attention(
            q, k_cache, v_cache, query_start_loc, seq_lens, block_table,
            max_query_len=max_query_len, max_seq_len=max_seq_len,
            scale=scale, window=window, out=out,
        )  # fmt: skip
        return result
    return reference.unified_attention(
        q, k_cache, v_cache, query_start_loc, seq_lens, block_table, scale, window, out
    )


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
    """One query token per sequence: q [B, H, D] over its first seq_len cached tokens."""
    path = _path(q)
    if path == "triton":
        result: torch.Tensor = _kt().unified_attention(
            q, k_cache, v_cache, None, seq_lens, block_table,
            max_query_len=1, max_seq_len=block_table.shape[1] * k_cache.shape[1],
            scale=scale, window=window, out=out,
        )  # fmt: skip
        return result
    if path == "cpu" and q.shape[-1] % 16 == 0:
        return cpu_ops.paged_decode_attention(
            q, k_cache, v_cache, block_table, seq_lens, scale, window, out
        )
    return reference.paged_decode_attention(
        q, k_cache, v_cache, block_table, seq_lens, scale, window, out
    )


def gather_blocks(
    pool: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Pack whole blocks (every layer) of the pool into a staging buffer [n, *block]."""
    if _path(pool, arithmetic=False) == "triton":
        result: torch.Tensor = _kt().gather_blocks(pool, block_ids, out)
        return result
    return reference.gather_blocks(pool, block_ids, out)


def scatter_blocks(src: torch.Tensor, pool: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Unpack a staging buffer [n, *block] into the pool's blocks `block_ids`."""
    if _path(pool, arithmetic=False) == "triton":
        _kt().scatter_blocks(src, pool, block_ids)
    else:
        reference.scatter_blocks(src, pool, block_ids)


def copy_blocks(pool: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """Copy whole blocks src_ids[i] -> dst_ids[i] inside the pool (copy-on-write)."""
    if _path(pool, arithmetic=False) == "triton":
        _kt().copy_blocks(pool, src_ids, dst_ids)
    else:
        reference.copy_blocks(pool, src_ids, dst_ids)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """First index of each row's maximum, as torch.argmax(dim=-1) (NaN-free input)."""
    if _cpu_only(logits) and logits.dim() == 2 and logits.stride(1) == 1:
        out: torch.Tensor = torch.ops.diptych_cpu.argmax_rows(logits)
        return out
    return logits.argmax(dim=-1)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: cpu_ops.PackedWeight | None = None,
    fp32_out: bool = False,
) -> torch.Tensor:
    """x @ weight^T + bias. On CPU a few rows stream the weight with the GEMV kernel
    (unless `packed` is faster there: `PackedWeight.gemv_rows`); more use `packed`
    (the same weight from `cpu_ops.pack_linear_weight`) if given, up to the rows its
    layout is worth (`PackedWeight.max_rows`). `fp32_out` returns fp32: the kernels'
    unrounded sums where they ran, else the result widened."""
    gemv_rows = cpu_ops.SMALL_M_BEST if packed is None else packed.gemv_rows
    if (
        x.dim() == 2
        and x.shape[0] <= gemv_rows
        and x.shape[1] % 16 == 0
        and _cpu_only(x)
        and x.stride(1) == 1
    ):
        return cpu_ops.small_m_linear(x, weight, bias, fp32_out)
    if packed is not None and (
        packed.max_rows is None or x.numel() <= packed.max_rows * x.shape[-1]
    ):
        return cpu_ops.packed_linear(x, packed, bias, fp32_out)
    out = torch.nn.functional.linear(x, weight, bias)
    return out.float() if fp32_out else out
