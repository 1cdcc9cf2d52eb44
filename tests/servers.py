"""Real nats-server and etcd processes on free loopback ports, for tests.

A missing binary fails the test with the Debian package to install: tests that
need these servers never skip.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _binary(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: apt-get install -y {package}", pytrace=False)
    return path


class ServerProcess:
    """One server process that can be stopped, killed and restarted on the same port."""

    def __init__(self, name: str, data_dir: Path) -> None:
        self.name = name
        self.data_dir = data_dir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = data_dir.parent / f"{data_dir.name}.log"

    def argv(self) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        raise NotImplementedError

    @property
    def url(self) -> str:
        raise NotImplementedError

    def start(self, timeout: float = 20.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT)
        log.close()
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited at start:\n{self.log_tail()}")
            if self.ready():
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{self.name} not ready after {timeout}s:\n{self.log_tail()}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def restart(self, down_for: float = 0.0) -> None:
        self.stop()
        time.sleep(down_for)
        self.start()

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


class NatsServer(ServerProcess):
    jetstream = True

    def argv(self) -> list[str]:
        return [
            _binary("nats-server", "nats-server"), *(["-js"] if self.jetstream else []),
            "-a", "127.0.0.1", "-p", str(self.port), "-sd", str(self.data_dir),
        ]  # fmt: skip

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def ready(self) -> bool:
        return "Server is ready" in self.log_tail(200) and _port_open(self.port)

    def start(self, timeout: float = 20.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.write_bytes(b"")  # "ready" must come from this run
        super().start(timeout)


class EtcdServer(ServerProcess):
    def __init__(self, name: str, data_dir: Path) -> None:
        super().__init__(name, data_dir)
        self.peer_port = free_port()

    def argv(self) -> list[str]:
        peer = f"http://127.0.0.1:{self.peer_port}"
        client = f"http://127.0.0.1:{self.port}"
        return [
            _binary("etcd", "etcd-server"), "--name", "test", "--data-dir", str(self.data_dir),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"test={peer}", "--log-level", "warn",
        ]  # fmt: skip

    @property
    def url(self) -> str:
        return f"etcd://127.0.0.1:{self.port}"

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1) as r:
                return b'"health":"true"' in r.read()
        except OSError:
            return False


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0
