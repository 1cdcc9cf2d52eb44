"""PREDICT: each predictor on a step, a ramp and a cycle."""

from __future__ import annotations

import math

import pytest

from planner.predict import PREDICTORS, HoltPredictor, MovingAverage, make_predictor


def test_constant_predicts_the_last_value_and_never_below_zero() -> None:
    p = make_predictor("constant")
    assert p.predict() == 0.0
    for v in (3.0, 5.0):
        p.observe(v)
    assert p.predict() == 5.0
    p.observe(-1.0)
    assert p.predict() == 0.0


def test_moving_average_over_its_window() -> None:
    p = MovingAverage(window=3)
    for v in (10.0, 1.0, 2.0, 3.0):
        p.observe(v)
    assert p.predict() == pytest.approx(2.0)


def test_holt_follows_a_ramp_that_the_others_lag() -> None:
    ramp = [2.0 * t for t in range(30)]  # +2 per tick
    preds = {name: make_predictor(name) for name in PREDICTORS}
    for v in ramp:
        for p in preds.values():
            p.observe(v)
    nxt = 2.0 * 30
    assert preds["holt"].predict() == pytest.approx(nxt, rel=0.02)
    assert preds["constant"].predict() == pytest.approx(nxt - 2)
    assert preds["moving-average"].predict() < nxt - 5  # lags by half a window


def test_holt_with_a_season_learns_a_cycle() -> None:
    period = 12

    def load(t: int) -> float:
        return 10 + 8 * math.sin(2 * math.pi * t / period)

    seasonal, plain = make_predictor("holt", season=period), make_predictor("holt")
    errs: dict[str, list[float]] = {"seasonal": [], "plain": []}
    for t in range(10 * period):
        if t >= 8 * period:  # after a few cycles, one-step-ahead errors
            errs["seasonal"].append(abs(seasonal.predict() - load(t)))
            errs["plain"].append(abs(plain.predict() - load(t)))
        seasonal.observe(load(t))
        plain.observe(load(t))
    assert max(errs["seasonal"]) < 0.5
    assert sum(errs["seasonal"]) < sum(errs["plain"]) / 3


def test_bad_settings_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="unknown predictor 'arima'"):
        make_predictor("arima")
    with pytest.raises(ValueError, match="window"):
        MovingAverage(window=0)
    with pytest.raises(ValueError, match="alpha"):
        HoltPredictor(alpha=0.0)
