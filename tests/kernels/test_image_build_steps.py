"""What an image build does ahead of time, done here: the C++ CPU ops compiled by
`python -m kernels --prebuild` load in a process with no compiler at all (the image's
runtime stage), and Triton's cache is filled for a GPU target with no GPU.

The Triton step (one core, ~20 s) starts with the module's first test and runs beside
the C++ ones (`triton_warm`), which mostly wait on one process at a time too."""

from __future__ import annotations

import concurrent.futures
import json
import os
import platform
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kernels.triton.record import KERNELS
from tests.kernels.conftest import KT, needs_triton
from tests.kernels.test_isa_levels import Background

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS = ROOT / "deploy" / "docker" / "build-steps.sh"
VENV = Path(sys.prefix)


def _forced(level: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "kernels", "--env", level], capture_output=True, text=True
    )
    return " ".join(out.stdout.split())


def test_prebuilt_cpu_ops_load_without_a_compiler() -> None:
    """The Dockerfiles' `kernels` and `smoke` steps, as they run them (one ISA level
    here, for time; the image builds all four). The library goes into this run's own
    cache: on a clean machine (CI) it is compiled here, and the generic-level leg of
    the suite then runs every kernel test on it."""
    from kernels.cpu_ops import _cache_root, build_target

    cache = _cache_root()
    env = {**os.environ, "DIPTYCH_PREBUILD_LEVELS": "generic"}
    built = subprocess.run(
        ["bash", str(STEPS), "kernels", str(VENV), str(cache)],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    library = build_target(platform.machine(), "generic").library
    assert library.is_relative_to(cache) and library.exists()
    assert "generic:" in built.stdout and str(library) in built.stdout
    smoke = subprocess.run(
        ["bash", str(STEPS), "smoke", str(VENV), str(cache)],
        env={**os.environ, "SMOKE_ENV": _forced("generic")},
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert smoke.returncode == 0, smoke.stdout[-3000:] + smoke.stderr[-3000:]
    assert f"C++ CPU ops generic loaded from {library}" in smoke.stdout
    assert "Paris" in smoke.stdout  # the default model answered, through those ops


@pytest.fixture(scope="module", autouse=True)
def triton_warm(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Path, Background] | None]:
    """The Dockerfile's Triton step for one GPU and one model (`engine.triton_warm`)
    into an empty cache, started when the module's first test starts, if the run
    selected its test: (the cache, the running step)."""
    selected = any(
        isinstance(item, pytest.Function)
        and item.module is request.module
        and item.originalname == "test_triton_cache_is_filled_for_a_gpu_without_one"
        for item in request.session.items
    )
    if KT is None or not selected:
        yield None
        return
    cache = tmp_path_factory.mktemp("triton-cache")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(cache), TRITON_DEFAULT_FP_FUSION="1")
    warm = Background(
        [sys.executable, "-m", "engine.triton_warm", "--arch", "90", "--model", "Llama-3.1-8B"],
        timeout=900, env=env, cwd=ROOT,
    )  # fmt: skip
    try:
        yield cache, warm
    finally:
        warm.kill()


@needs_triton
def test_triton_cache_is_filled_for_a_gpu_without_one(
    triton_warm: tuple[Path, Background] | None,
) -> None:
    assert triton_warm is not None
    cache, warm = triton_warm
    proc = warm.result()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    compiled = {
        p.stem: json.loads(p.read_text())
        for p in cache.glob("*/*.json")
        if not p.name.startswith("__grp__")
    }
    # every kernel a dense model launches (the grouped GEMM is a mixture of experts')
    dense = {name for _, name in KERNELS} - {"grouped_gemm_kernel"}
    assert dense <= set(compiled), sorted(compiled)
    assert all(m["target"]["arch"] == 90 for m in compiled.values())
    cubins = list(cache.glob("*/*.cubin"))
    assert len(cubins) >= len(dense) and all(c.stat().st_size > 0 for c in cubins)


@needs_triton
def test_a_mixture_of_experts_warms_its_grouped_gemm() -> None:
    """What the warm step records for Qwen3-30B-A3B includes the grouped GEMM at its
    expert shapes (compiling it for sm_80/sm_90 is tests/kernels/compile_check.py's)."""
    import torch

    from engine.triton_warm import cases, model_config
    from kernels.triton.record import record

    cfg = model_config("Qwen3-30B-A3B")
    launches = [
        launch for label, fn in cases(cfg, torch.bfloat16, 16, 132) if label.startswith("fused")
        for launch in record(fn)
    ]  # fmt: skip
    grouped = [args for fn, args, _ in launches
               if getattr(fn, "fn", fn).__name__ == "grouped_gemm_kernel"]  # fmt: skip
    assert len(grouped) == 4  # gate/up and down, at 1 and 64 tokens
    assert {tuple(args[1].shape) for args in grouped} == {(128, 1536, 2048), (128, 2048, 768)}


def test_the_prebuild_compile_and_link_lines_work(tmp_path: Path) -> None:
    """prebuild's own compiler and linker commands (above, the library may already be in
    the cache): one small source at the lowest and the highest level, compiled with
    that level's flags (for CPUs this host may not be) and linked against torch. The
    two builds (one compiler each, mostly parsing torch's headers) run side by side."""
    from kernels import cpu_isa
    from kernels.cpu_ops import _CSRC, build_target, compile_library

    def build(level: str) -> Path:
        target = build_target(platform.machine(), level)
        out = tmp_path / f"{level}.so"
        compile_library(target, [_CSRC / "build_info.cpp"], out)
        return out

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(build, (cpu_isa.LEVELS[0], cpu_isa.LEVELS[-1])))
    assert all(out.stat().st_size > 0 for out in outs)
    assert not list(tmp_path.glob("*.o")) and not list(tmp_path.glob(".build-*"))
