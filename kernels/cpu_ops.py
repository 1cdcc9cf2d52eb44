"""C++ CPU ops, compiled on first use for this CPU's ISA level and cached; the torch
path is the fallback.

`paged_decode_attention` reads the paged KV cache in place for one-token queries
(csrc/paged_decode_cpu.cpp); `small_m_linear` is a bandwidth-bound matrix-vector
product for decode at a few rows (csrc/gemv_cpu.cpp); `pack_linear_weight` and
`packed_linear` run larger batches on a weight reordered once at load: our bf16 GEMM
(csrc/gemm_bf16.cpp) where the CPU has AVX512-BF16, else our bf16-weight fp32 GEMM
(csrc/gemm_f32acc.cpp). oneDNN's bf16 linear is used where it has the instructions it
needs: on AMX for every batch above the GEMV's, at the AVX512-BF16 level for shapes our
GEMM does not take.

The build targets exactly one level of `kernels.cpu_isa` (its `-march` flags, never
`-march=native`) and goes to `$DIPTYCH_CACHE_DIR/torch_extensions` (default
`~/.cache/diptych/...`), keyed by the sources, the torch version, the compiler and
those flags, so a second process loads it in milliseconds and a build can be shared
by every CPU of its level. `python -m kernels --prebuild all` compiles every level
ahead (a container image's build; the host's own CPU does not matter), and a process
loads those from `$DIPTYCH_PREBUILT_DIR` (read-only) before it would compile. If a
level fails to build (an old compiler without `-mavx512bf16`, say), the next level down
is tried, with one warning naming what was disabled and why; if none builds, every op
runs its torch reference. Set
`DIPTYCH_CPU_KERNELS=0` to force the pure torch path.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kernels import cpu_isa
from kernels.paged import PagedBatch, PagedLayer

log = logging.getLogger(__name__)
# a role's start-up stages, printed whatever the log level (diptych/roles.py)
STARTUP = logging.getLogger("diptych.startup")

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [  # the longest to compile first (it starts beside the precompiled header)
    _CSRC / "paged_decode_cpu.cpp",
    _CSRC / "gemv_cpu.cpp",
    _CSRC / "fused_cpu.cpp",
    _CSRC / "gemm_bf16.cpp",
    _CSRC / "gemm_f32acc.cpp",
    _CSRC / "gemm_amx.cpp",
    _CSRC / "qlinear_cpu.cpp",
    _CSRC / "fp8_linear_cpu.cpp",
    _CSRC / "decode_stack_cpu.cpp",
    _CSRC / "lora_cpu.cpp",
    _CSRC / "det_attention_cpu.cpp",
    _CSRC / "det_attention_amx.cpp",
    _CSRC / "build_info.cpp",
]
_lock = threading.Lock()
_state: dict[str, CpuBuild] = {}


@dataclass(frozen=True)
class CpuBuild:
    """The C++ ops loaded in this process: the ISA level they were compiled for (None:
    no build, the torch path everywhere), what `build_info` says they contain, and one
    line for each level that could not be built."""

    level: str | None
    path: str | None = None
    info: dict[str, int] = field(default_factory=dict)
    failures: tuple[str, ...] = ()

    def has(self, feature: str) -> bool:
        return bool(self.info.get(feature, 0))


def _cache_root() -> Path:
    root = os.environ.get("DIPTYCH_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "diptych"


def cpu_build() -> CpuBuild:
    """Build (or load from the cache) the CPU ops once per process."""
    if "build" not in _state:
        with _lock:
            if "build" not in _state:
                _state["build"] = _build()
    return _state["build"]


def cpu_ops_available() -> bool:
    """Whether the C++ CPU ops are loaded (False, after one warning, if no level built)."""
    return cpu_build().level is not None


def _build() -> CpuBuild:
    if os.environ.get("DIPTYCH_CPU_KERNELS", "1") == "0":
        return CpuBuild(None, failures=("disabled by DIPTYCH_CPU_KERNELS=0",))
    isa = cpu_isa.probe()
    missing = _missing_toolchain()
    below = reversed(cpu_isa.LEVELS[: cpu_isa.LEVELS.index(isa.level) + 1])
    levels = dict.fromkeys(cpu_isa.build_level(level) for level in below)
    targets = [build_target(isa.arch, level) for level in levels]  # highest first
    if missing and not any(t.found() for t in targets):
        log.warning("C++ CPU ops disabled: %s; every CPU op runs its torch reference", missing)
        return CpuBuild(None, failures=(missing,))
    failures: list[str] = []
    for target in targets:
        level = target.level
        if missing and target.found() is None:
            failures.append(f"the {level} build is not prebuilt and cannot build ({missing})")
            continue
        cached = target.found() is not None
        try:
            path, seconds = _compile_and_load(target)
        except Exception as e:  # no compiler, a flag the compiler lacks ...
            failures.append(f"the {level} build failed ({_reason(e)})")
            continue
        info = _parse_info(str(torch.ops.diptych_cpu.build_info()))
        if failures:
            log.warning("C++ CPU ops: %s; running the %s build instead", "; ".join(failures), level)
        log.info("C++ CPU ops for ISA level %s ready in %.1f s (%s)", level, seconds, path)
        how = "loaded from the cache" if cached else "compiled (cached for the next start)"
        STARTUP.info("C++ CPU kernels (%s): %s in %.1f s", level, how, seconds)
        return CpuBuild(level, path, info, tuple(failures))
    log.warning(
        "C++ CPU ops disabled: %s; every CPU op runs its torch reference (slower)",
        "; ".join(failures),
    )
    return CpuBuild(None, failures=tuple(failures))


@dataclass(frozen=True)
class BuildTarget:
    """One ISA level's build: its name (keyed by everything that changes the binary),
    compiler flags and directory; `library` is the shared object it produces."""

    level: str
    name: str
    flags: tuple[str, ...]
    directory: Path

    @property
    def library(self) -> Path:
        return self.directory / f"{self.name}.so"

    def found(self) -> Path | None:
        """A built library to load: the image's ($DIPTYCH_PREBUILT_DIR, read-only), else
        this cache's; None if neither has it."""
        prebuilt = os.environ.get("DIPTYCH_PREBUILT_DIR")
        image = (
            [Path(prebuilt) / "torch_extensions" / self.name / self.library.name]
            if prebuilt
            else []
        )
        return next((p for p in [*image, self.library] if p.exists()), None)


def build_target(arch: str, level: str) -> BuildTarget:
    """The build `level` runs (amx: the avx512_bf16 one)."""
    level = cpu_isa.build_level(level)
    flags = ["-O3", *cpu_isa.compiler_flags(arch, level), "-fopenmp"]
    key = hashlib.sha256(
        b"".join(p.read_bytes() for p in [*_SOURCES, *sorted(_CSRC.glob("*.h"))])
        + torch.__version__.encode()
        + platform.machine().encode()
        + os.environ.get("CXX", "c++").encode()
        + " ".join(flags).encode()
    ).hexdigest()[:16]
    name = f"diptych_cpu_{level}_{key}"
    return BuildTarget(level, name, tuple(flags), _cache_root() / "torch_extensions" / name)


def _compile_and_load(target: BuildTarget) -> tuple[str, float]:
    """Load the level's library: prebuilt (an image's, `prebuild`'s), or compiled now.

    One process compiles a level at a time, under an `flock` on the build directory
    that the kernel releases when its holder exits, however it exits. (torch's
    extension builder marked a build with a lock file instead: a process killed
    mid-build, by a test's timeout say, left the file behind, and every later process
    waited on it forever.)"""
    t0 = time.perf_counter()
    built = target.found() or _compile_once(target)
    torch.ops.load_library(str(built))  # type: ignore[no-untyped-call,unused-ignore]
    return str(built), time.perf_counter() - t0


def _compile_once(target: BuildTarget) -> Path:
    """Compile the target's library into the cache unless another process did while
    this one waited for the lock; returns it."""
    with _build_lock(target):
        if not target.library.exists():
            compile_library(target, _SOURCES, target.library)
    return target.library


@contextlib.contextmanager
def _build_lock(target: BuildTarget) -> Iterator[None]:
    target.directory.mkdir(parents=True, exist_ok=True)
    with open(target.directory / "build.lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            STARTUP.info("C++ CPU kernels: waiting for another process's %s build", target.level)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def prebuild(level: str, arch: str | None = None) -> Path:
    """Compile `level`'s library into the cache without loading it, so a machine without
    that level (an image's build host) can build it for the machines that have it; a
    process there finds it and loads it in milliseconds, no compiler needed."""
    target = build_target(arch or platform.machine(), level)
    return target.library if target.library.exists() else _compile_once(target)


class BuildError(RuntimeError):
    """A compile or link step failed; the message holds the compiler's own output."""


def _run_compiler(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"{what} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")


# The torch headers every source includes. Parsing them is ~7 s of each source's
# compile (torch/library.h alone 6 s); compiled once per build into a precompiled
# header (GCC's .gch, ~17 s), a source takes ~2 s less than that: a level's build went
# from 184 to ~120 s of CPU here, most of a fresh machine's first minutes.
_PCH_INCLUDES = ("ATen/ATen.h", "ATen/Parallel.h", "torch/library.h")


def compile_library(target: BuildTarget, sources: list[Path], out: Path) -> None:
    """Compile `sources` with `target`'s flags in parallel and link them into `out`,
    which appears whole or not at all. Objects go to a directory of this call's own, so
    the compilers of a build whose process died (they run on) never write into it.
    The first source compiles beside the torch headers' precompiled header, the rest
    with it (without it, where the compiler cannot make one: the same objects)."""
    from torch.utils.cpp_extension import include_paths, library_paths

    out.parent.mkdir(parents=True, exist_ok=True)
    cxx = os.environ.get("CXX", "c++")
    defines = [f"-DTORCH_EXTENSION_NAME={target.name}", "-DTORCH_API_INCLUDE_EXTENSION_H"]
    includes = [f for p in include_paths() for f in ("-isystem", p)]
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=out.parent))
    base = [cxx, *defines, *includes, "-fPIC", "-std=c++20", *target.flags, "-w"]
    header = work / "torch_headers.h"
    header.write_text("".join(f"#include <{h}>\n" for h in _PCH_INCLUDES))

    def precompile() -> list[str]:
        try:
            _run_compiler([*base, "-x", "c++-header", str(header), "-o", f"{header}.gch"],
                          "precompiling the torch headers")  # fmt: skip
        except BuildError as e:
            log.info("no precompiled header (%s): each source parses the headers", _reason(e))
            return []
        return ["-include", str(header)]

    def compile_one(source: Path, pch: list[str]) -> str:
        obj = work / f"{source.stem}.o"
        _run_compiler([*base, *pch, "-c", str(source), "-o", str(obj)],
                      f"compiling {source.name}")  # fmt: skip
        return str(obj)

    try:
        jobs = max(1, min(len(sources), _usable_cpus()))
        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            first = pool.submit(compile_one, sources[0], [])
            pch = precompile() if len(sources) > 1 else []  # (one source: nothing to share)
            rest = list(pool.map(lambda s: compile_one(s, pch), sources[1:]))
            objects = [first.result(), *rest]
        partial = work / out.name
        libs = [*(f"-L{p}" for p in library_paths()), "-lc10", "-ltorch_cpu", "-ltorch"]
        _run_compiler([cxx, *objects, "-shared", "-fopenmp", *libs, "-o", str(partial)], "linking")
        partial.replace(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _missing_toolchain() -> str | None:
    """Why no level can build here at all (no compiler), or None."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx!r} not found: install g++, or set CXX)"
    return None


def _reason(e: Exception) -> str:
    """The line of a failed build that says why: the compiler's first error, else the
    exception's first line."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower() and "Error building" not in ln]
    return ((errors or lines or [type(e).__name__])[0])[:300]


def _parse_info(text: str) -> dict[str, int]:
    pairs = (item.split("=", 1) for item in text.split())
    return {k: int(v) for k, v in pairs}


def paged_decode_attention(
    q: torch.Tensor, layer: PagedLayer, batch: PagedBatch, out: torch.Tensor | None = None
) -> torch.Tensor:
    """q [B, H, D]; the layer's caches [blocks, block_size, KVH, D]; returns [B, H, D].
    The block table and the lengths must share one index dtype."""
    if out is None:
        out = torch.empty_like(q)
    torch.ops.diptych_cpu.paged_decode_attention(
        q, layer.k_cache, layer.v_cache, batch.block_table, batch.seq_lens, layer.scale,
        layer.window or 0, out,
    )  # fmt: skip
    return out


def det_attention(
    q: torch.Tensor,
    layer: PagedLayer,
    batch: PagedBatch,
    row_seq: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Batch-invariant attention (csrc/det_attention_cpu.cpp): q [N, H, D], each row one
    token over the first `batch.seq_lens[i]` tokens of sequence `row_seq[i]`, whose
    blocks are row `row_seq[i]` of `batch.block_table` (int32 throughout). A row's
    result depends on that row and the cache alone."""
    if out is None:
        out = torch.empty_like(q)
    op = (
        torch.ops.diptych_cpu.det_attention_amx
        if det_attention_on_amx(q.dtype, layer.k_cache.dtype, q.shape[-1])
        else torch.ops.diptych_cpu.det_attention
    )
    op(
        q, layer.k_cache, layer.v_cache, batch.block_table, batch.seq_lens, row_seq,
        layer.scale, layer.window or 0, out,
    )  # fmt: skip
    return out


def det_attention_on_amx(dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int) -> bool:
    """`det_attention` runs on AMX tiles (csrc/det_attention_amx.cpp) for these: a bf16
    query over a bf16 cache, head dims a multiple of 32, at the amx level. The choice
    depends on the model and the level alone, so every step of a run makes the same."""
    return (
        dtype == torch.bfloat16
        and cache_dtype == torch.bfloat16
        and head_dim % 32 == 0
        and amx_gemm_available()
    )


def det_attention_for_prompts(dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int) -> bool:
    """Prompts attend faster through `det_attention` over the cache than through torch's
    SDPA over their fresh K/V: a bf16 query and cache on a CPU with bf16 dot products.
    On an EPYC Zen 4 (avx512_bf16, 2 threads), one causal prompt: 0.63x / 0.77x / 0.90x
    SDPA's time at 256 / 1,024 / 4,096 tokens with 9 heads of 64 over 3 KV heads,
    0.58x / 0.63x / 0.80x with 32 heads of 128 over 8. Forced to avx2, or in fp32, it
    loses from ~1,000 tokens (1.2-1.8x at 1,024-4,096). On an AMX Xeon the
    deterministic mode's TTFT (this kernel on tiles) was 4 % under the default's.
    (docs/benchmarks.md, "Prompt attention on CPU"; python -m benchmarks.prompt_attention)"""
    return (
        dtype == torch.bfloat16
        and cache_dtype == torch.bfloat16
        and head_dim % 16 == 0
        and head_dim <= 256
        and cpu_ops_available()
        and cpu_isa.probe().at_least("avx512_bf16")
    )


# Largest row count the small-M linear kernel takes (see csrc/gemv_cpu.cpp), and the
# largest for which it beats the packed GEMMs (measured with AVX512-BF16: 47-59 GB/s
# of weights at 1-3 rows; from 4 rows the packed GEMM's blocking wins).
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


# Rows up to which the VNNI GEMM beats torch's own bf16 linear (above it both are
# compute-bound and torch's needs no second copy of the weight). The fp32-arithmetic
# GEMM takes every row count: on a CPU without bf16 instructions torch's bf16 linear
# has no fast path at any size.
PACKED_MAX_ROWS = 256
# With AMX (Sapphire Rapids and later) oneDNN's bf16 linear runs on the tile unit and
# wins from 3 rows at every size; the GEMV still wins at 1-2. Measured on a 2-vCPU Xeon,
# 576 x 1536 bf16: at 256 rows oneDNN on a prepacked weight 0.16 ms, the VNNI GEMM 1.93,
# torch's linear 0.19; at 8 rows 0.027 / 0.074 / 0.070; at 1 row the GEMV 0.015 and
# oneDNN 0.025. Our AMX GEMM (csrc/gemm_amx.cpp) takes the head (49152 x 576, fp32
# sums: 6.9 ms at 64 rows against the VNNI GEMM's 28). On the body it beat oneDNN at
# 8-64 rows (1536 x 576 hot: 0.044 / 0.145 ms against 0.078 / 0.193) but lost at a
# 1,024-token prompt in the engine (305 ms of linears against 253, cold weights), and
# one layout must serve every row count: the body stays on oneDNN.
AMX_GEMV_ROWS = 2


@functools.lru_cache(maxsize=1)
def amx_available() -> bool:
    """oneDNN's bf16 linear runs on AMX tiles here (and the ISA level allows it)."""
    return cpu_isa.probe().at_least("amx") and onednn_bf16_available()


@functools.lru_cache(maxsize=1)
def amx_gemm_available() -> bool:
    """Our fixed-order GEMM on AMX tiles (csrc/gemm_amx.cpp) runs here: the ISA level is
    amx, the build has it, and the OS lends this process the tile registers."""
    if not (cpu_isa.probe().at_least("amx") and _vnni_available()):
        return False
    return bool(torch.ops.diptych_cpu.gemm_amx_available())


@dataclass(frozen=True)
class PackedWeight:
    """A linear weight reordered once for batched matmuls. `kind`: "vnni" is our bf16
    GEMM's [N/16, K/2, 16, 2] layout (csrc/gemm_bf16.cpp), "amx" the same layout read by
    our AMX GEMM (csrc/gemm_amx.cpp), "f32acc" our fp32-arithmetic GEMM's [N/2L, K, L]
    pairs (csrc/gemm_f32acc.cpp), "onednn" oneDNN's blocked one."""

    data: torch.Tensor
    kind: str
    out_features: int
    # `pack_linear_weight(fixed_order=True)`: this layout's GEMM runs every row count,
    # so each output row's sum is computed in one order whatever the batch
    fixed_order: bool = False

    @property
    def max_rows(self) -> int | None:
        """Most rows this layout is worth using for (None: any)."""
        return PACKED_MAX_ROWS if self.kind == "vnni" and not self.fixed_order else None

    @property
    def serves_all_rows(self) -> bool:
        """True when `ops.linear` never needs the plain weight beside this copy."""
        return self.max_rows is None and self.gemv_rows == 0

    @property
    def gemv_rows(self) -> int:
        """Rows up to which the GEMV kernel on the plain weight is faster. The f32acc
        GEMM streams the weight faster than the widening GEMV even at one row (one
        load and two integer ops per 16 columns, no horizontal sums): 36.5 vs 18.4 GB/s
        with AVX2, 40 vs 19 with SSE2 on the dev VM."""
        if self.kind == "f32acc" or self.fixed_order:
            return 0
        if self.kind == "amx" or (self.kind == "onednn" and amx_available()):
            return AMX_GEMV_ROWS
        return SMALL_M_BEST


def onednn_bf16_available() -> bool:
    """oneDNN's bf16 linear, where it has real bf16 instructions: it needs AVX-512
    (torch checks the hardware, and raises on anything less, such as an AVX2-only
    CPU), and a level forced below AVX512-BF16 must not use it either."""
    if not cpu_isa.probe().at_least("avx512_bf16"):
        return False
    try:
        return bool(
            torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call, unused-ignore]  # unannotated in torch
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        )
    except (AttributeError, RuntimeError):
        return False


def _vnni_available() -> bool:
    return cpu_build().has("avx512_bf16")


def weight_prepack_available(dtype: torch.dtype) -> bool:
    """Whether bf16 linears can run on a weight packed once at load time.

    torch's `F.linear` on a plain bf16 weight reorders it into oneDNN's blocked layout
    on every call where the CPU has AVX-512, and has no fast bf16 path where it has
    not; our GEMMs read a layout packed once (and stream a cold weight faster).
    """
    if dtype != torch.bfloat16:
        return False
    return cpu_ops_available() or onednn_bf16_available()


def pack_linear_weight(
    weight: torch.Tensor, fp32_sums: bool = False, fixed_order: bool = False
) -> PackedWeight:
    """weight [N, K] (bf16, CPU) packed for `packed_linear`: oneDNN's layout where it
    runs on AMX; else the VNNI layout where the build has AVX512-BF16 and the shape
    allows (N % 32 == 0, K even), oneDNN's for other shapes there; our fp32-arithmetic
    layout everywhere else. `fp32_sums` (a caller that asks for `fp32_out`, the head)
    keeps our GEMMs on AMX too (oneDNN hands back only sums rounded to bf16): there the
    VNNI layout feeds our AMX GEMM where K % 32 == 0.

    `fixed_order` (the engine's `--deterministic`): one of our GEMMs for every row count,
    the AMX one where it runs and K % 32 == 0, else the VNNI one, else the
    fp32-arithmetic one. Each sums every output element over k in one fixed order at
    every M (a tile of any height does the same per-element chain), so a row's result
    never depends on the rows beside it; the GEMV and oneDNN, which sum in other
    orders, are not used. Which one a weight takes depends on its shape alone."""
    w = weight.detach().contiguous()
    n, k = w.shape
    vnni_shape = n % 32 == 0 and k % 2 == 0
    # our AMX GEMM: --deterministic's linears and the head's fp32 sums (the body's
    # default linears stay on oneDNN, faster at a long prompt's rows with a cold weight)
    amx = vnni_shape and k % 32 == 0 and (fixed_order or fp32_sums) and amx_gemm_available()
    if _vnni_available() and vnni_shape and (fp32_sums or fixed_order or not amx_available()):
        data = torch.ops.diptych_cpu.pack_vnni(w)
        return PackedWeight(data, "amx" if amx else "vnni", n, fixed_order)
    if cpu_ops_available() and fixed_order:
        return PackedWeight(torch.ops.diptych_cpu.pack_f32acc(w), "f32acc", n, True)
    if onednn_bf16_available():
        # the hint 64 is the batch size oneDNN tunes the layout for; any batch size works
        return PackedWeight(torch.ops.mkldnn._reorder_linear_weight(w, 64), "onednn", n)
    if cpu_ops_available():
        return PackedWeight(torch.ops.diptych_cpu.pack_f32acc(w), "f32acc", n)
    raise RuntimeError("no packed bf16 linear on this CPU (see weight_prepack_available)")


def packed_linear(
    x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None, fp32_out: bool = False
) -> torch.Tensor:
    """x [..., K] @ weight^T (+ bias) with a weight from `pack_linear_weight`;
    `fp32_out` returns fp32 (our GEMMs' unrounded sums; oneDNN's output widened)."""
    out: torch.Tensor
    if packed.kind in ("vnni", "amx", "f32acc"):
        flat = x.reshape(-1, x.shape[-1])
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        if packed.kind == "vnni":
            out = torch.ops.diptych_cpu.gemm_vnni(flat, packed.data, bias, fp32_out)
        elif packed.kind == "amx":
            out = torch.ops.diptych_cpu.gemm_amx(flat, packed.data, bias, fp32_out)
        else:
            out = torch.ops.diptych_cpu.gemm_f32acc(
                flat, packed.data, packed.out_features, bias, fp32_out
            )
        return out.view(*x.shape[:-1], out.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(x, packed.data, bias, "none", [], "")
    return out.float() if fp32_out else out


def auto_dtype() -> torch.dtype:
    """The fastest dtype that is exact enough on this CPU (`--dtype auto`): bf16
    wherever a bf16 matmul has a fast path, ours (bf16 dot products with AVX512-BF16,
    else bf16 weights widened to fp32 in registers: half the bytes a decode step
    streams, fp32 arithmetic) or oneDNN's; fp32 where only torch's slow bf16 is left."""
    if cpu_ops_available() or onednn_bf16_available():
        return torch.bfloat16
    return torch.float32


# (query heads per KV head, head dim) the register-tiled attention kernels take;
# other shapes run the generic kernel (csrc/paged_decode_cpu.cpp).
TILED_ATTENTION_GROUPS = range(1, 9)
TILED_ATTENTION_HEAD_DIMS = (64, 128)


def dispatch_report(
    dtype: torch.dtype | None = None,
    prepacked: bool = True,
    attention_shape: tuple[int, int] | None = None,
    kv_quantized: str = "",
) -> dict[str, str]:
    """Which implementation each CPU op takes for `dtype` (default: `auto_dtype()`) on
    this machine, with the ISA facts behind the choice: for the start-up log, the
    /metrics info of every worker and tests. `prepacked`: whether the linears have
    packed weights (`weight_prepack_available`, unless the engine was told not to);
    `attention_shape`: the model's (query heads per KV head, head dim); `kv_quantized`:
    the KV cache's quantized format, "int8" or "fp8" (`kernels.kv_quant`, read by the
    generic decode kernel), or "" for a cache in the model's dtype."""
    isa, build = cpu_isa.probe(), cpu_build()
    dtype = dtype or auto_dtype()
    bf16 = dtype == torch.bfloat16 and prepacked
    report = {
        "cpu": isa.model,
        "isa_level": isa.level,
        "isa_native": isa.native,
        "isa_forced": "yes" if isa.forced else "no",
        "features": " ".join(isa.shown_features()),
        "build": build.level or "none",
        "dtype": str(dtype).removeprefix("torch."),
        "aten": cpu_isa.aten_capability() or "unknown",
    }
    if build.level is None:
        gemm = "onednn" if bf16 and onednn_bf16_available() else "torch"
        return {**report, "gemv": "torch", "gemm": gemm, "attention": "torch",
                "elementwise": "torch"}  # fmt: skip
    dot = dtype == torch.bfloat16 and build.has("avx512_bf16")
    gemv = "bf16_dot" if dot else "widening"
    if not bf16:
        gemm = "torch"
    elif dot and not amx_available():
        gemm = "vnni"
    elif onednn_bf16_available():
        gemm = "onednn"
    else:
        gemm = gemv = "f32acc"  # the packed GEMM takes every row count
    tiled = attention_shape is None or (
        attention_shape[0] in TILED_ATTENTION_GROUPS
        and attention_shape[1] in TILED_ATTENTION_HEAD_DIMS
    )
    if kv_quantized:
        attention = f"generic_{kv_quantized}kv"
    elif not tiled or dtype not in (torch.bfloat16, torch.float32):
        attention = "generic"
    else:
        attention = "bf16_dot" if dot else "wide"
    return {
        **report,
        "gemv": gemv,
        "gemm": gemm,
        "attention": attention,
        "elementwise": "cpp",
    }


def describe_dispatch(
    dtype: torch.dtype,
    prepacked: bool = True,
    attention_shape: tuple[int, int] | None = None,
    kv_quantized: str = "",
) -> str:
    """One start-up log line: the CPU, its level and the path of every op."""
    r = dispatch_report(dtype, prepacked, attention_shape, kv_quantized)
    forced = f" (forced; CPU has {r['isa_native']})" if r["isa_forced"] == "yes" else ""
    return (
        f"CPU {r['cpu']}: ISA level {r['isa_level']}{forced}, C++ build {r['build']}, "
        f"ATen {r['aten']}; {r['dtype']}: linear {r['gemv']} GEMV / {r['gemm']} GEMM, "
        f"attention {r['attention']}, norms/rotary/SiLU {r['elementwise']}; "
        f"features: {r['features'] or 'none of note'}"
    )
