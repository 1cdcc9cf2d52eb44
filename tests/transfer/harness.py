"""Peer processes for the two-process transfer tests, and prerequisite checks.

Prerequisites are required, not optional: without nixl, ucxx, or the right
to create a network namespace (root), the tests that need them FAIL with the
reason. For a local run on a machine that lacks them, set
``DIPTYCH_TRANSFER_OPTIONAL=1`` to turn those failures into skips.

Peers on nixl and ucx (whose listeners bind every interface) run inside one
private network namespace per test session; shm and tcp peers only use
loopback and abstract Unix sockets and run as ordinary processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from transfer.backends import available

OPTIONAL = os.environ.get("DIPTYCH_TRANSFER_OPTIONAL") == "1"
PEER = Path(__file__).with_name("peer.py")
CALL_TIMEOUT = 60.0


def require(ok: bool, why: str) -> None:
    """Fail (CI default) or skip (DIPTYCH_TRANSFER_OPTIONAL=1) when `ok` is false."""
    if ok:
        return
    if OPTIONAL:
        pytest.skip(why)
    pytest.fail(f"{why} (set DIPTYCH_TRANSFER_OPTIONAL=1 to skip locally)", pytrace=False)


def require_backend(kind: str) -> None:
    if kind == "nixl":
        require(
            available("nixl"),
            "nixl is not installed: pip install nixl-cu12 && pip install --no-deps nixl",
        )
    elif kind == "ucx":
        require(available("ucx"), "ucxx is not installed: pip install ucxx-cu12")


class PeerError(RuntimeError):
    def __init__(self, reply: dict[str, Any]) -> None:
        super().__init__(f"{reply['type']}: {reply['error']}\n{reply.get('trace', '')}")
        self.type = reply["type"]
        self.error = reply["error"]


class PeerProcess:
    """One `peer.py` process; `call` runs an op and returns its result."""

    def __init__(self, netns: str | None, log: Path) -> None:
        cmd = [sys.executable, str(PEER)] + (["--netns", netns] if netns else [])
        self.log = log
        self._log_f = log.open("w")
        env = {**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n", "NIXL_LOG_LEVEL": "WARNING"}
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log_f,
            text=True,
            env=env,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put("")

    def call(self, op: str, timeout: float = CALL_TIMEOUT, **kw: Any) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"peer op {op} timed out; log:\n{self.tail()}") from None
        if not line:
            raise RuntimeError(f"peer died during {op}; log:\n{self.tail()}")
        reply = json.loads(line)
        if not reply["ok"]:
            raise PeerError(reply)
        return reply["result"]

    def tail(self, n: int = 4000) -> str:
        self._log_f.flush()
        return self.log.read_text()[-n:]

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # SIGKILL also ends a stopped process, without running it
        self.proc.wait(timeout=10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a test may have left it stopped
            with contextlib.suppress(Exception):
                self.call("close", timeout=15)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log_f.close()
