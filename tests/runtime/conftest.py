"""Fixtures for the control-plane tests: real nats-server and etcd, and both backends.

Servers run on free loopback ports with data in a temporary directory. A missing binary
fails the test with the package to install: these tests never skip. Tests are
``async def`` (see ``tests/conftest.py``); their helpers are in ``tests.runtime.rt_helpers``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.servers import EtcdServer, NatsServer, ServerProcess

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    server = NatsServer("nats-server", tmp_path_factory.mktemp("nats") / "data")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    server = EtcdServer("etcd", tmp_path_factory.mktemp("etcd") / "data")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[Callable[[str], Any]]:
    """Private servers: ``server_factory("nats" | "etcd" | "nats-no-js")``."""
    started: list[ServerProcess] = []

    def make(kind: str) -> Any:
        cls = {"nats": NatsServer, "etcd": EtcdServer, "nats-no-js": NatsServer}[kind]
        server = cls(kind, tmp_path / f"{kind}-{len(started)}" / "data")
        if kind == "nats-no-js":
            server.jetstream = False
        server.start()
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


@pytest.fixture
def namespace() -> str:
    return "t" + uuid.uuid4().hex[:12]


@pytest.fixture(scope="session")
def kube_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A stand-in Kubernetes API for Leases; KUBECONFIG names it (children inherit it)."""
    from tests.runtime.fake_kube import FakeKubeApi

    api = FakeKubeApi()
    before = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = str(api.kubeconfig(tmp_path_factory.mktemp("kube") / "config"))
    yield api
    if before is None:
        os.environ.pop("KUBECONFIG", None)
    else:
        os.environ["KUBECONFIG"] = before
    api.close()


@pytest.fixture(params=["embedded", "etcd", "kubernetes"])
def discovery_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "etcd":
        return str(request.getfixturevalue("etcd_server").url)
    if request.param == "kubernetes":
        request.getfixturevalue("kube_api")
        return "kubernetes://diptych-test"
    return f"embedded:{tmp_path / 'state'}"


@pytest.fixture(params=["embedded", "nats"])
def queue_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "nats":
        return str(request.getfixturevalue("nats_server").url)
    return f"embedded:{tmp_path / 'state'}"


class Child:
    """A Python child process running ``tests/runtime/child.py``, read line by line."""

    def __init__(self, *args: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("child.py")), *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
        )  # fmt: skip

    async def expect(self, prefix: str, timeout: float = 20.0) -> str:
        """The next stdout line starting with ``prefix`` (other lines are skipped)."""
        assert self.proc.stdout is not None
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while loop.time() < end:
            line = await asyncio.wait_for(
                loop.run_in_executor(None, self.proc.stdout.readline), end - loop.time()
            )
            if not line:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise AssertionError(f"child exited before {prefix!r}:\n{err}")
            text = line.decode().strip()
            if text.startswith(prefix):
                return text[len(prefix) :].strip()
        raise AssertionError(f"child printed no {prefix!r} within {timeout}s")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def spawn() -> Iterator[Callable[..., Child]]:
    children: list[Child] = []

    def start(*args: str) -> Child:
        child = Child(*args)
        children.append(child)
        return child

    yield start
    for child in children:
        child.kill()
