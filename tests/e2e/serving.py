"""`diptych serve` as a real process tree, for end-to-end tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.servers import scrape


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """Start with `diptych serve <flags>`; `.url`, `.manifest`, `.metrics(role)`, `.stop()`."""

    def __init__(self, state_dir: Path, *flags: str, startup_timeout: float = 300) -> None:
        self.state_dir = state_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable, "-m", "diptych.cli", "serve",
            "--port", str(self.port), "--state-dir", str(state_dir), *flags,
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.log: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        end = time.monotonic() + startup_timeout
        while not self._ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > end:
                self.stop()
                raise RuntimeError("diptych serve did not start:\n" + "".join(self.log[-40:]))

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line)
            if line.startswith("Diptych is serving"):
                self._ready.set()

    @property
    def manifest(self) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads((self.state_dir / "serve.json").read_text())
        return doc

    def metrics(self, child: str) -> dict[str, float]:
        """Prometheus samples of one child (e.g. "decode-0"), name{labels} -> value."""
        return scrape(f"http://{self.manifest[child]['metrics']}")

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode
