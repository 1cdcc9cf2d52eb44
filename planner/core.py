"""The planner's pure core: one `tick` per interval, OBSERVE's data in, decisions out.

    planner = Planner(SlaPolicy(...), Limits(...), predictor="holt")
    result = planner.tick(observation)      # PREDICT -> PROPOSE -> CONSTRAIN
    for d in result.decisions: ...          # EXECUTE is the caller's (a connector)

No clock, sockets or processes: the observation carries its time, so the same core
runs live (`planner.service`), in tests and in `diptych simulate`'s virtual time. In
dry-run mode every change is reported but treated as done at once, so the report
shows what the planner would do rather than holding for changes nobody makes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from planner.constrain import Constrainer, Decision, Limits
from planner.observation import POOLS, Forecast, Observation
from planner.policy import Policy, Proposal
from planner.predict import Predictor, make_predictor


@dataclass(frozen=True)
class TickResult:
    observation: Observation
    forecast: Forecast
    proposals: list[Proposal]
    decisions: list[Decision]


@dataclass
class Planner:
    policy: Policy
    limits: Limits
    predictor: str = "constant"
    window: int = 6
    season: int = 0
    dry_run: bool = False
    initial: dict[str, int] = field(default_factory=dict)
    # predict this many ticks ahead: a worker asked for now serves only after it
    # starts, so size for the load then (trend-following predictors use it)
    lookahead_ticks: int = 1

    def __post_init__(self) -> None:
        def new() -> Predictor:
            return make_predictor(self.predictor, window=self.window, season=self.season)

        self._rate, self._input, self._output, self._input_sq = new(), new(), new(), new()
        self.constrainer = Constrainer(self.limits, dict(self.initial))
        self._last_traffic: float | None = None
        self._first: float | None = None

    def target(self, pool: str) -> int:
        return self.constrainer.target(pool)

    def adopt(self, sizes: dict[str, int], source: str) -> None:
        """Start each pool of `sizes` from that many replicas (what runs, as `source`
        says) instead of from the replicas ready at the first tick."""
        self.constrainer.adopt(sizes, source)

    def tick(self, obs: Observation) -> TickResult:
        if self._first is None:
            self._first = obs.time
        self._rate.observe(obs.request_rate)
        if obs.request_rate > 0 or obs.in_flight > 0:
            self._last_traffic = obs.time
        # a length is observed only when the interval measured it (0: no request
        # admitted, or none finished, as at the start of a phase of long replies)
        for predictor, value in ((self._input, obs.mean_input_tokens),
                                 (self._output, obs.mean_output_tokens),
                                 (self._input_sq, obs.mean_input_tokens_sq)):  # fmt: skip
            if value > 0:
                predictor.observe(value)
        h = max(self.lookahead_ticks, 1)
        forecast = Forecast(
            self._rate.predict(h),
            self._input.predict(h),
            self._output.predict(h),
            self._input_sq.predict(h),
        )
        proposals = self.policy.propose(obs, forecast)
        since = self._last_traffic if self._last_traffic is not None else self._first
        ready = {p: self.constrainer.target(p) for p in POOLS} if self.dry_run else dict(obs.ready)
        decisions = self.constrainer.apply(
            obs.time, proposals, ready, obs.time - since, held=obs.held
        )
        return TickResult(obs, forecast, proposals, decisions)
