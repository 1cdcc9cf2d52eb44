"""Fixtures of the bench tests: the default model's prompt builder and a stub server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.workloads import PromptBuilder, load_tokenizer
from tests.bench.stub_server import StubConfig, StubServer


@pytest.fixture(scope="session")
def builder() -> PromptBuilder:
    return PromptBuilder(load_tokenizer(None))


@pytest.fixture
def stub() -> Iterator[StubServer]:
    with StubServer(StubConfig()) as s:
        yield s
