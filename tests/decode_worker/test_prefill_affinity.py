"""Remote prefills prefer the prefill worker holding the prompt: two decode and two
prefill workers in this process, real engines, the embedded queue."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from decode_worker.config import DecodeWorkerConfig
from decode_worker.worker import DecodeWorker
from engine import LLM, SamplingParams
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.worker import PrefillWorker
from protocol.kv_layout import hash_blocks
from tests.decode_worker.conftest import Pair, engine_config
from tests.loop_thread import LoopThread

HISTORY = [100 + (7 * i) % 3000 for i in range(300)]  # a conversation so far
NEXT_TURN = HISTORY + [4000 + i for i in range(160)]  # ...and its next turn


class Fleet:
    def __init__(self, tmp: Path) -> None:
        self.loop = LoopThread("affinity-loop", timeout=300)
        url = f"embedded:{tmp}"
        common: dict[str, Any] = {"discovery_url": url, "queue_url": url, "metrics_port": None}
        self.decode = [
            DecodeWorker(DecodeWorkerConfig(
                worker_id=f"decode-{i}", engine=engine_config(), min_remote_prefill_tokens=32,
                prefill_affinity_wait=0.5, **common,
            ))
            for i in range(2)
        ]
        self.prefill = [
            PrefillWorker(PrefillWorkerConfig(worker_id=f"prefill-{i}", engine=engine_config(),
                                              **common))
            for i in range(2)
        ]
        for w in [*self.decode, *self.prefill]:
            self.loop.run(w.start())
        # request ids unique across the pairs (the queue deduplicates by id)
        self.pairs = [Pair(self.loop, d, None, url, counter=[1000 * i])
                      for i, d in enumerate(self.decode)]  # fmt: skip
        self.until(lambda: all(len(d.prefill_workers) == 2 and d.affinity is not None
                               and len(d.affinity.loads) == 2 for d in self.decode))  # fmt: skip

    def until(self, ok: Any, timeout: float = 30.0) -> None:
        async def wait() -> None:
            for _ in range(int(timeout / 0.05)):
                if ok():
                    return
                await asyncio.sleep(0.05)
            raise TimeoutError("condition not met")

        self.loop.run(wait())

    def served(self) -> list[float]:
        return [p.metrics.prefills.labels(result="ok")._value.get() for p in self.prefill]

    def close(self) -> None:
        async def stop() -> None:
            for pair in self.pairs:
                if pair.client is not None:
                    await pair.client.close()
            for w in [*self.prefill, *self.decode]:
                await w.stop()

        self.loop.run(stop())
        self.loop.close()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("affinity"))
    yield f
    f.close()


def routed(d: DecodeWorker, to: str) -> float:
    return float(d.metrics.remote_routed.labels(to)._value.get())


def test_next_turn_goes_to_the_prefill_worker_holding_the_history(fleet: Fleet) -> None:
    d0, d1 = fleet.decode
    tokens, usage = fleet.pairs[0].generate(HISTORY)
    assert usage.remote_prefill and routed(d0, "any") == 1  # nobody holds it: shared queue
    holder = fleet.served().index(1)
    hashes = hash_blocks(NEXT_TURN, 16)
    assert d1.affinity is not None
    fleet.until(lambda: d1.affinity.index.match(hashes).get(f"prefill-{holder}", 0) >= 18)
    hits_before = fleet.prefill[holder].rt.core.scheduler.prefix_hit_tokens
    # the next turn lands on the other decode worker, which holds none of it: its remote
    # prefill is offered to the prefill worker that computed the history
    tokens, usage = fleet.pairs[1].generate(NEXT_TURN)
    assert usage.remote_prefill and usage.cached_tokens == 0
    assert routed(d1, "holder") == 1
    assert fleet.served()[holder] == 2 and sum(fleet.served()) == 2
    assert fleet.prefill[holder].rt.core.scheduler.prefix_hit_tokens - hits_before >= 288
    offline = LLM(dtype="float32", num_blocks=192).generate(
        [NEXT_TURN], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )[0]
    assert tokens == offline.token_ids
    # the decode worker that holds the history prefills a short next turn itself
    _, usage = fleet.pairs[0].generate([*HISTORY, 5, 6, 7])
    assert not usage.remote_prefill and usage.cached_tokens >= 288
    assert all(pair.idle() for pair in fleet.pairs)


def test_a_preference_not_taken_in_time_goes_to_everyone(fleet: Fleet) -> None:
    """A preferred worker that does not fetch (stuck, or gone without leaving yet): after
    prefill_affinity_wait the request is on the shared queue and another takes it."""
    d0 = fleet.decode[0]
    assert d0.affinity is not None
    real = d0.affinity.choose
    d0.affinity.choose = lambda prompt, salt=None, adapter=None: "prefill-ghost"  # type: ignore[method-assign]
    try:
        before = sum(fleet.served())
        tokens, usage = fleet.pairs[0].generate([9000 + i for i in range(120)])
        assert usage.remote_prefill and len(tokens) == 8
        assert sum(fleet.served()) == before + 1
        assert d0.metrics.remote_released.labels("wait")._value.get() == 1
    finally:
        d0.affinity.choose = real  # type: ignore[method-assign]
    assert fleet.pairs[0].idle()
