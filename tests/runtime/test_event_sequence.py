"""Checking a worker's event stream: every loss, reordering or restart is caught."""

from __future__ import annotations

from runtime.rpc.server import EventSequencer, Verdict
from runtime.rpc.types import KvRemoved, KvSnapshot, KvStored, LoadReport, LoadUpdate


def test_in_order_then_gap_reorder_and_restart() -> None:
    s = EventSequencer()
    assert s.check(KvStored("i1", 1, (1,))) is Verdict.SKIP  # before any snapshot
    assert s.check(KvSnapshot("i1", 4, frozenset({1}))) is Verdict.APPLY
    assert s.check(KvStored("i1", 5, (2,))) is Verdict.APPLY
    assert s.check(LoadUpdate("i1", 5, LoadReport())) is Verdict.APPLY
    assert s.check(KvRemoved("i1", 7, (2,))) is Verdict.RESYNC  # 6 was lost
    s.check(KvSnapshot("i1", 7, frozenset()))
    assert s.check(KvStored("i1", 7, (3,))) is Verdict.RESYNC  # a duplicate / reordered
    s.check(KvSnapshot("i1", 7, frozenset()))
    assert s.check(LoadUpdate("i1", 8, LoadReport())) is Verdict.RESYNC  # event 8 lost
    s.check(KvSnapshot("i1", 8, frozenset()))
    assert s.check(KvStored("i2", 1, (3,))) is Verdict.RESYNC  # the worker restarted
    s.reset()
    assert s.check(LoadUpdate("i2", 0, LoadReport())) is Verdict.SKIP
