"""End-to-end fixtures: real `diptych serve` process trees."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.serving import Server

# Small, exact settings: fp32 for greedy parity, a small KV pool, remote prefill
# from 32 uncached tokens so short and long prompts take different paths.
BASE_FLAGS = (
    "--dtype", "float32", "--kv-cache-memory", "0.25", "--min-remote-prefill-tokens", "32",
)  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = Server(tmp_path_factory.mktemp("serve"), *BASE_FLAGS)
    yield s
    assert s.stop() == 0, "".join(s.log[-30:])
