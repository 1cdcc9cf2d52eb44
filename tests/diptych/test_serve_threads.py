"""`diptych serve` shares the machine's CPUs out among the engine processes it starts."""

from __future__ import annotations

from diptych.serve import engine_threads, usable_cpus


def test_one_cpu_is_left_for_the_frontend() -> None:
    assert engine_threads(2, 1) == 1
    assert engine_threads(16, 1) == 15
    assert engine_threads(16, 3) == 5


def test_every_engine_gets_a_thread() -> None:
    assert engine_threads(1, 1) == 1
    assert engine_threads(4, 8) == 1
    assert usable_cpus() >= 1
