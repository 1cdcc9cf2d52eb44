"""Settings of the planner: its policy and limits (`PlanSettings`, what `diptych
simulate --planner` takes too) and the planner process around them (`PlannerConfig`:
where it reads metrics, which connector it scales through, where it serves its
dashboard). Plain dataclasses, so `diptych serve` hands them to its child as JSON.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from planner.capacity import CapacityModel
from planner.constrain import Limits, PoolLimits
from planner.core import Planner
from planner.policy import LoadPolicy, Policy, SlaPolicy
from planner.predict import PREDICTORS

POLICIES = ("sla", "load")
CONNECTORS = ("local", "kubernetes", "ray", "none")


@dataclass
class PlanSettings:
    """What the planner decides by. Times in seconds (the planner's clock: simulated
    seconds under a time scale)."""

    policy: str = "sla"
    ttft_slo_s: float = 2.0
    itl_slo_s: float = 0.1
    predictor: str = "moving-average"
    predictor_window: int = 3
    predictor_season: int = 0
    interval_s: float = 30.0
    lookahead_s: float = 90.0
    min_prefill: int = 1
    max_prefill: int = 16
    min_decode: int = 1
    max_decode: int = 16
    accelerators_per_worker: int = 1
    budget: int | None = None
    up_cooldown_s: float = 60.0
    down_cooldown_s: float = 180.0
    idle_timeout_s: float = 120.0
    dry_run: bool = False
    ttft_correction: bool = True  # correct the prefill model by the TTFT observed

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown planner policy {self.policy!r}; choose from {POLICIES}")
        if self.predictor not in PREDICTORS:
            raise ValueError(f"unknown predictor {self.predictor!r}; choose from {PREDICTORS}")
        if not self.interval_s > 0:
            raise ValueError(f"the planner interval must be above 0 s, got {self.interval_s}")
        if not (self.ttft_slo_s > 0 and self.itl_slo_s > 0):
            raise ValueError("the TTFT and ITL targets must be above 0")

    def limits(self) -> Limits:
        cost = self.accelerators_per_worker
        return Limits(
            PoolLimits(self.min_prefill, self.max_prefill, cost),
            PoolLimits(self.min_decode, self.max_decode, cost),
            budget=self.budget,
            up_cooldown_s=self.up_cooldown_s,
            down_cooldown_s=self.down_cooldown_s,
            idle_s=self.idle_timeout_s,
        )

    def planner(self, capacity: CapacityModel | None) -> Planner:
        """The `Planner` these settings describe; the SLA policy needs `capacity`."""
        policy: Policy
        if self.policy == "sla":
            if capacity is None:
                raise ValueError("the SLA policy needs a worker profile (--profile)")
            policy = SlaPolicy(
                capacity, self.ttft_slo_s, self.itl_slo_s, correct=self.ttft_correction
            )
        else:
            policy = LoadPolicy()
        return Planner(
            policy,
            self.limits(),
            predictor=self.predictor,
            window=self.predictor_window,
            season=self.predictor_season,
            dry_run=self.dry_run,
            lookahead_ticks=max(1, math.ceil(self.lookahead_s / self.interval_s)),
        )


@dataclass
class PlannerConfig:
    """The planner process: `plan`, the worker it sizes for, its inputs and outputs.

    `profile` is the worker's timing (a `diptych profile` JSON or ACCELERATOR:MODEL
    roofline, as `--engine sim --profile` takes), with `max_batch` and `kv_tokens`
    the worker's batch and KV limits. `connector_options` are the connector's own
    (local: `url`; kubernetes: `namespace`, `deployments`, ...; ray: `address`, ...).
    """

    plan: PlanSettings = field(default_factory=PlanSettings)
    profile: str | None = None
    max_batch: int = 128
    kv_tokens: int | None = None
    frontend_urls: tuple[str, ...] = ()
    discovery_url: str = "embedded"
    namespace: str = "default"
    host: str = "127.0.0.1"
    port: int = 8001
    connector: str = "none"
    connector_options: dict[str, Any] = field(default_factory=dict)
    time_scale: float = 1.0
    scrape_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        if self.connector not in CONNECTORS:
            raise ValueError(f"unknown connector {self.connector!r}; choose from {CONNECTORS}")
        if not self.frontend_urls:
            raise ValueError("the planner needs a frontend URL to read metrics from")
        if not self.time_scale > 0:
            raise ValueError(f"the time scale must be above 0, got {self.time_scale}")
