"""When a `--deterministic` decode worker offers prompts to the prefill queue: only while
every prefill worker computes the same bits as it does (the same `numerics` in
discovery: kernels' build, dtype, TP size); else it prefills locally, counted."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from decode_worker.config import DecodeWorkerConfig
from decode_worker.metrics import DecodeMetrics
from decode_worker.remote_prefill import RemotePrefill
from engine.config import EngineConfig
from runtime.worker_info import DETERMINISTIC_KEY

MINE = "cpu-avx2/bfloat16/tp1"


class _Peers:
    def __init__(self, extras: list[dict[str, Any]]) -> None:
        self.infos = [SimpleNamespace(extra=e) for e in extras]

    def __len__(self) -> int:
        return len(self.infos)

    def all(self) -> list[Any]:
        return self.infos


def _rule(numerics: str | None, extras: list[dict[str, Any]]) -> tuple[bool, float]:
    engine = EngineConfig(dtype="bfloat16", deterministic=numerics is not None)
    config = DecodeWorkerConfig(engine=engine)
    metrics = DecodeMetrics()
    rt = SimpleNamespace(peers=_Peers(extras), core=SimpleNamespace(numerics=numerics))
    remote = RemotePrefill(rt, config, metrics)  # type: ignore[arg-type]
    offered = remote.rule() is not None
    return offered, metrics.deterministic_local._value.get()


def test_same_numerics_everywhere_offers_remotely() -> None:
    assert _rule(MINE, [{DETERMINISTIC_KEY: MINE}, {DETERMINISTIC_KEY: MINE}]) == (True, 0)


def test_another_build_tp_size_or_mode_prefills_locally() -> None:
    for other in ("cpu-avx512_bf16/bfloat16/tp1", "cpu-avx2/bfloat16/tp2", None):
        extra = {} if other is None else {DETERMINISTIC_KEY: other}
        assert _rule(MINE, [{DETERMINISTIC_KEY: MINE}, extra]) == (False, 1), other


def test_a_worker_not_deterministic_takes_any_prefill_worker() -> None:
    assert _rule(None, [{}, {DETERMINISTIC_KEY: MINE}]) == (True, 0)
