"""What this CPU can run, read once, and the instruction-set level the C++ ops use.

Every CPU kernel path is chosen from one `CpuIsa`: the features the CPU reports
(through torch's cpuinfo, which asks CPUID and the OS, or /proc/cpuinfo on older
torch), the highest level they allow, and the level in use, which
`DIPTYCH_CPU_ISA` may lower to test a fallback on a machine that has more:

    level         x86-64 compiler target                         what it adds
    generic       -march=x86-64 (SSE2; the ARMv8-A base on arm64) portable vector code
    avx2          -march=x86-64-v3 (AVX2, FMA, F16C, BMI)         256-bit FMA kernels
    avx512        -march=x86-64-v4 (AVX-512 F/BW/CD/DQ/VL)        512-bit kernels
    avx512_bf16   x86-64-v4 + AVX512-BF16 + AVX512-VNNI          bf16 dot products
    amx           the avx512_bf16 build                          bf16 linears on AMX
                                                                 tiles (AMX-BF16)

The amx level has no C++ build of its own: it runs the avx512_bf16 build
(`build_level`), whose one AMX kernel (csrc/gemm_amx.cpp, --deterministic's linear)
sits in functions compiled for the tile unit and runs only at this level. What the
level changes is which linears go to the tiles: oneDNN's, and under --deterministic
ours. Forcing avx512_bf16 on an AMX CPU (Sapphire Rapids and later) therefore runs
exactly the paths of a CPU with AVX512-BF16 but no AMX, such as AMD Zen 4 and 5.

`DIPTYCH_CPU_ISA=auto` (the default) takes the highest level the CPU has. A level
above that is never used (a warning says so and the CPU's own level is taken): an
instruction the CPU lacks must never run. A forced level also restricts the
libraries torch calls, by setting in this process's environment (inherited by
every process it starts) the variables they read when first used:
`ATEN_CPU_CAPABILITY`, `ONEDNN_MAX_CPU_ISA` and `MKL_ENABLE_INSTRUCTIONS`
(values the user set are kept). ATen reads its variable at its first vectorized
op: `restrict_libraries` must run before that, which importing `kernels` does.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

LEVELS = ("generic", "avx2", "avx512", "avx512_bf16", "amx")
ENV = "DIPTYCH_CPU_ISA"
# Every variable that forces a level (DIPTYCH_CPU_ISA and the library limits).
FORCING_VARIABLES = (ENV, "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")

# The features that decide a level, or that a log line or metric should show.
_X86_AVX2 = ("avx2", "fma3", "f16c", "bmi", "bmi2", "lzcnt")
_X86_AVX512 = ("avx512_f", "avx512_bw", "avx512_cd", "avx512_dq", "avx512_vl")
_X86_BF16 = ("avx512_bf16", "avx512_vnni")
_X86_AMX = ("amx_tile", "amx_bf16")
_SHOWN = (
    "avx2", "fma3", "avx512_f", "avx512_bw", "avx512_vl", "avx512_dq", "avx512_vnni",
    "avx512_bf16", "avx_vnni", "avx_ne_convert", "amx_tile", "amx_bf16", "amx_int8",
    "neon", "sve", "sve2", "bf16", "i8mm", "dot",
)  # fmt: skip

# /proc/cpuinfo flag -> the name torch's cpuinfo gives the same feature.
_PROC_NAMES = {
    "fma": "fma3", "bmi1": "bmi", "abm": "lzcnt", "avx512f": "avx512_f",
    "avx512bw": "avx512_bw", "avx512cd": "avx512_cd", "avx512dq": "avx512_dq",
    "avx512vl": "avx512_vl", "avx512_vnni": "avx512_vnni", "avx512_bf16": "avx512_bf16",
    "asimd": "neon", "asimddp": "dot", "bf16": "bf16", "i8mm": "i8mm", "sve": "sve",
    "sve2": "sve2",
}  # fmt: skip

_MARCH = {
    "generic": ["-march=x86-64"],
    "avx2": ["-march=x86-64-v3"],
    "avx512": ["-march=x86-64-v4"],
    "avx512_bf16": ["-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"],
}
# The C++ build each level runs: its own, but amx's is avx512_bf16's.
_BUILD = {"amx": "avx512_bf16"}
# What a forced level tells the libraries torch calls (ATen, oneDNN, MKL).
_LIBRARY_LIMITS = {
    "generic": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
                "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
               "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "avx512_bf16": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
                    "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "amx": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX",
            "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
}  # fmt: skip
# ATen's name for the capability each level allows at most.
_ATEN_CAP = {
    "generic": "DEFAULT", "avx2": "AVX2", "avx512": "AVX512", "avx512_bf16": "AVX512",
    "amx": "AVX512",
}  # fmt: skip
_ATEN_RANK = {"DEFAULT": 0, "AVX2": 1, "AVX512": 2}


@dataclass(frozen=True)
class CpuIsa:
    """The CPU's features and the instruction-set level the C++ ops are built for."""

    arch: str  # platform.machine(): x86_64, aarch64, ...
    model: str  # the CPU's marketing name, if known
    features: frozenset[str]  # torch cpuinfo names (avx2, avx512_bf16, neon, ...)
    native: str  # the highest level the features allow
    level: str  # the level in use: native, or lower where DIPTYCH_CPU_ISA asks

    @property
    def forced(self) -> bool:
        """True when the level in use is below what the CPU could run."""
        return LEVELS.index(self.level) < LEVELS.index(self.native)

    def at_least(self, level: str) -> bool:
        return LEVELS.index(self.level) >= LEVELS.index(_check_level(level))

    def shown_features(self) -> list[str]:
        return [f for f in _SHOWN if f in self.features]


def build_level(level: str) -> str:
    """The level whose C++ build `level` runs (itself, but amx runs avx512_bf16's)."""
    return _BUILD.get(_check_level(level), level)


# The distinct C++ builds, lowest first (every level but amx).
BUILD_LEVELS = tuple(level for level in LEVELS if level not in _BUILD)


def compiler_flags(arch: str, level: str) -> list[str]:
    """The target flags of a C++ build for `level`: exactly the instructions the level
    allows (never -march=native, which would bake in whatever the build machine has)."""
    _check_level(level)
    if arch in ("x86_64", "AMD64"):
        return list(_MARCH[build_level(level)])
    if arch in ("aarch64", "arm64"):
        return ["-march=armv8-a"]  # NEON is part of the base architecture
    return []


def _check_level(level: str) -> str:
    if level not in LEVELS:
        raise ValueError(f"unknown CPU ISA level {level!r}; use one of {', '.join(LEVELS)}")
    return level


def _features() -> tuple[str, frozenset[str]]:
    """(model name, feature names). torch's cpuinfo asks CPUID and the OS (so an
    emulator or a VM that hides a feature is seen as it is); /proc/cpuinfo is the
    fallback for a torch without `torch.cpu.get_capabilities`."""
    import torch

    caps = getattr(torch.cpu, "get_capabilities", None)
    if caps is not None:
        try:
            found = dict(caps())
            names = frozenset(k for k, v in found.items() if v is True)
            return str(found.get("cpu_name") or _proc_model()), names
        except Exception as e:  # a torch whose cpuinfo failed on this CPU
            log.warning("torch.cpu.get_capabilities failed (%s); reading /proc/cpuinfo", e)
    return _proc_model(), _proc_features()


def _proc_lines() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def _proc_model() -> str:
    for line in _proc_lines():
        if line.startswith(("model name", "Model", "CPU part")):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _proc_features() -> frozenset[str]:
    for line in _proc_lines():
        if line.startswith(("flags", "Features")):
            raw = line.split(":", 1)[1].split()
            return frozenset(_PROC_NAMES.get(f, f) for f in raw)
    return frozenset()


def native_level(arch: str, features: frozenset[str]) -> str:
    """The highest level whose every instruction the CPU reports."""
    if arch not in ("x86_64", "AMD64"):
        return "generic"
    if not all(f in features for f in _X86_AVX2):
        return "generic"
    if not all(f in features for f in _X86_AVX512):
        return "avx2"
    if not all(f in features for f in _X86_BF16):
        return "avx512"
    if not all(f in features for f in _X86_AMX):
        return "avx512_bf16"
    return "amx"


def choose_level(native: str, requested: str) -> str:
    """The level to use: `requested` ("auto" or a level), never above `native`."""
    requested = requested.strip().lower() or "auto"
    if requested in ("auto", "native"):
        return native
    _check_level(requested)
    if LEVELS.index(requested) > LEVELS.index(native):
        log.warning(
            "%s=%s asks for more than this CPU has (%s); using %s",
            ENV, requested, native, native,
        )  # fmt: skip
        return native
    return requested


@functools.lru_cache(maxsize=1)
def probe() -> CpuIsa:
    """The CPU's features and the level in use, read once per process."""
    arch = platform.machine()
    model, features = _features()
    native = native_level(arch, features)
    return CpuIsa(arch, model, features, native, choose_level(native, os.environ.get(ENV, "auto")))


def library_limits(isa: CpuIsa) -> dict[str, str]:
    """The environment that restricts ATen, oneDNN and MKL to a forced level ({} when
    the level is the CPU's own: then the libraries choose for themselves)."""
    if not isa.forced or isa.arch not in ("x86_64", "AMD64"):
        return {}
    return dict(_LIBRARY_LIMITS[isa.level])


def restrict_libraries() -> CpuIsa:
    """Probe, and put a forced level's library limits into the environment (keeping
    any the user set). Returns the probe. Warns if ATen had already chosen kernels
    above the level: its variable is read once, at its first vectorized op."""
    isa = probe()
    for key, value in library_limits(isa).items():
        os.environ.setdefault(key, value)
    if isa.forced:
        aten, allowed = aten_capability(), _ATEN_CAP[isa.level]
        if _ATEN_RANK.get(aten or "", 0) > _ATEN_RANK[allowed]:
            log.warning(
                "ATen already runs %s kernels, above %s=%s; set ATEN_CPU_CAPABILITY=%s in "
                "the environment before starting Python",
                aten, ENV, isa.level, _LIBRARY_LIMITS[isa.level]["ATEN_CPU_CAPABILITY"],
            )  # fmt: skip
    return isa


def aten_capability() -> str | None:
    """The vector capability ATen's own kernels run with (DEFAULT, AVX2, AVX512, ...)."""
    import torch

    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:
        return None


def forced_environment(level: str) -> dict[str, str]:
    """The environment that runs a whole process at `level` from its first
    instruction: DIPTYCH_CPU_ISA and the library limits (which ATen reads once, so a
    test or benchmark that forces a level sets them before Python starts)."""
    _check_level(level)
    return {ENV: level, **_LIBRARY_LIMITS[level]}


def main(argv: list[str]) -> int:
    """`python -m kernels` prints the probe; `python -m kernels --env LEVEL` prints
    KEY=VALUE lines of `forced_environment(LEVEL)` (for `env $(...) command`);
    `python -m kernels --prebuild LEVEL|all|here|native...` compiles the C++ CPU ops of
    those levels (all of them; those this CPU can run; the one it runs), in the order
    named, each once, into $DIPTYCH_CACHE_DIR (an image build: whatever CPU the host
    has; a test run, its own level before any test and the others beside the first
    tests; `scripts/install`, so that the first `diptych serve` finds them built)."""
    if argv[:1] == ["--prebuild"] and len(argv) > 1:
        from kernels.cpu_ops import prebuild

        wanted: list[str] = []  # in the order named, each build once
        for a in argv[1:]:
            if a == "all":
                wanted += BUILD_LEVELS
            elif a == "native":  # the build this CPU runs
                wanted.append(build_level(probe().level))
            elif a == "here":  # every build this CPU can run
                top = build_level(probe().native)
                wanted += BUILD_LEVELS[: BUILD_LEVELS.index(top) + 1]
            else:
                wanted.append(build_level(a))
        for level in dict.fromkeys(wanted):
            t0 = time.perf_counter()
            path = prebuild(level)
            print(f"{level}: {path} ({time.perf_counter() - t0:.0f} s)", flush=True)
        return 0
    if len(argv) == 2 and argv[0] == "--env":
        for key, value in forced_environment(argv[1]).items():
            print(f"{key}={value}")
        return 0
    if argv:
        print(
            "usage: python -m kernels [--env LEVEL | --prebuild LEVEL...|all|here|native]",
            file=sys.stderr,
        )
        return 2
    isa = probe()
    print(f"cpu {isa.model} ({isa.arch}); native level {isa.native}; in use {isa.level}")
    print("features:", " ".join(sorted(isa.features)))
    return 0
