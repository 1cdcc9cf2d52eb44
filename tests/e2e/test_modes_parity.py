"""Greedy outputs are identical aggregated and disaggregated, over every transfer
backend and both control planes (embedded; NATS + etcd), with real processes."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import BASE_FLAGS
from tests.e2e.scenario import PROMPTS, run
from tests.servers import EtcdServer, NatsServer
from transfer.testing import NetNamespace

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def aggregated() -> list[str]:
    result = run([*BASE_FLAGS, "--prefill-workers", "0"])
    assert result["remote"] == 0 and result["exit"] == 0
    texts: list[str] = result["texts"]  # type: ignore[assignment]
    assert len(texts) == len(PROMPTS) and all(texts)
    return texts


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    nats = NatsServer("nats-server", tmp_path_factory.mktemp("nats") / "data")
    etcd = EtcdServer("etcd", tmp_path_factory.mktemp("etcd") / "data")
    nats.start()
    etcd.start()
    yield etcd.url, nats.url
    nats.stop()
    etcd.stop()


def test_disaggregated_equals_aggregated_over_shm(aggregated: list[str]) -> None:
    result = run([*BASE_FLAGS, "--transfer", "shm"])
    assert result["texts"] == aggregated
    assert result["remote"] == 3  # every prompt but the first is long enough
    assert result["exit"] == 0


def test_over_tcp_nats_and_etcd(aggregated: list[str], control_plane: tuple[str, str]) -> None:
    """The TCP transfer and the NATS + etcd control plane in one fleet (each is
    independent of the other; one fleet start fewer)."""
    etcd, nats = control_plane
    result = run([*BASE_FLAGS, "--transfer", "tcp", "--etcd", etcd, "--nats", nats,
                  "--namespace", "e2e"])  # fmt: skip
    assert result["texts"] == aggregated
    assert result["remote"] == 3 and result["exit"] == 0


def test_over_nixl_in_a_private_network(aggregated: list[str], tmp_path: Path) -> None:
    with NetNamespace() as ns:
        proc = subprocess.run(
            [sys.executable, "-m", "tests.e2e.scenario", "--netns", ns.path, "--",
             *BASE_FLAGS, "--transfer", "nixl"],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["texts"] == aggregated
    assert result["remote"] == 3 and result["exit"] == 0
