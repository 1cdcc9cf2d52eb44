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
from protocol.declare import check_fields, spec

POLICIES = ("sla", "load")
CONNECTORS = ("local", "kubernetes", "ray", "none")


@dataclass
class PlanSettings:
    """What the planner decides by. Times in seconds (the planner's clock: simulated
    seconds under a time scale)."""

    policy: str = spec("sla", choices=POLICIES)  # its flag is the command's own
    ttft_slo_s: float = spec(
        2.0, lo=0.0, lo_open=True, flag="ttft-slo-ms", scale=1e-3, help="the SLA's TTFT target"
    )
    itl_slo_s: float = spec(
        0.1, lo=0.0, lo_open=True, flag="itl-slo-ms", scale=1e-3, help="the SLA's ITL target"
    )
    predictor: str = spec("moving-average", choices=PREDICTORS, help="the load predictor")
    predictor_window: int = spec(3, lo=1, help="ticks (moving-average)")
    predictor_season: int = spec(0, lo=0, help="ticks per season (holt)")
    interval_s: float = spec(
        30.0, lo=0.0, lo_open=True, flag="planner-interval", help="seconds per tick"
    )
    lookahead_s: float = spec(
        90.0, lo=0.0, flag="lookahead",
        help="seconds ahead to size for (about a worker's start-up time plus a tick)",
    )  # fmt: skip
    min_prefill: int = spec(1, lo=0, help="prefill workers at least")
    max_prefill: int = spec(16, lo=0, help="prefill workers at most")
    min_decode: int = spec(
        1, lo=0,
        help="decode workers at least; 0 lets an idle fleet scale to zero (the frontend "
        "holds requests meanwhile: --hold-for-workers)",
    )  # fmt: skip
    max_decode: int = spec(16, lo=1, help="decode workers at most")
    prefill_accelerators: int = spec(
        1, lo=1, help="accelerators a prefill worker holds (its tensor-parallel size)"
    )
    decode_accelerators: int = spec(
        1, lo=1, help="accelerators a decode worker holds (its tensor-parallel size)"
    )
    budget: int | None = spec(None, lo=1, help="accelerators for both pools (default: no limit)")
    up_cooldown_s: float = spec(60.0, lo=0.0, flag="up-cooldown", help="seconds")
    down_cooldown_s: float = spec(180.0, lo=0.0, flag="down-cooldown", help="seconds")
    idle_timeout_s: float = spec(
        120.0, lo=0.0, flag="idle-timeout", help="seconds without traffic -> minimum"
    )
    dry_run: bool = spec(False, help="decide and report; scale nothing")
    ttft_correction: bool = spec(
        True, flag="no-ttft-correction",
        help="sla: size prefill by the profile alone, not corrected by the TTFT observed",
    )  # fmt: skip

    def __post_init__(self) -> None:
        check_fields(self)
        if self.min_prefill > self.max_prefill or self.min_decode > self.max_decode:
            raise ValueError("a pool's minimum is above its maximum")

    def accelerators(self) -> dict[str, int]:
        """Accelerators a worker of each pool holds."""
        return {"prefill": self.prefill_accelerators, "decode": self.decode_accelerators}

    def limits(self) -> Limits:
        return Limits(
            PoolLimits(self.min_prefill, self.max_prefill, self.prefill_accelerators),
            PoolLimits(self.min_decode, self.max_decode, self.decode_accelerators),
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
