"""The metrics every worker exports: its process's start and its time to ready."""

from __future__ import annotations

import time

from prometheus_client import generate_latest

from planner.scrape import Snapshot
from worker.metrics import WorkerMetrics, process_started


def test_start_time_and_time_to_ready() -> None:
    assert 0 < process_started() <= time.time()
    m = WorkerMetrics()
    snap = Snapshot.parse(generate_latest(m.registry).decode())
    assert snap.value("diptych_worker_start_time_seconds") == m.started_at
    assert snap.value("diptych_worker_ready_seconds") == 0  # not registered yet
    m.registered(now=m.started_at + 12.5)
    snap = Snapshot.parse(generate_latest(m.registry).decode())
    assert snap.value("diptych_worker_ready_seconds") == 12.5
