"""C++ CPU ops, compiled on first use and cached; the torch path is the fallback.

`paged_decode_attention` reads the paged KV cache in place for one-token queries
(csrc/paged_decode_cpu.cpp); `small_m_linear` is a bandwidth-bound matrix-vector
product for decode at batch <= 8 (csrc/gemv_cpu.cpp); `pack_linear_weight` and
`packed_linear` run larger batches through oneDNN on a weight reordered once. The build goes to
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
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / "paged_decode_cpu.cpp", _CSRC / "gemv_cpu.cpp", _CSRC / "fused_cpu.cpp"]
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
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M <= 8, K] @ weight[N, K]^T (+ bias), streaming the weight once."""
    out: torch.Tensor = torch.ops.diptych_cpu.small_m_linear(x, weight, bias)
    return out


def weight_prepack_available(dtype: torch.dtype) -> bool:
    """Whether oneDNN can run bf16 linears on a weight reordered once at load time.

    torch's `F.linear` on a plain bf16 weight reorders it into oneDNN's blocked layout
    on every call; at decode batch sizes that reorder costs about as much as the
    product (M = 64 on SmolLM2's shapes: 380-540 GFLOP/s plain, 680-890 prepacked,
    bit-identical results).
    """
    return (
        dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (bf16, CPU) in oneDNN's blocked layout: an opaque tensor that only
    `packed_linear` reads. The hint 64 is the batch size the layout is tuned for; any
    batch size works."""
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 64)
    return packed


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ weight^T (+ bias) with a weight from `pack_linear_weight`."""
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out
