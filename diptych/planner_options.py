"""The planner's flags, shared by `diptych simulate --planner` and (later) `diptych
planner`, and the `Planner` they describe."""

from __future__ import annotations

import argparse
import math
from typing import Any

from planner import PREDICTORS, Limits, LoadPolicy, Planner, PoolLimits, SlaPolicy
from planner.capacity import CapacityModel

POLICIES = ("sla", "load")


def add_planner_arguments(p: argparse.ArgumentParser, *, required: bool = False) -> None:
    g = p.add_argument_group("planner")
    g.add_argument(
        "--planner",
        choices=POLICIES,
        default=None if not required else "sla",
        help="scale the pools with this policy (sla: from the profile and the SLO; "
        "load: on queue, KV and stream thresholds)",
    )
    g.add_argument("--ttft-slo-ms", type=float, default=2000.0, help="the SLA's TTFT target")
    g.add_argument("--itl-slo-ms", type=float, default=100.0, help="the SLA's ITL target")
    g.add_argument("--predictor", choices=PREDICTORS, default="moving-average")
    g.add_argument("--predictor-window", type=int, default=3, help="ticks (moving-average)")
    g.add_argument("--predictor-season", type=int, default=0, help="ticks per season (holt)")
    g.add_argument("--planner-interval", type=float, default=30.0, help="seconds per tick")
    g.add_argument(
        "--lookahead",
        type=float,
        default=90.0,
        help="seconds ahead to size for (about a worker's start-up time plus a tick)",
    )
    g.add_argument("--min-prefill", type=int, default=1)
    g.add_argument("--max-prefill", type=int, default=16)
    g.add_argument("--min-decode", type=int, default=1)
    g.add_argument("--max-decode", type=int, default=16)
    g.add_argument(
        "--accelerators-per-worker", type=int, default=1, help="a worker's tensor-parallel size"
    )
    g.add_argument("--budget", type=int, default=None, help="accelerators for both pools")
    g.add_argument("--up-cooldown", type=float, default=60.0, help="seconds")
    g.add_argument("--down-cooldown", type=float, default=180.0, help="seconds")
    g.add_argument(
        "--idle-timeout", type=float, default=120.0, help="seconds without traffic -> minimum"
    )
    g.add_argument("--dry-run", action="store_true", help="decide and report; scale nothing")


def planner_from_args(args: Any, capacity: CapacityModel | None) -> Planner:
    """The `Planner` the flags describe; the SLA policy needs `capacity`."""
    cost = args.accelerators_per_worker
    limits = Limits(
        PoolLimits(args.min_prefill, args.max_prefill, cost),
        PoolLimits(args.min_decode, args.max_decode, cost),
        budget=args.budget,
        up_cooldown_s=args.up_cooldown,
        down_cooldown_s=args.down_cooldown,
        idle_s=args.idle_timeout,
    )
    if args.planner == "sla":
        if capacity is None:
            raise ValueError("the SLA policy needs a worker profile (--profile)")
        policy: Any = SlaPolicy(capacity, args.ttft_slo_ms / 1e3, args.itl_slo_ms / 1e3)
    else:
        policy = LoadPolicy()
    return Planner(
        policy,
        limits,
        predictor=args.predictor,
        window=args.predictor_window,
        season=args.predictor_season,
        dry_run=args.dry_run,
        lookahead_ticks=max(1, math.ceil(args.lookahead / args.planner_interval)),
    )
