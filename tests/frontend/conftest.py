"""Frontend fixtures: one fp32 engine for the session, clusters of test workers around it.

``served`` is one worker and a frontend shared by a test module; ``cluster`` is an empty
cluster for one test (add workers, start the frontend). Both check at teardown that the
engine went idle with consistent block accounting, whatever the test did.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from engine import LLM, AsyncEngine, CompletionResult, SamplingParams
from tests.frontend.harness import Cluster, LoopThread

# A small context window so that "prompt too long" is cheap to provoke.
MAX_MODEL_LEN = 1024


@pytest.fixture(scope="session")
def llm() -> LLM:
    return LLM(dtype="float32", num_blocks=160, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="session")
def engine(llm: LLM) -> Iterator[AsyncEngine]:
    e = AsyncEngine(llm.engine)
    yield e
    e.close()


@pytest.fixture(scope="session")
def loop() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.close()


def _cluster(llm: LLM, engine: AsyncEngine, loop: LoopThread, path: Path) -> Cluster:
    return Cluster(llm=llm, engine=engine, loop=loop, state_dir=path)


@pytest.fixture(scope="module")
def served(
    llm: LLM, engine: AsyncEngine, loop: LoopThread, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    c = _cluster(llm, engine, loop, tmp_path_factory.mktemp("served"))
    c.add_worker("w0")
    c.start_frontend()
    c.wait_ready()
    yield c
    c.close()
    c.assert_engine_clean()


@pytest.fixture
def cluster(llm: LLM, engine: AsyncEngine, loop: LoopThread, tmp_path: Path) -> Iterator[Cluster]:
    c = _cluster(llm, engine, loop, tmp_path)
    yield c
    c.close()
    c.assert_engine_clean()


@pytest.fixture
def client(served: Cluster) -> openai.OpenAI:
    return openai_client(served)


def openai_client(c: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{c.base_url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture
def reference(
    llm: LLM, engine: AsyncEngine
) -> Callable[[str | list[int], SamplingParams], CompletionResult]:
    """``llm.generate`` for one prompt, run on the engine thread (which owns the core)
    while no other request is in it."""

    def run(prompt: str | list[int], params: SamplingParams) -> CompletionResult:
        def generate(core: object) -> CompletionResult:
            assert llm.engine.is_idle(), "reference generation needs an idle engine"
            return llm.generate(prompt, params)[0]

        return engine.inspect(generate).result(120)

    return run
