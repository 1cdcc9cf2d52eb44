"""A decode worker and a prefill worker in this process, on one event loop thread,
over the embedded control plane and a chosen transfer backend."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from decode_worker.config import DecodeWorkerConfig
from decode_worker.worker import DecodeWorker
from engine import EngineConfig
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.worker import PrefillWorker
from protocol.sampling import SamplingParams
from runtime.rpc.client import DecodeWorkerClient
from runtime.rpc.types import GenerateRequest
from tests.loop_thread import LoopThread

DEFAULTS: dict[str, Any] = {"temperature": 0.0, "ignore_eos": True}


def engine_config(**kw: Any) -> EngineConfig:
    kw.setdefault("dtype", "float32")
    kw.setdefault("num_blocks", 192)
    return EngineConfig(**kw)


@dataclass
class Pair:
    loop: LoopThread
    decode: DecodeWorker
    prefill: PrefillWorker | None
    url: str
    client: DecodeWorkerClient | None = None
    counter: list[int] = field(default_factory=lambda: [0])
    last_logprobs: list[Any] = field(default_factory=list)

    def generate(
        self, prompt: list[int], max_tokens: int = 8, **sampling: Any
    ) -> tuple[list[int], Any]:
        async def go() -> tuple[list[int], Any]:
            if self.client is None:
                assert self.decode.info is not None
                self.client = DecodeWorkerClient(self.decode.info.grpc_address)
                await self.client.connect()
            self.counter[0] += 1
            req = GenerateRequest(
                f"t{self.counter[0]}",
                tuple(prompt),
                SamplingParams(**{**DEFAULTS, **sampling, "max_tokens": max_tokens}),
            )
            tokens: list[int] = []
            usage = None
            self.last_logprobs = []
            async for chunk in self.client.generate(req):
                tokens += chunk.token_ids
                self.last_logprobs += chunk.logprobs
                usage = chunk.usage or usage
            return tokens, usage

        return self.loop.run(go())

    def idle(self) -> bool:
        async def check() -> bool:
            for _ in range(100):
                ok = await asyncio.wrap_future(
                    self.decode.engine.inspect(lambda c: c.is_idle() and not c.check_invariants())
                )
                if ok:
                    return True
                await asyncio.sleep(0.05)
            return False

        return self.loop.run(check())


def start_pair(
    tmp: Path,
    transfer: str = "shm",
    with_prefill: bool = True,
    decode_kw: dict[str, Any] | None = None,
    prefill_kw: dict[str, Any] | None = None,
    queue_url: str | None = None,
    decode_engine: dict[str, Any] | None = None,
    prefill_engine: dict[str, Any] | None = None,
) -> Pair:
    loop = LoopThread("worker-loop", timeout=300)
    url = f"embedded:{tmp}"
    queue_url = queue_url or url
    dcfg = DecodeWorkerConfig(
        discovery_url=url,
        queue_url=queue_url,
        engine=engine_config(**(decode_engine or {})),
        transfer_backend=transfer,
        min_remote_prefill_tokens=32,
        metrics_port=None,
        **(decode_kw or {}),
    )
    decode = DecodeWorker(dcfg)
    loop.run(decode.start())
    prefill = None
    if with_prefill:
        pcfg = PrefillWorkerConfig(
            discovery_url=url,
            queue_url=queue_url,
            engine=engine_config(**(prefill_engine or {})),
            transfer_backend=transfer,
            metrics_port=None,
            **(prefill_kw or {}),
        )
        prefill = PrefillWorker(pcfg)
        loop.run(prefill.start())

        async def peers_known() -> None:
            for _ in range(200):
                if len(decode.prefill_workers) and len(prefill.decode_workers):
                    return
                await asyncio.sleep(0.05)
            raise TimeoutError("workers did not see each other")

        loop.run(peers_known())
    return Pair(loop, decode, prefill, url)


def stop_pair(pair: Pair) -> None:
    async def stop() -> None:
        if pair.client is not None:
            await pair.client.close()
        if pair.prefill is not None:
            await pair.prefill.stop()
        await pair.decode.stop()

    pair.loop.run(stop())
    pair.loop.close()


@pytest.fixture(scope="module")
def shared_weights() -> Iterator[None]:
    """Engines started while this is active decode a checkpoint's file once: later ones
    get the same dense tensors again, which `ModelRunner` copies into parameters of their
    own (each worker still has a model of its own, loaded through the same path; only
    the dequantizing of the file, ~2.5 s an engine here, is not repeated). Opt in with
    ``pytestmark = pytest.mark.usefixtures("shared_weights")``."""
    import engine.engine_core as core

    real = core.weights_for
    cache: dict[tuple[str, int, int], list[tuple[str, Any]]] = {}

    def weights_for(
        checkpoint: Any, quantization: str | None, cut: Any = None
    ) -> Iterator[tuple[str, Any]]:
        path = getattr(checkpoint, "path", None)  # a GGUF file
        if quantization is not None or cut is not None or not isinstance(path, Path):
            return real(checkpoint, quantization, cut)  # quantized or cut: as given
        stat = path.stat()
        key = (str(path), stat.st_size, stat.st_mtime_ns)
        if key not in cache:
            cache[key] = list(real(checkpoint, None))
        return iter(cache[key])

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(core, "weights_for", weights_for)
        yield


@pytest.fixture(scope="module")
def shm_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    pair = start_pair(tmp_path_factory.mktemp("cp"), "shm")
    yield pair
    stop_pair(pair)
