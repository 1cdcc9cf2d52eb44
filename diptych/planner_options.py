"""The planner's flags, shared by `diptych simulate --planner`, `diptych serve
--planner` and `diptych planner`, and the settings they describe."""

from __future__ import annotations

import argparse
import json

from diptych.flags import add_flags, build
from planner import Planner
from planner.capacity import CapacityModel
from planner.config import CONNECTORS, POLICIES, PlannerConfig, PlanSettings


def add_planner_arguments(p: argparse.ArgumentParser, *, flag: str = "--planner") -> None:
    """The planner's flags; `flag` names the policy (`--planner [sla|load]`, on serve
    and simulate, also turns the planner on; `diptych planner` says `--policy`)."""
    g = p.add_argument_group("planner")
    g.add_argument(
        flag,
        dest="planner",
        choices=POLICIES,
        nargs="?",
        const="sla",
        default=None if flag == "--planner" else "sla",
        help="scale the pools with this policy (sla, the default: from the profile and "
        "the SLO; load: on queue, KV and stream thresholds)",
    )
    add_flags(g, PlanSettings)


def plan_settings(args: argparse.Namespace) -> PlanSettings:
    """The policy and limits the planner flags describe."""
    return build(PlanSettings, args, policy=args.planner or "sla")


def planner_from_args(args: argparse.Namespace, capacity: CapacityModel | None) -> Planner:
    """The `Planner` the flags describe; the SLA policy needs `capacity`."""
    return plan_settings(args).planner(capacity)


def add_serve_planner_arguments(p: argparse.ArgumentParser) -> None:
    """`diptych serve --planner`: the planner flags and where its dashboard listens."""
    add_planner_arguments(p)
    g = p.add_argument_group("planner process")
    g.add_argument("--planner-port", type=int, default=8001, help="dashboard and metrics port")
    g.add_argument(
        "--planner-profile",
        default=None,
        help="the worker profile the SLA policy sizes with (default: --engine sim's "
        "--profile; with a real engine, a `diptych profile` JSON of it)",
    )


def add_planner_process_arguments(p: argparse.ArgumentParser) -> None:
    """`diptych planner`: a planner process for a fleet started elsewhere."""
    add_planner_arguments(p, flag="--policy")
    g = p.add_argument_group("planner process")
    g.add_argument(
        "--frontend-url",
        action="append",
        default=[],
        help="a frontend whose /metrics to read (repeat for several; default "
        "http://127.0.0.1:8000); dns+http://NAME:PORT reads every address NAME resolves "
        "to, each tick (a headless Service of the frontend replicas)",
    )
    g.add_argument("--host", default="127.0.0.1", help="dashboard and metrics address")
    g.add_argument("--port", type=int, default=8001, help="dashboard and metrics port")
    g.add_argument("--profile", default=None, help="the worker profile the SLA policy uses")
    g.add_argument("--max-batch", type=int, default=128, help="a decode worker's batch limit")
    g.add_argument("--kv-tokens", type=int, default=None, help="a decode worker's KV tokens")
    g.add_argument("--time-scale", type=float, default=1.0, help="under --engine sim: its own")
    c = p.add_argument_group("connector")
    c.add_argument("--connector", choices=CONNECTORS, default="none")
    c.add_argument("--launcher-url", default=None, help="local: `diptych serve`'s control URL")
    c.add_argument("--k8s-namespace", default=None, help="kubernetes: the workers' namespace")
    c.add_argument(
        "--prefill-deployment",
        default="diptych-prefill",
        help="kubernetes: the prefill pool's Deployment ('' for none: aggregated serving)",
    )
    c.add_argument("--decode-deployment", default="diptych-decode")
    c.add_argument(
        "--lws-pools", default="",
        help="kubernetes: the pools (prefill,decode) that are LeaderWorkerSets of that "
        "name, not Deployments: workers whose ranks span pods",
    )  # fmt: skip
    c.add_argument("--kubeconfig", default=None, help="kubernetes: default in-cluster, then ~")
    c.add_argument("--ray-address", default="auto", help="ray: the cluster to join")
    c.add_argument(
        "--ray-actor-options",
        default="{}",
        help="ray: each worker actor's resources, as JSON (e.g. '{\"num_gpus\": 1}')",
    )
    c.add_argument(
        "--ray-worker-args",
        default="",
        help="ray: the flags each worker actor runs with, as for `diptych decode|prefill`",
    )


def planner_config(args: argparse.Namespace) -> PlannerConfig:
    from diptych import options

    connector: dict[str, object] = {}
    if args.connector == "local":
        if not args.launcher_url:
            raise ValueError("--connector local needs --launcher-url (see serve.json)")
        connector = {"url": args.launcher_url}
    elif args.connector == "kubernetes":
        connector = {
            "namespace": args.k8s_namespace,
            # an empty name: the fleet has no such pool (aggregated serving: no prefill)
            "deployments": {
                pool: name
                for pool, name in (
                    ("prefill", args.prefill_deployment),
                    ("decode", args.decode_deployment),
                )
                if name
            },
            "kubeconfig": args.kubeconfig,
            "kinds": {pool: "LeaderWorkerSet" for pool in _pools(args.lws_pools)},
        }
    elif args.connector == "ray":
        try:
            actor = json.loads(args.ray_actor_options)
        except json.JSONDecodeError as e:
            raise ValueError(f"--ray-actor-options is not JSON: {e}") from None
        if not isinstance(actor, dict):
            raise ValueError("--ray-actor-options must be a JSON object")
        connector = {"address": args.ray_address, "worker_args": args.ray_worker_args,
                     "actor_options": actor}  # fmt: skip
    return PlannerConfig(
        plan=plan_settings(args),
        profile=args.profile,
        max_batch=args.max_batch,
        kv_tokens=args.kv_tokens,
        frontend_urls=tuple(args.frontend_url or ["http://127.0.0.1:8000"]),
        discovery_url=options.discovery_url(args),
        namespace=args.namespace,
        host=args.host,
        port=args.port,
        connector=args.connector,
        connector_options=connector,
        time_scale=args.time_scale,
    )


def _pools(names: str) -> list[str]:
    pools = [n.strip() for n in names.split(",") if n.strip()]
    unknown = set(pools) - {"prefill", "decode"}
    if unknown:
        raise ValueError(f"--lws-pools names pools prefill and decode, not {sorted(unknown)}")
    return pools
