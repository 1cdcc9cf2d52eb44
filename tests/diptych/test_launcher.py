"""How the launcher explains a child that died: status or signal, last lines, a hint."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from diptych.launcher import Child, _hint


def _dead_child(code: str) -> Child:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = Child("decode-0", proc, "")
    assert proc.stdout is not None
    for line in proc.stdout:
        child.tail.append(line)
    child.eof.set()
    proc.wait(30)
    return child


def test_a_child_killed_by_sigill_gets_the_cpu_hint() -> None:
    child = _dead_child(
        "import os, signal\nprint('loading kernels', flush=True)\n"
        "os.kill(os.getpid(), signal.SIGILL)"
    )
    report = child.death_report()
    assert report.startswith("decode-0 was killed by SIGILL; its last lines:\n    loading kernels")
    assert "DIPTYCH_CPU_ISA=generic" in report


def test_only_the_last_lines_are_kept_and_shown() -> None:
    child = _dead_child("import sys\nfor i in range(40): print('line', i)\nsys.exit(3)")
    report = child.death_report()
    assert "exited with code 3" in report
    assert "line 39" in report and "line 31" not in report  # the last eight


def test_hints() -> None:
    assert "DIPTYCH_CPU_ISA" in _hint(1, ["RuntimeError: mkldnn_reorder_linear_weight: bf16 path"])
    assert "--port" in _hint(1, ["OSError: [Errno 98] Address already in use"])
    assert "-v" in _hint(1, ["ValueError: something else"])


def test_the_state_directory_is_tightened_to_its_owner(tmp_path: Path) -> None:
    import stat

    from diptych.launcher import private_dir

    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    private_dir(str(loose))
    private_dir(str(tmp_path / "new" / "state"))
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "new" / "state").stat().st_mode) == 0o700
