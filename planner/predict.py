"""PREDICT: the next interval's value of a load signal (request rate, prompt length,
output length) from the values observed so far.

Each predictor is fed one observation per planner tick (`observe`) and asked for the
value one `horizon_s` ahead (`predict`); it keeps its own short history and never
reads a clock. Three kinds, chosen by name (`make_predictor`, `--predictor`):

    constant         the last value (what Dynamo's load planner assumes)
    moving-average   the mean of the last `window` values
    holt             double exponential smoothing (level + trend, Holt's linear
                     method), optionally with a seasonal term of `season` ticks
                     (additive Holt-Winters): follows a ramp or a diurnal cycle
                     instead of lagging it by a whole window

A prediction is never negative: a load that is falling fast predicts zero, not less.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Protocol

PREDICTORS = ("constant", "moving-average", "holt")


class Predictor(Protocol):
    def observe(self, value: float) -> None: ...

    def predict(self, steps_ahead: int = 1) -> float: ...


@dataclass
class ConstantPredictor:
    last: float = 0.0

    def observe(self, value: float) -> None:
        self.last = value

    def predict(self, steps_ahead: int = 1) -> float:
        return max(self.last, 0.0)


@dataclass
class MovingAverage:
    window: int = 6
    values: collections.deque[float] = field(default_factory=collections.deque)

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"moving-average window must be >= 1, got {self.window}")
        self.values = collections.deque(self.values, maxlen=self.window)

    def observe(self, value: float) -> None:
        self.values.append(value)

    def predict(self, steps_ahead: int = 1) -> float:
        return max(sum(self.values) / len(self.values), 0.0) if self.values else 0.0


@dataclass
class HoltPredictor:
    """Holt's linear trend, plus an additive seasonal term when `season` > 1.

    level_t = a (y_t - s_{t-m}) + (1 - a)(level + trend)
    trend_t = b (level_t - level) + (1 - b) trend
    s_t     = g (y_t - level_t) + (1 - g) s_{t-m}
    forecast h ahead = level + h trend + s_{t-m+h}
    """

    alpha: float = 0.5
    beta: float = 0.3
    gamma: float = 0.3
    season: int = 0
    level: float | None = None
    trend: float = 0.0
    seasonal: list[float] = field(default_factory=list)
    n: int = 0

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "gamma"):
            v = getattr(self, name)
            if not 0.0 < v <= 1.0:
                raise ValueError(f"holt {name} must be in (0, 1], got {v}")
        if self.season < 0:
            raise ValueError(f"holt season must be >= 0 ticks, got {self.season}")
        if self.season > 1 and not self.seasonal:
            self.seasonal = [0.0] * self.season

    def _season_at(self, i: int) -> float:
        return self.seasonal[i % self.season] if self.season > 1 else 0.0

    def observe(self, value: float) -> None:
        s = self._season_at(self.n)
        if self.level is None:
            self.level = value - s
        else:
            previous = self.level
            self.level = self.alpha * (value - s) + (1 - self.alpha) * (previous + self.trend)
            self.trend = self.beta * (self.level - previous) + (1 - self.beta) * self.trend
        if self.season > 1:
            i = self.n % self.season
            self.seasonal[i] = self.gamma * (value - self.level) + (1 - self.gamma) * s
        self.n += 1

    def predict(self, steps_ahead: int = 1) -> float:
        if self.level is None:
            return 0.0
        h = max(steps_ahead, 1)
        return max(self.level + h * self.trend + self._season_at(self.n - 1 + h), 0.0)


def make_predictor(name: str, *, window: int = 6, season: int = 0) -> Predictor:
    """A predictor by its `--predictor` name."""
    if name == "constant":
        return ConstantPredictor()
    if name == "moving-average":
        return MovingAverage(window)
    if name == "holt":
        if season > 1:  # a slow level and trend: the season explains the swings
            return HoltPredictor(alpha=0.2, beta=0.02, gamma=0.6, season=season)
        return HoltPredictor()
    raise ValueError(f"unknown predictor {name!r}; choose one of {', '.join(PREDICTORS)}")
