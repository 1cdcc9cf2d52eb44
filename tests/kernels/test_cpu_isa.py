"""The CPU capability probe's pure parts: levels from feature sets, the forced level,
the compiler flags and library limits each level gets."""

from __future__ import annotations

import pytest

from kernels import cpu_isa
from kernels.cpu_isa import CpuIsa, choose_level, compiler_flags, native_level

# Feature sets as torch's cpuinfo names them, for CPUs this project has met or will.
ZEN3 = frozenset({"sse4_2", "avx", "avx2", "fma3", "f16c", "bmi", "bmi2", "lzcnt", "popcnt"})
SKYLAKE_X = ZEN3 | {"avx512_f", "avx512_bw", "avx512_cd", "avx512_dq", "avx512_vl"}
ICELAKE = SKYLAKE_X | {"avx512_vnni", "avx512_vbmi"}
ZEN4 = ICELAKE | {"avx512_bf16", "avx_vnni"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_tile", "amx_bf16", "amx_int8"}
SANDY_BRIDGE = frozenset({"sse4_2", "avx", "popcnt"})
GRAVITON3 = frozenset({"neon", "sve", "bf16", "i8mm", "dot"})


@pytest.mark.parametrize(
    "arch,features,level",
    [
        ("x86_64", SANDY_BRIDGE, "generic"),
        ("x86_64", ZEN3 - {"fma3"}, "generic"),  # AVX2 without FMA is not x86-64-v3
        ("x86_64", ZEN3, "avx2"),
        ("x86_64", SKYLAKE_X, "avx512"),
        ("x86_64", ICELAKE, "avx512"),  # VNNI but no BF16
        ("x86_64", ZEN4, "avx512_bf16"),
        ("x86_64", SAPPHIRE_RAPIDS, "amx"),
        ("x86_64", SAPPHIRE_RAPIDS - {"amx_bf16"}, "avx512_bf16"),  # AMX-INT8 tiles only
        ("x86_64", ZEN4 - {"avx512_vl"}, "avx2"),  # every AVX-512 part of x86-64-v4, or none
        ("aarch64", GRAVITON3, "generic"),
        ("aarch64", ZEN4, "generic"),  # x86 names on another architecture mean nothing
    ],
)
def test_native_level(arch: str, features: frozenset[str], level: str) -> None:
    assert native_level(arch, features) == level


def test_a_forced_level_is_never_above_the_cpu(caplog: pytest.LogCaptureFixture) -> None:
    assert choose_level("avx512_bf16", "auto") == "avx512_bf16"
    assert choose_level("avx512_bf16", "native") == "avx512_bf16"
    assert choose_level("avx512_bf16", " AVX2 ") == "avx2"
    assert choose_level("avx512_bf16", "generic") == "generic"
    assert choose_level("avx2", "avx512_bf16") == "avx2"
    assert "asks for more than this CPU has" in caplog.text
    with pytest.raises(ValueError, match="unknown CPU ISA level 'sse9'"):
        choose_level("avx2", "sse9")


def test_flags_name_exactly_the_level() -> None:
    assert compiler_flags("x86_64", "generic") == ["-march=x86-64"]
    assert compiler_flags("x86_64", "avx2") == ["-march=x86-64-v3"]
    assert compiler_flags("x86_64", "avx512") == ["-march=x86-64-v4"]
    assert compiler_flags("x86_64", "avx512_bf16") == [
        "-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni",
    ]  # fmt: skip
    # AMX changes which linears oneDNN runs, not our build: amx runs avx512_bf16's
    assert compiler_flags("x86_64", "amx") == compiler_flags("x86_64", "avx512_bf16")
    assert cpu_isa.build_level("amx") == "avx512_bf16" and "amx" not in cpu_isa.BUILD_LEVELS
    assert compiler_flags("aarch64", "generic") == ["-march=armv8-a"]
    for level in cpu_isa.LEVELS:
        assert not any("native" in f for f in compiler_flags("x86_64", level))


def _isa(level: str, native: str) -> CpuIsa:
    return CpuIsa("x86_64", "test CPU", ZEN4, native, level)


def test_libraries_are_limited_only_when_forced() -> None:
    assert cpu_isa.library_limits(_isa("avx512_bf16", "avx512_bf16")) == {}
    assert cpu_isa.library_limits(_isa("avx2", "avx512_bf16")) == {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    }
    assert cpu_isa.library_limits(_isa("generic", "avx2"))["ATEN_CPU_CAPABILITY"] == "default"
    assert _isa("avx2", "avx512_bf16").forced and not _isa("avx2", "avx2").forced
    # an AMX CPU forced to avx512_bf16 keeps oneDNN off the tiles: a Zen 4/5's paths
    assert cpu_isa.library_limits(_isa("avx512_bf16", "amx"))["ONEDNN_MAX_CPU_ISA"] == (
        "AVX512_CORE_BF16"
    )
    assert cpu_isa.forced_environment("avx512") == {
        "DIPTYCH_CPU_ISA": "avx512",
        "ATEN_CPU_CAPABILITY": "avx512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
    }


def test_this_process_probe_is_consistent() -> None:
    isa = cpu_isa.probe()
    assert isa.native == native_level(isa.arch, isa.features)
    assert cpu_isa.LEVELS.index(isa.level) <= cpu_isa.LEVELS.index(isa.native)
    assert isa.at_least("generic") and isa.at_least(isa.level)
