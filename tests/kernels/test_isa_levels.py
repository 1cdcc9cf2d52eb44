"""Every ISA level this CPU can run, each in a fresh process: the dispatch choice of
every op, its result against the torch reference, and the instructions in the build.

Levels below the CPU's own are forced (`kernels.cpu_isa.forced_environment`). Two
CPUs without AVX-512 run for real under QEMU's user-mode emulator, which reports
their CPUID and faults on any instruction they lack: a Zen 3 (EPYC-Milan, AVX2 and
FMA, the CPU whose workers crashed at start) and a Sandy Bridge (AVX, no AVX2).
Each of those runs for a minute or more on one core, so both start with the module's
first test and run beside the native levels' tests (`emulated`), not after them.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kernels import cpu_isa
from tests import child

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
NATIVE = cpu_isa.probe().native
X86 = platform.machine() in ("x86_64", "AMD64")

# What each level must choose: its C++ build's vector lanes, the bf16 linear layout,
# the attention kernel, and ATen's own capability.
EXPECT: dict[str, dict[str, Any]] = {
    "generic": {"lanes": 4, "pack": "f32acc", "attention": "wide", "aten": "DEFAULT"},
    "avx2": {"lanes": 8, "pack": "f32acc", "attention": "wide", "aten": "AVX2"},
    "avx512": {"lanes": 16, "pack": "f32acc", "attention": "wide", "aten": "AVX512"},
    "avx512_bf16": {"lanes": 16, "pack": "vnni", "attention": "bf16_dot", "aten": "AVX512"},
    # the avx512_bf16 build; oneDNN runs every body linear above the GEMV's rows on AMX
    "amx": {"lanes": 16, "pack": "onednn", "attention": "bf16_dot", "aten": "AVX512"},
}
BF16_LEVELS = ("avx512_bf16", "amx")
# Instructions a level's build must not contain (objdump spelling), and one it must.
FORBIDDEN = {
    "generic": re.compile(r"%ymm|%zmm|vfmadd"),
    "avx2": re.compile(r"%zmm|%k[0-7]|\{1to"),
    "avx512": re.compile(r"vdpbf16ps|vcvtne2?ps2bf16|vpdpbusd"),
    "avx512_bf16": None,
    "amx": None,
}
REQUIRED = {
    "generic": "mulps", "avx2": "vfmadd", "avx512": "%zmm", "avx512_bf16": "vdpbf16ps",
    "amx": "tdpbf16ps",  # (the avx512_bf16 build: --deterministic's GEMM on AMX tiles)
}  # fmt: skip


def _child_command(
    env: dict[str, str], args: tuple[str, ...], prefix: tuple[str, ...]
) -> tuple[list[str], dict[str, str]]:
    base = {k: v for k, v in os.environ.items() if k not in cpu_isa.FORCING_VARIABLES}
    return [*prefix, sys.executable, "-m", "tests.kernels.isa_child", *args], {**base, **env}


def _child_result(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


# A child's limit: its own work, plus, in a whole run, waiting for its level's build,
# which scripts/test starts beside the first tests (a few minutes at most).
CHILD_TIMEOUT = 900


def run_child(env: dict[str, str], *args: str, prefix: tuple[str, ...] = ()) -> dict[str, Any]:
    cmd, full_env = _child_command(env, args, prefix)
    return _child_result(child.run(cmd, timeout=CHILD_TIMEOUT, env=full_env, cwd=ROOT))


class Background:
    """A child process started now and read later, so that it runs while this process
    does other work: `result()` waits for it within `timeout` seconds of its start, or
    kills it with everything it started (as `tests.child.run` does) and fails. Its
    output goes to files, which never fill up as an unread pipe would."""

    def __init__(
        self,
        cmd: Sequence[str],
        timeout: float,
        env: dict[str, str] | None = None,
        cwd: str | Path | None = None,
    ) -> None:
        self.cmd, self.timeout = list(cmd), timeout
        self._logs = Path(tempfile.mkdtemp(prefix="diptych-child-"))
        with open(self._logs / "out", "w") as out, open(self._logs / "err", "w") as err:
            self._proc = subprocess.Popen(
                self.cmd, env=env, cwd=cwd, stdout=out, stderr=err,
                start_new_session=True,
            )  # fmt: skip
        self._end = time.monotonic() + timeout
        self._done: subprocess.CompletedProcess[str] | None = None

    def result(self) -> subprocess.CompletedProcess[str]:
        if self._done is None:
            try:
                self._proc.wait(timeout=max(0.0, self._end - time.monotonic()))
                timed_out = False
            except subprocess.TimeoutExpired:
                self._stop()
                timed_out = True
            out, err = ((self._logs / name).read_text() for name in ("out", "err"))
            shutil.rmtree(self._logs, ignore_errors=True)
            if timed_out:
                pytest.fail(
                    f"{' '.join(self.cmd)[:200]} ran past {self.timeout:.0f} s; its stderr "
                    f"ends:\n{err[-3000:]}\nits stdout ends:\n{out[-1000:]}"
                )
            self._done = subprocess.CompletedProcess(self.cmd, self._proc.returncode, out, err)
        return self._done

    def kill(self) -> None:
        """End the child and everything it started, if it still runs, and drop its
        output files."""
        self._stop()
        shutil.rmtree(self._logs, ignore_errors=True)

    def _stop(self) -> None:
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()


def check_level(out: dict[str, Any], level: str, build: str | None = None) -> None:
    """The child ran at `level` with the C++ ops of `build` (the same level unless
    that one failed to build): every path and result as they should be."""
    build = build or cpu_isa.build_level(level)
    want = EXPECT[build]
    assert out["level"] == level and out["build"] == build
    info = out["build_info"]
    assert info["vec_lanes"] == info["f32acc_lanes"] == want["lanes"]
    assert info["avx512_bf16"] == (build == "avx512_bf16")
    assert info["avx512f"] == build.startswith("avx512")
    assert info["avx2"] == (build != "generic")
    # with AMX, oneDNN runs every body linear above the GEMV's rows (the head: ours);
    # an AMX CPU forced to avx512_bf16 runs our VNNI GEMM, as a Zen 4 or 5 does
    pack = EXPECT[level if build == cpu_isa.build_level(level) else build]["pack"]
    assert out["pack"] == pack == out["report"]["gemm"]
    assert out["amx"] == (level == "amx")
    # oneDNN's bf16 linear only where the CPU and the level have bf16 instructions
    assert out["onednn_bf16"] is False or level in BF16_LEVELS
    assert out["pack_odd"] in (("onednn", "f32acc") if level in BF16_LEVELS else ("f32acc",))
    assert out["report"]["attention"] == want["attention"]
    assert out["aten"] == EXPECT[level]["aten"]
    assert out["auto_dtype"] == "bfloat16"
    assert max(out["linear_err"].values()) < 1e-4  # fp32 sums of exact bf16 products
    assert out["attention_err"]["float32"] < 1e-5
    assert out["attention_err"]["bfloat16"] < 2e-2


@pytest.mark.parametrize("level", cpu_isa.LEVELS)
def test_each_level_dispatches_and_computes_correctly(level: str) -> None:
    if not X86:
        pytest.skip("the levels are x86-64's")
    if cpu_isa.LEVELS.index(level) > cpu_isa.LEVELS.index(NATIVE):
        pytest.skip(f"this CPU runs at most {NATIVE}")
    env = {} if level == NATIVE else cpu_isa.forced_environment(level)
    out = run_child(env)
    check_level(out, level)
    assert out["native"] == NATIVE
    objdump = shutil.which("objdump")
    assert objdump, "objdump (binutils) is needed to audit the build's instructions"
    asm = subprocess.run(
        [objdump, "-d", "--no-show-raw-insn", out["build_path"]],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    bad = FORBIDDEN[level]
    if bad is not None:
        hit = bad.search(asm)
        assert hit is None, f"the {level} build contains {hit.group(0)!r}"
    assert REQUIRED[level] in asm


def _qemu() -> str:
    qemu = shutil.which("qemu-x86_64")
    if qemu is None:
        if os.environ.get("DIPTYCH_REQUIRE_QEMU") == "1":
            raise RuntimeError("qemu-x86_64 (Debian's qemu-user) is needed for these tests")
        pytest.skip("qemu-x86_64 is not installed")
    return qemu


# (QEMU's CPU model, the level it has, whether the child also serves the default model)
EMULATED = [("EPYC-Milan", "avx2", True), ("SandyBridge", "generic", False)]


@pytest.fixture(scope="module", autouse=True)
def emulated(request: pytest.FixtureRequest) -> Iterator[dict[str, Background]]:
    """The children of the emulated CPUs this run selected, started when the module's
    first test starts: each takes a minute or more on one core (the Milan one ~100 s;
    ~230 s on a Zen 3 host), so they run beside the other tests instead of one after
    another at the end. A CPU whose level is this host's own (an AVX2-only host and the
    Milan model) runs natively: the host is that CPU, no emulation needed."""
    qemu = shutil.which("qemu-x86_64")
    wanted = {
        item.callspec.params["cpu"]
        for item in request.session.items
        if isinstance(item, pytest.Function)
        and item.module is request.module
        and item.originalname == "test_a_cpu_without_avx512_serves"
    }
    started: dict[str, Background] = {}
    if X86:
        for cpu, level, engine in EMULATED:
            if cpu in wanted and (qemu or level == NATIVE):
                args = ("--engine",) if engine else ()
                under = () if level == NATIVE or qemu is None else (qemu, "-cpu", cpu)
                cmd, env = _child_command({}, args, under)
                started[cpu] = Background(cmd, timeout=CHILD_TIMEOUT, env=env, cwd=ROOT)
    try:
        yield started
    finally:
        for background in started.values():
            background.kill()


@pytest.mark.parametrize("cpu,level,engine", EMULATED)
def test_a_cpu_without_avx512_serves(
    cpu: str, level: str, engine: bool, emulated: dict[str, Background]
) -> None:
    """Under emulation the CPU itself has no AVX-512 (CPUID says so and those
    instructions fault), so this is the native path such a machine takes, not a
    forced one: before the capability probe, packing a bf16 weight died here with
    "mkldnn_reorder_linear_weight: bf16 path needs ... avx512bw"."""
    if not X86:
        pytest.skip("emulates x86-64 CPUs")
    if level != NATIVE:
        _qemu()
    out = _child_result(emulated[cpu].result())
    assert out["native"] == level, out["model"]
    check_level(out, level)
    if engine:
        assert out["engine"]["paths"]["gemm"] == "f32acc"
        assert out["engine"]["text"].startswith(" Paris"), out["engine"]["text"]
