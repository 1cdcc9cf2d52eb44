"""C++ CPU ops, compiled on first use and cached; the torch path is the fallback.

`paged_decode_attention` reads the paged KV cache in place for one-token queries
(csrc/paged_decode_cpu.cpp); `small_m_linear` is a bandwidth-bound matrix-vector
product for decode at batch <= 8 (csrc/gemv_cpu.cpp); `pack_linear_weight` and
`packed_linear` run larger batches on a weight reordered once at load: our bf16 GEMM
(csrc/gemm_bf16.cpp) where the CPU has AVX512-BF16, else oneDNN. The build goes to
`$DIPTYCH_CACHE_DIR/torch_extensions` (default `~/.cache/diptych/...`), keyed by the
source, the torch version and the CPU, so a second process loads it in
milliseconds. Set `DIPTYCH_CPU_KERNELS=0` to force the pure torch path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [
    _CSRC / "paged_decode_cpu.cpp",
    _CSRC / "gemv_cpu.cpp",
    _CSRC / "fused_cpu.cpp",
    _CSRC / "gemm_bf16.cpp",
]
_lock = threading.Lock()
_state: dict[str, bool] = {}


def _cache_root() -> Path:
    root = os.environ.get("DIPTYCH_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "diptych"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_ops_available() -> bool:
    """Build/load the CPU ops once per process; False (with a warning) if that fails."""
    if "ok" in _state:
        return _state["ok"]
    with _lock:
        if "ok" not in _state:
            _state["ok"] = _build()
    return _state["ok"]


def _build() -> bool:
    if os.environ.get("DIPTYCH_CPU_KERNELS", "1") == "0":
        return False
    try:
        from torch.utils.cpp_extension import load

        key = hashlib.sha256(
            b"".join(p.read_bytes() for p in [*_SOURCES, *_CSRC.glob("*.h")])
            + torch.__version__.encode()
            + _cpu_name().encode()
        ).hexdigest()[:16]
        build_dir = _cache_root() / "torch_extensions" / key
        build_dir.mkdir(parents=True, exist_ok=True)
        load(
            name=f"diptych_cpu_{key}",
            sources=[str(p) for p in _SOURCES],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
        return True
    except Exception as e:  # no compiler, no ninja, unsupported platform ...
        log.warning("CPU attention kernel unavailable (%s); using the torch path", e)
        return False


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
    """q [B, H, D]; caches [blocks, block_size, KVH, D]; returns [B, H, D]."""
    if out is None:
        out = torch.empty_like(q)
    torch.ops.diptych_cpu.paged_decode_attention(
        q, k_cache, v_cache, block_table, seq_lens, scale, window or 0, out
    )
    return out


# Largest row count the small-M linear kernel takes (see csrc/gemv_cpu.cpp), and the
# largest for which it beats oneDNN's GEMM (measured on AVX-512: 47-59 GB/s of weights
# at 1-3 rows; from 4 rows oneDNN's blocking wins).
SMALL_M_MAX = 8
SMALL_M_BEST = 3


def small_m_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    fp32_out: bool = False,
) -> torch.Tensor:
    """x [M <= 8, K] @ weight[N, K]^T (+ bias), streaming the weight once; `fp32_out`
    returns the fp32 sums instead of rounding them to x's dtype."""
    out: torch.Tensor = torch.ops.diptych_cpu.small_m_linear(x, weight, bias, fp32_out)
    return out


# Rows up to which the packed GEMM beats torch's own bf16 linear (above it both
# are compute-bound and torch's needs no second copy of the weight).
PACKED_MAX_ROWS = 256


@dataclass(frozen=True)
class PackedWeight:
    """A linear weight reordered once for batched decode: `kind` "vnni" is our GEMM's
    [N/16, K/2, 16, 2] layout (csrc/gemm_bf16.cpp), "onednn" oneDNN's blocked one."""

    data: torch.Tensor
    kind: str


def _vnni_available() -> bool:
    return cpu_ops_available() and hasattr(torch.ops.diptych_cpu, "gemm_vnni")


def weight_prepack_available(dtype: torch.dtype) -> bool:
    """Whether bf16 linears can run on a weight packed once at load time.

    torch's `F.linear` on a plain bf16 weight reorders it into oneDNN's blocked layout
    on every call; at decode batch sizes that costs about as much as the product.
    Our GEMM on a VNNI-packed weight also streams a cold weight faster than oneDNN.
    """
    if dtype != torch.bfloat16:
        return False
    return _vnni_available() or (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack_linear_weight(weight: torch.Tensor) -> PackedWeight:
    """weight [N, K] (bf16, CPU) packed for `packed_linear`: our layout when the CPU
    and the shape allow (N % 32 == 0, K even), else oneDNN's."""
    w = weight.detach().contiguous()
    if _vnni_available() and w.shape[0] % 32 == 0 and w.shape[1] % 2 == 0:
        return PackedWeight(torch.ops.diptych_cpu.pack_vnni(w), "vnni")
    # the hint 64 is the batch size oneDNN tunes the layout for; any batch size works
    return PackedWeight(torch.ops.mkldnn._reorder_linear_weight(w, 64), "onednn")


def packed_linear(
    x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None, fp32_out: bool = False
) -> torch.Tensor:
    """x [..., K] @ weight^T (+ bias) with a weight from `pack_linear_weight`;
    `fp32_out` returns fp32 (our GEMM's unrounded sums; oneDNN's output widened)."""
    out: torch.Tensor
    if packed.kind == "vnni":
        flat = x.reshape(-1, x.shape[-1])
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        out = torch.ops.diptych_cpu.gemm_vnni(flat, packed.data, bias, fp32_out)
        return out.view(*x.shape[:-1], out.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(x, packed.data, bias, "none", [], "")
    return out.float() if fp32_out else out
