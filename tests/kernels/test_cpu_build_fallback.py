"""A C++ build that fails is one warning and the next-best path, never a crash.

Each case runs in a fresh process with its own empty build cache and a compiler
that fails: one that rejects the flags of a level (as an old compiler rejects
-mavx512bf16), and one that does not exist (a machine with no toolchain).

Only the failing build is attempted: the level to fall to comes prebuilt (as in an
image), so no case compiles the whole kernel source again (that took ~100 s, and
proved only that the compiler works, which the prebuild already does), and the
converted tokenizer comes from the shared cache (it has nothing to do with builds).
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kernels import cpu_isa, cpu_ops
from tests import child
from tests.kernels.test_isa_levels import check_level, run_child

pytestmark = pytest.mark.slow


def _compiler_rejecting(tmp_path: Path, flag: str) -> str:
    """A c++ that fails on `flag` and otherwise runs the real one."""
    real = os.environ.get("CXX", "c++")
    path = tmp_path / "c++"
    path.write_text(
        "#!/bin/sh\n"
        f'for a in "$@"; do [ "$a" = "{flag}" ] && '
        f"{{ echo \"c++: error: unrecognized command-line option '{flag}'\" >&2; exit 1; }}; done\n"
        f'exec {real} "$@"\n'
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def _prebuilt(tmp_path: Path, cxx: str, level: str) -> Path:
    """A $DIPTYCH_PREBUILT_DIR holding `level`'s library as a process with this `cxx`
    looks for it (the build's name is keyed by the compiler): this process's cache's
    build (scripts/test prebuilt it; compiled here otherwise), copied. Returns the file."""
    built = cpu_ops.prebuild(level)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CXX", cxx)
        name = cpu_ops.build_target(platform.machine(), level).name
    seeded = tmp_path / "prebuilt" / "torch_extensions" / name / f"{name}.so"
    seeded.parent.mkdir(parents=True)
    shutil.copyfile(built, seeded)
    return seeded


def _shared_tokenizers(cache: Path) -> None:
    """Give the empty cache `cache` the converted tokenizers of this process's cache
    (converting the default model's takes seconds and has nothing to do with builds)."""
    from engine.tokenizer import tokenizer_cache_root

    shared = tokenizer_cache_root()
    shared.mkdir(parents=True, exist_ok=True)
    cache.mkdir(parents=True)
    (cache / "tokenizers").symlink_to(shared, target_is_directory=True)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 levels")
def test_a_level_that_fails_to_build_falls_to_the_next(tmp_path: Path) -> None:
    if cpu_isa.probe().native == "generic":
        pytest.skip("this CPU has no level below its own to fall to")
    cxx = _compiler_rejecting(tmp_path, "-march=x86-64-v3")
    generic = _prebuilt(tmp_path, cxx, "generic")
    cache = tmp_path / "cache"
    env = {
        **cpu_isa.forced_environment("avx2"),
        "CXX": cxx,
        "DIPTYCH_CACHE_DIR": str(cache),
        "DIPTYCH_PREBUILT_DIR": str(tmp_path / "prebuilt"),
    }
    out = run_child(env)
    # the avx2 build was attempted (nothing had it) and failed on the compiler's error
    assert len(out["build_failures"]) == 1
    assert "the avx2 build failed" in out["build_failures"][0]
    assert "unrecognized command-line option" in out["build_failures"][0]
    assert not list(cache.glob("torch_extensions/*/*.so"))
    # the ops run the generic build's kernels: correct, on the next-best path
    assert out["build_path"] == str(generic)
    check_level(out, "avx2", build="generic")


def test_no_compiler_serves_on_the_torch_path(tmp_path: Path) -> None:
    env = {"CXX": str(tmp_path / "no-such-c++"), "DIPTYCH_CACHE_DIR": str(tmp_path / "cache")}
    _shared_tokenizers(tmp_path / "cache")
    out = run_child(env, "--engine")
    assert out["build"] is None
    assert out["build_failures"] == [
        f"no C++ compiler ({env['CXX']!r} not found: install g++, or set CXX)"
    ]
    report = out["report"]
    assert report["build"] == "none" and report["attention"] == report["gemv"] == "torch"
    assert out["attention_err"]["float32"] < 1e-5
    if out["onednn_bf16"]:  # oneDNN's own bf16 instructions are still worth bf16
        assert out["auto_dtype"] == "bfloat16" and out["pack"] == "onednn"
    else:  # only torch's emulated bf16 is left: fp32 is faster
        assert out["auto_dtype"] == "float32" and out["pack"] == "none"
    assert out["engine"]["text"].startswith(" Paris"), out["engine"]["text"]


def test_a_build_killed_midway_does_not_hold_up_the_next(tmp_path: Path) -> None:
    """A process killed while its compilers run (a test's timeout, an OOM kill) leaves
    nothing that makes the next one wait: torch's extension builder left a lock file,
    and every later process waited on it forever (the forced-level tests timed out one
    after another on a machine where the first build ran past its test's limit)."""
    cxx = tmp_path / "c++"
    cxx.write_text(
        '#!/bin/sh\n[ "$FAKE_CXX" = hang ] && exec sleep 600\n'
        'echo "c++: error: this compiler builds nothing" >&2; exit 1\n'
    )
    cxx.chmod(cxx.stat().st_mode | stat.S_IXUSR)
    cache = tmp_path / "cache"
    env = {**os.environ, "CXX": str(cxx), "DIPTYCH_CACHE_DIR": str(cache)}
    code = "from kernels import cpu_ops; print(cpu_ops.cpu_build().failures)"
    first = subprocess.Popen(
        [sys.executable, "-c", code], env={**env, "FAKE_CXX": "hang"}, start_new_session=True
    )
    try:
        end = time.monotonic() + 60
        while not list(cache.glob("torch_extensions/*/.build-*")) and time.monotonic() < end:
            time.sleep(0.1)
        assert list(cache.glob("torch_extensions/*/.build-*")), "the first build never started"
        os.kill(first.pid, signal.SIGKILL)  # its compilers (sleep 600) run on
        first.wait()
        second = child.run([sys.executable, "-c", code], timeout=60, env=env)
        assert second.returncode == 0, second.stderr[-2000:]
        assert "this compiler builds nothing" in second.stdout
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first.pid, signal.SIGKILL)
