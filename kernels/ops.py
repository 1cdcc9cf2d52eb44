"""The kernels the engine calls, dispatched by the device of their tensors.

`Kernels` holds every op, bound to one `kernels.ops.KernelSelection` (which
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

`KernelSelection` decides which implementation every kernel runs, in one place:

    backend   CUDA tensors              CPU tensors
    auto      Triton (kernels.triton)   C++ ops (kernels.cpu_ops) when they build
    torch     torch references          torch references
    triton    Triton                    Triton through its interpreter (tests)

A `KernelSelection` is an immutable value: `from_env()` reads `DIPTYCH_KERNELS` (the
process default, `kernels.ops.DEFAULT`, is computed from it once, at import); a test
or an engine that wants another backend builds its own and hands it, wrapped in a
`kernels.ops.Kernels`, to what runs the kernels. It decides per call from the
tensor's device (`path`), and once per engine which attention kernels a step runs
(`attention`), so the attention backend and the ops it calls always agree.

Auto on CUDA without the triton package falls back to the references, with a
warning. Forcing "triton" onto CPU tensors needs TRITON_INTERPRET=1 set before the
kernels are first imported (see `kernels.triton`); otherwise it raises.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from types import ModuleType

import torch

from kernels import cpu_ops, lora, moe, reference
from kernels.paged import PagedBatch, PagedLayer
from kernels.quant import QuantTensor

log = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "triton")
ATTENTION_BACKENDS = ("auto", "torch", "triton")

# kernels.triton is imported (which defines its kernels) on first use, once per
# process: a fact about this process, like the C++ build, not a setting.
_triton_lock = threading.Lock()
_triton: dict[str, ModuleType | None] = {}


def triton_module() -> ModuleType | None:
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
    return triton_module() is not None


def triton_runs_on(device: torch.device) -> bool:
    """Whether the Triton kernels can take tensors on `device`: CUDA, or any device
    once they were defined for the interpreter."""
    kt = triton_module()
    return kt is not None and (device.type == "cuda" or bool(kt.INTERPRETED))


@dataclass(frozen=True)
class KernelSelection:
    """The kernel backend: "auto" (by device), "torch" (the references everywhere) or
    "triton" (the Triton kernels on every device)."""

    backend: str = "auto"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(
                f"kernel backend must be one of {', '.join(BACKENDS)} "
                f"(DIPTYCH_KERNELS or KernelSelection), got {self.backend!r}"
            )

    @classmethod
    def parse(cls, name: str | None) -> KernelSelection:
        """From a user's spelling: case and spaces do not matter, None means "auto"."""
        return cls((name or "auto").strip().lower())

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> KernelSelection:
        return cls.parse(environ.get("DIPTYCH_KERNELS"))

    def path(self, t: torch.Tensor, arithmetic: bool = True) -> str:
        """Which implementation an op on tensors like `t` runs: "triton", "cpu" (the C++
        ops) or "torch" (the references). `arithmetic`: the op computes on the values
        (the interpreter gets bf16 arithmetic wrong; copies move bits and are exact)."""
        if self.backend == "torch":
            return "torch"
        if self.backend == "triton":
            _require_triton(t, arithmetic)
            return "triton"
        if t.is_cuda:
            return "triton" if triton_available() else "torch"
        if t.device.type == "cpu" and cpu_ops.cpu_ops_available():
            return "cpu"
        return "torch"

    def cpu_only(self, t: torch.Tensor) -> bool:
        """Whether an op with a C++ kernel and no Triton one (argmax, linear) runs it."""
        return self.backend == "auto" and t.device.type == "cpu" and cpu_ops.cpu_ops_available()

    def attention(self, requested: str, device: torch.device) -> str:
        """The attention kernels a step runs for `EngineConfig.attention_backend`
        `requested`: "triton" (the unified paged-attention kernel, one launch per layer)
        or "torch" (the portable ops: decode kernel, SDPA for prompts). "auto" takes
        Triton on CUDA when the kernels import and the backend is not "torch".

        "triton" off CUDA runs only with the kernels forced to Triton (`DIPTYCH_KERNELS
        =triton`) and Triton's interpreter (TRITON_INTERPRET=1): a test configuration,
        slow but exact."""
        if requested == "torch":
            return "torch"
        if requested == "auto":
            if device.type == "cuda" and self.backend != "torch" and triton_available():
                return "triton"
            return "torch"
        if requested == "triton":
            if not triton_available():
                raise ValueError("attention_backend='triton' needs the triton package")
            forced = self.backend == "triton" and triton_runs_on(device)
            if device.type != "cuda" and not forced:
                raise ValueError(
                    f"attention_backend='triton' needs a CUDA device (got {device}); on CPU "
                    "it runs only for tests, with DIPTYCH_KERNELS=triton and TRITON_INTERPRET=1"
                )
            return "triton"
        raise ValueError(
            f"unknown attention backend {requested!r}; available: {', '.join(ATTENTION_BACKENDS)}"
        )


def _require_triton(t: torch.Tensor, arithmetic: bool) -> None:
    kt = triton_module()
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


# Whether the ops run batch-invariant (`deterministic`).
_DETERMINISTIC: ContextVar[bool] = ContextVar("deterministic", default=False)


@contextmanager
def deterministic(on: bool = True) -> Iterator[None]:
    """Within this block (an engine step under `--deterministic`) every linear computes
    each row as that row alone would, at any row count: a dense one on its weight packed
    with `fixed_order` (it refuses a weight without), a quantized one with the integer
    dot kernel at every row count. Attention is the backend's part
    (`TorchAttention.deterministic`); norms, rotary and the elementwise ops are per row
    on every path."""
    token = _DETERMINISTIC.set(on)
    try:
        yield
    finally:
        _DETERMINISTIC.reset(token)


def deterministic_on() -> bool:
    """Whether `deterministic` is on here and now."""
    return _DETERMINISTIC.get()


@functools.cache
def fp8_dots(device: torch.device) -> bool:
    """Whether `device` multiplies e4m3 on its tensor cores (CUDA sm_89 and later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


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

    def fused_moe(
        self,
        x: torch.Tensor,
        w13: moe.Weights,
        w2: moe.Weights,
        weights: torch.Tensor,
        ids: torch.Tensor,
        first: int = 0,
    ) -> torch.Tensor:
        """[T, H]: each token's chosen experts over stacked weights, summed
        (`kernels.moe`): the Triton grouped GEMM (`kernels/triton/fused_moe.py`) on
        the Triton path; where the C++ kernels run, our grouped linear (dense experts)
        or grouped FP8 kernel; else torch's grouped GEMM or the references. A
        deterministic step runs each expert's rows through `_det_plain_linear`."""
        if _DETERMINISTIC.get():
            return moe.grouped_experts(x, w13, w2, weights, ids, first,
                                       expert_linear=self._det_plain_linear)  # fmt: skip
        if (
            self.selection.path(x) == "triton"
            and x.stride(1) == 1
            and isinstance(w13, torch.Tensor)
            and isinstance(w2, torch.Tensor)
        ):
            out: torch.Tensor = _kt().fused_moe(x, w13, w2, weights, ids, first)
            return out
        return moe.grouped_experts(x, w13, w2, weights, ids, first, self.selection.cpu_only(x))

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
        self, q: torch.Tensor, layer: PagedLayer, batch: PagedBatch, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Causal paged attention of a ragged batch (prefill, chunks after a cached
        prefix, decodes) over the layer's caches, which already hold this step's K/V;
        see `kernels.paged` for the batch and the layer. Triton takes every batch in one
        launch; off it, a decode batch (no `query_start_loc`: q [B, H, D], one token per
        sequence) runs the decode kernels, which read the cache in place on CPU. Every
        path takes int8 and fp8 caches (`kernels.kv_quant`)."""
        path = self.selection.path(q)
        if path == "triton":
            result: torch.Tensor = _kt().unified_attention(q, layer, batch, out)
            return result
        if batch.query_start_loc is not None:
            return reference.unified_attention(q, layer, batch, out)
        if path == "cpu" and q.shape[-1] % 16 == 0:
            return cpu_ops.paged_decode_attention(q, layer, batch, out)
        return reference.paged_decode_attention(q, layer, batch, out)

    def det_attention(
        self,
        q: torch.Tensor,
        layer: PagedLayer,
        batch: PagedBatch,
        row_seq: torch.Tensor | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The attention of `--deterministic`: every row one token over its sequence's
        causal context in the cache, in sums that depend on that row alone
        (`cpu_ops.det_attention` on CPU, `kernels/triton/attention.py`'s `det_attention`
        on the Triton path); `engine.determinism` refuses what would run elsewhere.
        `row_seq` None: `batch.block_table` has a row a token (the Triton kernel's)."""
        path = self.selection.path(q)
        if path == "triton":
            result: torch.Tensor = _kt().det_attention(q, layer, batch, row_seq, out)
            return result
        if path != "cpu" or row_seq is None:
            raise RuntimeError(
                "the batch-invariant attention runs on the C++ CPU kernels or Triton only"
            )
        return cpu_ops.det_attention(q, layer, batch, row_seq, out)

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
        if packed is not None and packed.fixed_order:
            return cpu_ops.packed_linear(x, packed, bias, fp32_out)
        if _DETERMINISTIC.get():
            return self._det_linear(x, weight, bias, fp32_out)
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

    def _det_linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fp32_out: bool
    ) -> torch.Tensor:
        """A deterministic step's linear off the packed CPU weights: the Triton GEMM of
        one launch shape for every row count (`kernels/triton/matmul.py`)."""
        if self.selection.path(x) != "triton":
            raise RuntimeError(
                "a deterministic step met a linear without a fixed-order packed weight "
                "(cpu_ops.pack_linear_weight(fixed_order=True)) off the Triton path"
            )
        out: torch.Tensor = _kt().batch_invariant_linear(x, weight, bias, fp32_out)
        return out

    def head_linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [T, H, K] through each head's own linear w [H, N, K]: [T, H, N] (MLA's
        absorbed projections); a deterministic step runs each head's rows through
        `_det_plain_linear`."""
        if not _DETERMINISTIC.get():
            return torch.einsum("thk,hnk->thn", x, w)
        heads = [self._det_plain_linear(x[:, h].contiguous(), w[h]) for h in range(w.shape[0])]
        return torch.stack(heads, dim=1)

    def _det_plain_linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x @ w^T on a plain (unpacked) weight in a deterministic step, each row summed
        alike however many there are (an expert's rows, an MLA head's): on CPU the
        small-M GEMV (row-invariant up to its rows) `SMALL_M_MAX` rows at a time, on the
        Triton path the one-shape GEMM."""
        if self.selection.path(x) == "triton":
            return self._det_linear(x, w, None, False)
        if not self.selection.cpu_only(x) or x.shape[1] % 16:
            raise RuntimeError(
                "a deterministic step's plain linears run the C++ GEMV (K % 16 == 0)"
            )
        step = cpu_ops.SMALL_M_MAX
        parts = [cpu_ops.small_m_linear(x[i : i + step], w, None, False)
                 for i in range(0, x.shape[0], step)]  # fmt: skip
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def lora_add_(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        slots: torch.Tensor,
        bounds: tuple[int, ...],
    ) -> None:
        """Add each row's LoRA delta (its slot's B(A x), `kernels.lora`) to `out` in
        place: the C++ BGMV kernel on CPU, the Triton shrink and expand kernels on the
        Triton path, else the torch reference."""
        path = self.selection.path(x)
        if path == "cpu" and x.stride(1) == 1 and out.stride(1) == 1:
            torch.ops.diptych_cpu.lora_add_.default(out, x, a, b, slots, list(bounds))
        elif path == "triton" and x.stride(1) == 1 and out.stride(1) == 1:
            _kt().lora_add_(out, x, a, b, slots, bounds)
        else:
            lora.lora_add_reference(out, x, a, b, slots, bounds)

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
        kernel (`kernels/triton/quant_linear.py`, dequantizing in registers; an FP8
        weight on a GPU of FP8 tensor cores runs w8a8, x rounded to e4m3 a row at a
        time), more the dequantized weight through torch's linear. Elsewhere: the
        torch reference."""
        k, n = x.shape[-1], weight.shape[0]
        flat = x if x.dim() == 2 else x.reshape(-1, k)
        out: torch.Tensor
        if _DETERMINISTIC.get() and self.selection.path(flat) == "triton":
            # every row count the same way: the Triton kernel at one tile height
            a8 = weight.kind == "f8" and fp8_dots(flat.device)
            rows = flat if flat.stride(-1) == 1 else flat.contiguous()
            out = _kt().quant_linear(rows, weight, None, fp32_out, a8, fixed_tile=True)
        elif self.selection.cpu_only(flat) and flat.stride(-1) == 1:
            args = (weight.codes, weight.scales, weight.mins, weight.group, n)
            # decode: ~120 calls a step; a deterministic step: every row count
            if flat.shape[0] <= QUANT_DOT_MAX_ROWS or _DETERMINISTIC.get():
                out = torch.ops.diptych_cpu.quant_linear.default(
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
            a8 = weight.kind == "f8" and fp8_dots(flat.device)
            out = _kt().quant_linear(flat, weight, None, fp32_out, a8)
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
fused_moe = DEFAULT.fused_moe
head_linear = DEFAULT.head_linear
lora_add_ = DEFAULT.lora_add_


def get_backend() -> str:
    """The kernel backend of `DEFAULT` ("auto", "torch" or "triton")."""
    return DEFAULT.selection.backend
