"""Run a child process to its end within a time limit, or kill its whole process group.

`subprocess.run(timeout=...)` kills only the child: the compilers of a C++ build it had
started ran on, and the test said no more than "timed out". Here a child that runs past
`timeout` is killed with everything it started, and the failure shows what it printed.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest


def run(
    cmd: Sequence[str],
    timeout: float,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen(
        list(cmd), env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(
            f"{' '.join(cmd)[:200]} ran past {timeout:.0f} s; its stderr ends:\n{err[-3000:]}"
            f"\nits stdout ends:\n{out[-1000:]}"
        )
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)
