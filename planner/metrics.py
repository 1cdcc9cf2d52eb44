"""The planner's Prometheus metrics (``diptych_planner_*``), on its own registry, and
`record`, which exports one tick: what Grafana's planner panels read."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from planner.core import TickResult
from planner.observation import POOLS
from runtime.metrics import counter, gauge, new_registry

C = "planner"


class PlannerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or new_registry()
        self.desired = gauge(r, C, "desired_replicas", "Replicas the planner asks for", ["pool"])
        self.ready = gauge(r, C, "ready_replicas", "Replicas ready at the last tick", ["pool"])
        self.proposed = gauge(
            r, C, "proposed_replicas", "The policy's proposal before constraints", ["pool"]
        )
        self.predicted_rate = gauge(
            r, C, "predicted_request_rate", "Requests/s predicted for the next interval"
        )
        self.predicted_prompt_tokens = gauge(
            r, C, "predicted_prompt_tokens_per_second", "Prompt tokens/s predicted"
        )
        self.observed_rate = gauge(r, C, "observed_request_rate", "Requests/s last interval")
        self.decisions = counter(
            r, C, "decisions_total",
            "Changes of a pool's target, by the rule that set it (the full reason is in "
            "the log and /api/state)",
            ["pool", "direction", "rule"],
        )  # fmt: skip
        self.errors = counter(
            r, C, "errors_total", "Ticks or scale calls that failed, by kind", ["kind"]
        )
        self.ticks = counter(r, C, "ticks_total", "Planner ticks")
        # every series at 0 from the start, so rate() over them reads 0, not "no data"
        for pool in POOLS:
            for direction in ("up", "down"):
                for rule in (*(rule for _, rule in RULES), "policy"):
                    self.decisions.labels(pool, direction, rule)
        for kind in ERROR_KINDS:
            self.errors.labels(kind=kind)

    def record(self, tick: TickResult) -> None:
        self.ticks.inc()
        self.observed_rate.set(tick.observation.request_rate)
        self.predicted_rate.set(tick.forecast.request_rate)
        self.predicted_prompt_tokens.set(tick.forecast.prompt_tokens_per_s)
        for p in tick.proposals:
            self.proposed.labels(pool=p.pool).set(p.replicas)
        for d in tick.decisions:
            self.desired.labels(pool=d.pool).set(d.target)
            self.ready.labels(pool=d.pool).set(d.ready)
            if d.changed:
                direction = "up" if d.target > d.previous else "down"
                self.decisions.labels(d.pool, direction, rule_of(d.reason)).inc()


# what `PlannerService.failed` counts: metrics unreadable, a scale call refused or
# failed, a hand edit being respected, a tick that raised, an unusable profile
ERROR_KINDS = ("scrape", "scale", "hand_edit", "tick", "profile")

# the constraint a reason names (planner.constrain words them), else the policy's
RULES = (
    ("no traffic", "idle"),
    ("by the budget", "budget"),
    ("clamped", "limits"),
    ("keeping", "headroom"),
)


def rule_of(reason: str) -> str:
    """A decision's reason as a short label: idle, budget, limits, headroom, policy."""
    for words, rule in RULES:
        if words in reason:
            return rule
    return "policy"
