"""`diptych serve` stops every process on SIGINT or SIGTERM, also during start-up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.serving import Server, free_port

pytestmark = pytest.mark.slow


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_stops_every_process(tmp_path: Path, sig: signal.Signals) -> None:
    server = Server(tmp_path, "--kv-cache-memory", "0.1")
    pids = [c["pid"] for c in server.manifest.values()]
    assert len(pids) == 3 and all(_alive(p) for p in pids)
    server.proc.send_signal(sig)
    assert server.proc.wait(60) == 0
    end = time.monotonic() + 30
    while any(_alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids)


def test_interrupt_during_startup(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "diptych.cli", "serve", "--port", str(free_port()),
         "--state-dir", str(tmp_path), "--kv-cache-memory", "0.1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    time.sleep(3)  # the workers are loading the model
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 1 and "interrupted" in out, out[-2000:]


def test_a_worker_that_dies_at_start_is_reported_with_its_last_lines(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file at all" * 10)
    port = free_port()
    cmd = [
        sys.executable, "-m", "diptych.cli", "serve", "--model", str(broken),
        "--prefill-workers", "0", "--port", str(port), "--state-dir", str(tmp_path / "state"),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    err = proc.stderr
    assert "diptych serve: decode-0 did not start: decode-0 exited with code 1" in err
    report = err[err.index("did not start") :]
    assert "its last lines:" in report and "hint:" in report
    assert "gguf" in report.lower()  # the worker's own error is in the report
    assert "Diptych is serving" not in proc.stdout
