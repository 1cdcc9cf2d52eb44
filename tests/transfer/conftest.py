"""Fixtures for the transfer tests: peer processes in a private network namespace.

See `tests.transfer.harness` for what is required and how to relax it locally.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.transfer.harness import PeerProcess, require, require_backend
from transfer.testing import NetNamespace, NetNamespaceError

ISOLATED = {"nixl", "ucx", "auto"}


@pytest.fixture(scope="session")
def netns() -> Iterator[NetNamespace | str]:
    """The session's private network namespace, or why it could not be made."""
    try:
        ns = NetNamespace()
    except NetNamespaceError as e:
        yield str(e)
        return
    yield ns
    ns.close()


@pytest.fixture
def spawn(netns: NetNamespace | str, tmp_path: Path) -> Iterator[Any]:
    """spawn(kind) -> PeerProcess, inside the namespace when `kind` needs it
    (or when `isolated` says so: a tcp peer meant to meet a nixl one)."""
    procs: list[PeerProcess] = []

    def _spawn(kind: str, isolated: bool | None = None) -> PeerProcess:
        require_backend(kind)
        path = None
        if kind in ISOLATED if isolated is None else isolated:
            require(isinstance(netns, NetNamespace), f"no private network namespace: {netns}")
            assert isinstance(netns, NetNamespace)
            path = netns.path
        p = PeerProcess(path, tmp_path / f"peer{len(procs)}.log")
        procs.append(p)
        return p

    yield _spawn
    for p in procs:
        p.close()
