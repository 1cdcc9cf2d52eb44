"""The decode worker's one capacity gate: queued requests, requests in flight, draining."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from decode_worker.metrics import DecodeMetrics
from decode_worker.worker import DecodeHandler
from engine.engine_core import EngineSnapshot
from runtime.rpc.types import ErrorCode, GenerateError


def handler(running: int, active: int, waiting: int = 1, **bounds: Any) -> DecodeHandler:
    engine = SimpleNamespace(snapshot=EngineSnapshot(running=running, waiting=waiting))
    h = DecodeHandler(engine, None, None, DecodeMetrics(CollectorRegistry()), "d", "i", **bounds)  # type: ignore[arg-type]
    h.active = active
    return h


@pytest.mark.parametrize(
    ("running", "active", "bounds", "refused"),
    [
        (4, 5, {"max_queued": 2}, None),  # 1 queued of 2
        (4, 6, {"max_queued": 2}, "2 requests queued"),
        (0, 9, {"max_queued": None, "max_active": 10}, None),
        (0, 10, {"max_queued": None, "max_active": 10}, "10 requests in flight"),
        (8, 10, {"max_queued": 5, "max_active": 10}, "10 requests in flight"),
    ],
)
def test_full_is_refused_at_once_and_counted(
    running: int, active: int, bounds: dict[str, Any], refused: str | None
) -> None:
    h = handler(running, active, **bounds)
    if refused is None:
        h._admit()
        assert h.metrics.refused._value.get() == 0
        return
    with pytest.raises(GenerateError, match=refused) as err:
        h._admit()
    assert err.value.code is ErrorCode.RESOURCE_EXHAUSTED and err.value.retryable
    assert h.metrics.refused._value.get() == 1


@pytest.mark.parametrize(("waiting", "refused"), [(0, False), (1, True)])
def test_free_batch_slots_are_not_a_queue(waiting: int, refused: bool) -> None:
    """A burst that arrives between two steps: while the last step left nothing waiting,
    the next one runs up to max_running of it, so those are not counted as queued (the
    frontends count them the same way, or the worker refuses what they admitted)."""
    h = handler(2, 9, waiting, max_queued=2, max_running=8)  # 9 - 8 = 1 queued when idle
    if refused:
        with pytest.raises(GenerateError, match="7 requests queued"):
            h._admit()
    else:
        h._admit()


def test_a_draining_worker_takes_nothing() -> None:
    h = handler(0, 0, max_queued=10)
    h.draining = True
    with pytest.raises(GenerateError, match="draining") as err:
        h._admit()
    assert err.value.code is ErrorCode.UNAVAILABLE and err.value.retryable
