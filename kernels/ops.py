"""The kernels the engine calls, dispatched by the device of their tensors.

`Kernels` holds every op, bound to one `kernels.selection.KernelSelection` (which
implementation runs where: Triton, the C++ CPU ops or the torch references); the
selection is a value, so a `Kernels` never changes what it runs. `DEFAULT` is
selected by `DIPTYCH_KERNELS` when this module is imported, and the module-level
functions (`ops.rms_norm`, ...) are its ops; code that must run another backend (an
engine, a test) builds its own `Kernels` and passes it on.

The torch references of `kernels.reference` cover everything a faster kernel does
not: other devices, shapes a kernel does not take, and ops with no kernel of their
own on a path (linear and argmax on CUDA are cuBLAS/torch). Index tensors (block
tables, slot mappings, sequence lengths, block ids) may be int32 or int64 on every
path; see `kernels.triton.contract`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from types import ModuleType

import torch

from kernels import cpu_ops, reference
from kernels.paged import PagedBatch
from kernels.quant import QuantTensor
from kernels.selection import KernelSelection, triton_module

# Rows up to which linears run row-invariant kernels (`row_invariant`); 0: off.
_ROW_INVARIANT: ContextVar[int] = ContextVar("row_invariant", default=0)


@contextmanager
def row_invariant(rows: int) -> Iterator[None]:
    """Within this block a dense linear of up to `rows` rows (at most
    `cpu_ops.SMALL_M_MAX`) runs on CPU the small-M GEMV, whose every output row is the
    one that row alone would get, bit for bit, instead of a packed GEMM that wins from
    2-3 rows but sums in another order (oneDNN's AMX tiles, our VNNI GEMM). The engine
    turns it on for steps that verify drafted tokens, so that speculation leaves greedy
    output as it is without drafts. The other linears need nothing: the quantized dot
    kernel and the fp32-arithmetic GEMM (the only path for bf16 without AVX512-BF16)
    sum each row alike at every row count. `rows` 0 turns it off."""
    token = _ROW_INVARIANT.set(min(rows, cpu_ops.SMALL_M_MAX))
    try:
        yield
    finally:
        _ROW_INVARIANT.reset(token)


def row_invariant_rows() -> int:
    """The rows `row_invariant` covers here and now (0: off)."""
    return _ROW_INVARIANT.get()


def _kt() -> ModuleType:
    kt = triton_module()
    assert kt is not None  # the selection said "triton", which needs the module
    return kt


@dataclass(frozen=True)
class Kernels:
    """Every op of the engine, run where `selection` says."""

    selection: KernelSelection

    def rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        path = self.selection.path(x)
        if path == "triton" and _kt().rms_norm_supports(x, residual, weight):
            y, r = _kt().rms_norm(x, residual, weight, eps)
            return y, r
        contiguous = x.is_contiguous() and (residual is None or residual.is_contiguous())
        if path == "cpu" and x.dim() == 2 and contiguous:
            y, r = torch.ops.diptych_cpu.rms_norm(x, residual, weight, eps)
            return y, r
        return reference.rms_norm(x, residual, weight, eps)

    def rotary_(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
    ) -> None:
        """Rotate x [T, heads, D] in place; half-split pairs (i, i + D/2), or (2i, 2i + 1)
        with `interleaved`. cos/sin fp32 [T, D/2]."""
        path = self.selection.path(x)
        if path == "triton" and x.dim() == 3 and x.stride(-1) == 1:
            _kt().rotary_(x, cos, sin, interleaved)
        elif path == "cpu" and not interleaved and x.stride(-1) == 1:
            torch.ops.diptych_cpu.rotary_(x, cos, sin)
        elif interleaved:
            reference.rotary_interleaved_(x, cos, sin)
        else:
            reference.rotary_(x, cos, sin)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        path = self.selection.path(x)
        if path != "torch" and x.dim() == 2 and x.stride(1) == 1:
            if path == "triton":
                out: torch.Tensor = _kt().silu_and_mul(x)
                return out
            if x.is_contiguous():
                out = torch.ops.diptych_cpu.silu_and_mul(x)
                return out
        return reference.silu_and_mul(x)

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """Write k/v [T, KVH, D] into caches [blocks, block, KVH, D] at `slots`; -1 skipped.
        int8 / fp8 caches (`kernels.kv_quant`, rows of D + 2) store each row quantized, on
        every path."""
        path = self.selection.path(k, arithmetic=False)
        if path == "triton":
            _kt().store_kv(k, v, k_cache, v_cache, slots)
        elif path == "cpu" and slots.dtype == torch.int64:
            torch.ops.diptych_cpu.store_kv(k, v, k_cache, v_cache, slots)
        else:
            reference.store_kv(k, v, k_cache, v_cache, slots)

    def unified_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: PagedBatch,
        scale: float,
        window: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal paged attention of a ragged batch (prefill, chunks after a cached
        prefix, decodes) over caches that already hold this step's K/V; see
        `kernels.paged` for the batch. Triton takes every batch in one launch; off it, a
        decode batch (no `query_start_loc`: q [B, H, D], one token per sequence) runs
        the decode kernels, which read the cache in place on CPU. Every path takes
        int8 and fp8 caches (`kernels.kv_quant`)."""
        path = self.selection.path(q)
        if path == "triton":
            result: torch.Tensor = _kt().unified_attention(
                q, k_cache, v_cache, batch, scale=scale, window=window, out=out
            )
            return result
        if batch.query_start_loc is not None:
            return reference.unified_attention(q, k_cache, v_cache, batch, scale, window, out)
        if path == "cpu" and q.shape[-1] % 16 == 0:
            return cpu_ops.paged_decode_attention(q, k_cache, v_cache, batch, scale, window, out)
        return reference.paged_decode_attention(q, k_cache, v_cache, batch, scale, window, out)

    def gather_blocks(
        self, pool: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Pack whole blocks (every layer) of the pool into a staging buffer [n, *block]."""
        if self.selection.path(pool, arithmetic=False) == "triton":
            result: torch.Tensor = _kt().gather_blocks(pool, block_ids, out)
            return result
        return reference.gather_blocks(pool, block_ids, out)

    def scatter_blocks(
        self, src: torch.Tensor, pool: torch.Tensor, block_ids: torch.Tensor
    ) -> None:
        """Unpack a staging buffer [n, *block] into the pool's blocks `block_ids`."""
        if self.selection.path(pool, arithmetic=False) == "triton":
            _kt().scatter_blocks(src, pool, block_ids)
        else:
            reference.scatter_blocks(src, pool, block_ids)

    def copy_blocks(self, pool: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
        """Copy whole blocks src_ids[i] -> dst_ids[i] inside the pool (copy-on-write)."""
        if self.selection.path(pool, arithmetic=False) == "triton":
            _kt().copy_blocks(pool, src_ids, dst_ids)
        else:
            reference.copy_blocks(pool, src_ids, dst_ids)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """First index of each row's maximum, as torch.argmax(dim=-1) (NaN-free input)."""
        if self.selection.cpu_only(logits) and logits.dim() == 2 and logits.stride(1) == 1:
            out: torch.Tensor = torch.ops.diptych_cpu.argmax_rows(logits)
            return out
        return logits.argmax(dim=-1)

    def linear(
        self,
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
        invariant = _ROW_INVARIANT.get()
        if invariant and weight.numel():  # a packed copy that serves all rows has no plain one
            gemv_rows = max(gemv_rows, invariant)
        if (
            x.dim() == 2
            and x.shape[0] <= gemv_rows
            and x.shape[1] % 16 == 0
            and self.selection.cpu_only(x)
            and x.stride(1) == 1
        ):
            return cpu_ops.small_m_linear(x, weight, bias, fp32_out)
        if packed is not None and (
            packed.max_rows is None or x.numel() <= packed.max_rows * x.shape[-1]
        ):
            return cpu_ops.packed_linear(x, packed, bias, fp32_out)
        out = torch.nn.functional.linear(x, weight, bias)
        return out.float() if fp32_out else out

    def quant_linear(
        self,
        x: torch.Tensor,
        weight: QuantTensor,
        bias: torch.Tensor | None = None,
        fp32_out: bool = False,
    ) -> torch.Tensor:
        """x [..., K] @ weight^T (+ bias) on a weight kept quantized (`kernels.quant`).
        On CPU up to `QUANT_DOT_MAX_ROWS` rows run the integer dot-product kernel, which
        reads the quantized weight once; more rows dequantize the weight to x's dtype
        and run the dense linear (a prefill's GEMM is compute-bound, and the int8
        kernel does not tile for it). On the Triton path as many rows run the Triton
        kernel (`kernels/triton/quant_linear.py`, dequantizing in registers), more the
        dequantized weight through torch's linear. Elsewhere: the torch reference."""
        k, n = x.shape[-1], weight.shape[0]
        flat = x if x.dim() == 2 else x.reshape(-1, k)
        if self.selection.cpu_only(flat) and flat.stride(-1) == 1:
            args = (weight.codes, weight.scales, weight.mins, weight.group, n)
            if flat.shape[0] <= QUANT_DOT_MAX_ROWS:  # decode: ~120 calls a step
                out: torch.Tensor = torch.ops.diptych_cpu.quant_linear.default(
                    flat, *args, fp32_out
                )
            else:
                w = torch.ops.diptych_cpu.quant_dequantize.default(*args, x.dtype)
                out = torch.nn.functional.linear(flat, w[:, :k])
        elif (
            flat.shape[0] <= QUANT_DOT_MAX_ROWS
            and flat.stride(-1) == 1
            and self.selection.path(flat) == "triton"
        ):
            out = _kt().quant_linear(flat, weight, None, fp32_out)
        else:
            out = torch.nn.functional.linear(flat, weight.dequantize(x.dtype))
        if fp32_out and out.dtype != torch.float32:
            out = out.float()
        if bias is not None:
            out = out + bias
        return out if x.dim() == 2 else out.view(*x.shape[:-1], n)


# Rows up to which `quant_linear` runs the integer dot-product kernel on CPU.
# Measured on a 2-vCPU AMX Xeon, SmolLM2-135M Q4_1, prefill of 64 tokens: the integer
# kernel 81 ms, dequantize + oneDNN 101 ms (the bf16 model 55); 512 tokens: 546 / 266 / 205.
QUANT_DOT_MAX_ROWS = 64

DEFAULT = Kernels(KernelSelection.from_env())

rms_norm = DEFAULT.rms_norm
rotary_ = DEFAULT.rotary_
silu_and_mul = DEFAULT.silu_and_mul
store_kv = DEFAULT.store_kv
unified_attention = DEFAULT.unified_attention
gather_blocks = DEFAULT.gather_blocks
scatter_blocks = DEFAULT.scatter_blocks
copy_blocks = DEFAULT.copy_blocks
argmax = DEFAULT.argmax
linear = DEFAULT.linear
quant_linear = DEFAULT.quant_linear


def get_backend() -> str:
    """The kernel backend of `DEFAULT` ("auto", "torch" or "triton")."""
    return DEFAULT.selection.backend
