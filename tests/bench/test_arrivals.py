"""Arrival processes, rate lists and request chains."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from bench.arrivals import arrival_times, parse_rates, rate_label
from bench.request import Request, chains


def test_infinite_rate_sends_everything_at_once() -> None:
    assert arrival_times(5, math.inf) == [0.0] * 5
    assert arrival_times(0, 2.0) == []


def test_last_arrival_is_rescaled_to_n_over_rate() -> None:
    for burstiness in (0.25, 1.0, 4.0, math.inf):
        t = arrival_times(200, 4.0, burstiness, seed=3)
        assert t[-1] == pytest.approx(50.0)
        assert all(b >= a for a, b in itertools.pairwise(t))


def test_poisson_and_gamma_burstiness_shape_the_gaps() -> None:
    def cv(burstiness: float) -> float:
        gaps = np.diff([0.0, *arrival_times(20000, 10.0, burstiness, seed=1)])
        return float(np.std(gaps) / np.mean(gaps))

    assert cv(1.0) == pytest.approx(1.0, abs=0.05)  # exponential gaps
    assert cv(0.25) == pytest.approx(2.0, abs=0.15)  # gamma shape k: CV = 1 / sqrt(k)
    assert cv(4.0) == pytest.approx(0.5, abs=0.05)
    assert cv(math.inf) == pytest.approx(0.0, abs=1e-9)  # constant gaps


def test_seed_reproduces_arrivals() -> None:
    assert arrival_times(50, 3.0, seed=7) == arrival_times(50, 3.0, seed=7)
    assert arrival_times(50, 3.0, seed=7) != arrival_times(50, 3.0, seed=8)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="request-rate"):
        arrival_times(3, 0.0)
    with pytest.raises(ValueError, match="burstiness"):
        arrival_times(3, 1.0, burstiness=0)


def test_parse_rates() -> None:
    assert parse_rates("inf") == [math.inf]
    assert parse_rates("1, 2,4,inf") == [1.0, 2.0, 4.0, math.inf]
    assert parse_rates(2.5) == [2.5]
    for bad in ("", "1,fast", "0", "-1,2"):
        with pytest.raises(ValueError):
            parse_rates(bad)
    assert rate_label(math.inf) == "inf" and rate_label(2.0) == "2"


def test_chains_group_session_turns_in_order() -> None:
    def r(session: int | None) -> Request:
        return Request("p", 1, 1, session=session)

    reqs = [r(None), r(7), r(None), r(7), r(3), r(7), r(3)]
    assert chains(reqs) == [[0], [1, 3, 5], [2], [4, 6]]
