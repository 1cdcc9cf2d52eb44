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


def _all_gone(pids: list[int], within: float = 30.0) -> bool:
    end = time.monotonic() + within
    while any(_alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.2)
    return not any(_alive(p) for p in pids)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_stops_every_process(tmp_path: Path, sig: signal.Signals) -> None:
    # the simulated engine: what is under test is the process tree, not the model
    server = Server(tmp_path, "--engine", "sim", "--kv-cache-memory", "0.1")
    pids = [c["pid"] for c in server.manifest.values()]
    assert len(pids) == 3 and all(_alive(p) for p in pids)
    server.proc.send_signal(sig)
    assert server.proc.wait(60) == 0
    assert _all_gone(pids)


# A child that runs the CLI and sends itself SIGINT at one moment of start-up: while
# the parser is built (stage "parser"), or while a module whose name starts with the
# stage is imported
# (transformers: the engine's heaviest import, where a Ctrl-C used to land). SIGINT is
# a terminal's Ctrl-C in it even when the suite runs in the background of a shell
# without job control, which starts its children with SIGINT ignored.
_INTERRUPT_AT = """
import importlib.abc, os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
from diptych import cli
stage, argv = sys.argv[1], sys.argv[2:]
def interrupt():
    os.kill(os.getpid(), signal.SIGINT)
if stage == "parser":
    build = cli.build_parser
    cli.build_parser = lambda: (interrupt(), build())[1]
else:
    class Trigger(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.startswith(stage):
                sys.meta_path.remove(self)
                interrupt()
            return None
    sys.meta_path.insert(0, Trigger())
sys.exit(cli.main(argv))
"""


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def test_building_the_parser_imports_no_engine() -> None:
    code = (
        "import sys; from diptych import cli; cli.build_parser(); "
        "print([m for m in ('torch', 'transformers', 'engine.engine_core') if m in sys.modules])"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.stdout.strip() == "[]", run.stdout + run.stderr


@pytest.mark.parametrize(
    "stage,argv",
    [
        ("parser", ["serve", "--kv-cache-memory", "0.1"]),
        ("transformers", ["generate", "hello", "--max-tokens", "2"]),
        ("transformers", ["profile", "--repeats", "1"]),
    ],
)
def test_interrupt_while_starting_up_is_one_line(stage: str, argv: list[str]) -> None:
    run = subprocess.run(
        [sys.executable, "-c", _INTERRUPT_AT, stage, *argv],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 1, run.stderr[-2000:]
    assert "interrupted" in run.stderr and "Traceback" not in run.stderr, run.stderr[-2000:]


def test_interrupt_while_the_workers_start(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "diptych.cli", "serve", "--port", str(free_port()),
         "--state-dir", str(tmp_path), "--kv-cache-memory", "0.1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    end = time.monotonic() + 60
    while not (workers := _children(proc.pid)) and time.monotonic() < end:
        time.sleep(0.05)  # until the launcher has started its first worker
    assert workers, "diptych serve started no worker within 60 s"
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 1 and "interrupted" in out, out[-2000:]
    assert "Traceback" not in out, out[-2000:]
    assert _all_gone(workers)


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


def test_a_model_that_is_not_there_is_said_in_one_line_by_every_role(tmp_path: Path) -> None:
    """The user's mistake, not a bug: each role names the missing model in one line (no
    traceback, whichever role meets it first), and serve reports the worker."""
    missing = tmp_path / "no-such-model.gguf"
    cmd = [
        sys.executable, "-m", "diptych.cli", "serve", "--model", str(missing),
        "--prefill-workers", "0", "--port", str(free_port()),
        "--state-dir", str(tmp_path / "state"),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    err = proc.stderr
    assert "Traceback" not in err, err[-3000:]
    assert f"diptych decode: model '{missing}' not found" in err, err[-3000:]
    assert "did not start" in err
