"""Which flags each `diptych` command takes, and the typed configs they build.

Flags are declared once, on the config dataclasses' fields (`diptych/flags.py`
generates them); this module only says which configs a command is made of and how
the few flags that are not one field's combine: the control plane's URLs, `--engine`,
the API keys.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from decode_worker.config import DecodeWorkerConfig
from diptych.flags import add_flags, build, construct, flag_value, given
from engine.config import EngineConfig
from engine.sim.config import DEFAULT_PROFILE, SimConfig
from frontend.config import AdmissionConfig, FrontendConfig, KvRouterConfig
from prefill_worker.config import PrefillWorkerConfig
from protocol.sampling import SamplingParams
from worker.config import WorkerConfig

if TYPE_CHECKING:
    from argparse import _ArgumentGroup as Group

ENGINES = ("model", "sim")
# what `diptych generate` and `diptych chat` sample with, unless told otherwise
OFFLINE_SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "min_p",
                    "repetition_penalty", "seed", "stop")  # fmt: skip


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    add_flags(g, EngineConfig)
    g.add_argument(
        "--engine", default="model", choices=ENGINES,
        help="model: run the weights; sim: a simulated engine on a timing model "
        "(--model then only names the tokenizer) (default: model)",
    )  # fmt: skip
    add_flags(g, SimConfig)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return build(EngineConfig, args, sim=sim_config(args))


def sim_config(args: argparse.Namespace) -> SimConfig | None:
    """`--engine sim`'s SimConfig, or None for the real model."""
    sim = given(SimConfig, args)
    if getattr(args, "engine", "model") != "sim":
        if sim:
            flag = "--profile" if "profile" in sim else "--time-scale or a --sim-* flag"
            raise SystemExit(f"diptych: {flag} needs --engine sim")
        return None
    from engine.sim.timing import load_timing

    try:
        config = construct(SimConfig, sim)
        load_timing(config.profile)  # a bad spec fails here, not in a child
    except (ValueError, OSError) as e:
        raise SystemExit(f"diptych: --engine sim: {e}") from None
    return config


def simulated_model_name(args: argparse.Namespace) -> str | None:
    """Under `--engine sim` clients name the simulated model (its tokenizer's is a proxy)."""
    sim = sim_config(args)
    if sim is None:
        return None
    from engine.sim.timing import load_timing

    return load_timing(sim.profile or DEFAULT_PROFILE).model.name


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    add_flags(g, SamplingParams, only=OFFLINE_SAMPLING,
              defaults={"max_tokens": 256, "temperature": 0.0})  # fmt: skip


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return build(SamplingParams, args)


# -- the control plane ------------------------------------------------------------------


def add_control_plane_args(p: argparse.ArgumentParser | Group) -> None:
    g = p.add_argument_group("control plane") if isinstance(p, argparse.ArgumentParser) else p
    g.add_argument(
        "--etcd", default=None, help="etcd for discovery: host:port[,host:port] (default: embedded)"
    )
    g.add_argument(
        "--discovery", default=None,
        help="discovery by URL instead: etcd://host:port, kubernetes://[namespace] (Leases "
        "through the Kubernetes API; in a pod, its service account and namespace) "
        "(default: --etcd's)",
    )  # fmt: skip
    g.add_argument(
        "--nats",
        default=None,
        help="NATS JetStream for the prefill queue: host:port (default: embedded)",
    )
    g.add_argument(
        "--state-dir", default=None,
        help="embedded control plane directory (when --etcd/--nats are not given) "
        "(default: this machine's default)",
    )  # fmt: skip
    g.add_argument("--namespace", default="default", help="(default: default)")


def _url(scheme: str, value: str | None, state_dir: str | None) -> str:
    if value:
        return value if "://" in value else f"{scheme}://{value}"
    return f"embedded:{state_dir}" if state_dir else "embedded"


def discovery_url(args: argparse.Namespace) -> str:
    url = getattr(args, "discovery", None)
    if url:
        if args.etcd:
            raise SystemExit("diptych: give --etcd or --discovery, not both")
        return str(url)
    return _url("etcd", args.etcd, args.state_dir)


def queue_url(args: argparse.Namespace) -> str:
    return _url("nats", args.nats, args.state_dir)


# -- workers ----------------------------------------------------------------------------


def add_worker_args(p: argparse.ArgumentParser, role: type[WorkerConfig]) -> None:
    """A worker command's own flags: the role's config (WorkerConfig's included)."""
    title = role.__name__.removesuffix("WorkerConfig").lower()
    add_flags(p.add_argument_group(f"{title} worker"), role)


_ANY_ADDRESS = ("0.0.0.0", "::", "")


def _worker_fields(role: type[WorkerConfig], args: argparse.Namespace) -> dict[str, object]:
    fields = given(role, args)
    host = str(fields.get("host", flag_value(args, role, "host")))
    if host in _ANY_ADDRESS and not fields.get("advertise_host"):
        raise SystemExit(
            f"diptych: --host {host or '(empty)'} binds every interface; pass "
            "--advertise-host, the address the frontend and peers dial"
        )
    return {
        **fields,
        "namespace": args.namespace,
        "discovery_url": discovery_url(args),
        "queue_url": queue_url(args),
        "engine": engine_config(args),
    }


def decode_config(args: argparse.Namespace) -> DecodeWorkerConfig:
    return construct(DecodeWorkerConfig, _worker_fields(DecodeWorkerConfig, args))


def prefill_config(args: argparse.Namespace) -> PrefillWorkerConfig:
    return construct(PrefillWorkerConfig, _worker_fields(PrefillWorkerConfig, args))


# -- the frontend -----------------------------------------------------------------------


def add_frontend_args(p: argparse.ArgumentParser, *, skip: tuple[str, ...] = ()) -> None:
    add_flags(p.add_argument_group("frontend"), FrontendConfig, skip=skip)
    add_flags(p.add_argument_group("routing (frontend)"), KvRouterConfig)
    g = p.add_argument_group("API access and overload (frontend)")
    g.add_argument(
        "--api-key", action="append", default=[], metavar="KEY",
        help="require `Authorization: Bearer KEY` on the API (repeat for several keys; "
        "/health, /ready and /metrics stay open). Prefer --api-key-file or the "
        "DIPTYCH_API_KEY environment variable (comma-separated): a flag shows in `ps` "
        "(default: no key needed)",
    )  # fmt: skip
    g.add_argument(
        "--api-key-file", action="append", default=[], metavar="PATH",
        help="a file of accepted API keys, one per line (# comments) (default: none)",
    )  # fmt: skip
    add_flags(g, AdmissionConfig)


def _api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    from frontend.auth import api_keys_from_env, collect_api_keys

    try:
        return collect_api_keys(args.api_key, args.api_key_file, api_keys_from_env())
    except ValueError as e:
        raise SystemExit(f"diptych: {e}") from None


def frontend_config(args: argparse.Namespace) -> FrontendConfig:
    fields = given(FrontendConfig, args)
    sim = sim_config(args) if hasattr(args, "engine") else None
    if sim is not None:
        fields.setdefault("served_model_name", simulated_model_name(args))
        fields["time_scale"] = sim.speedup
    return construct(
        FrontendConfig,
        fields,
        discovery_url=discovery_url(args),
        namespace=args.namespace,
        kv_router=build(KvRouterConfig, args),
        admission=build(AdmissionConfig, args),
        api_keys=_api_keys(args),
    )


# -- serve ------------------------------------------------------------------------------

# what `diptych serve` sets for each worker itself
SERVE_OWNS = ("worker_id", "host", "advertise_host", "metrics_port", "port")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    from diptych.serve_options import ServeOptions

    add_flags(p.add_argument_group("serve"), ServeOptions)
    g = p.add_argument_group("control plane")
    g.add_argument(
        "--state-dir", default=None, help="embedded control plane directory (default: temporary)"
    )
    g.add_argument(
        "--etcd",
        default=None,
        help="use etcd for discovery instead (host:port) (default: embedded)",
    )
    g.add_argument(
        "--discovery",
        default=None,
        help="or discovery by URL (etcd://, kubernetes://) (default: embedded)",
    )
    g.add_argument(
        "--nats",
        default=None,
        help="use NATS JetStream for the queue (host:port) (default: embedded)",
    )
    g.add_argument("--namespace", default="default", help="(default: default)")
    add_engine_args(p)
    workers = p.add_argument_group("workers")
    add_flags(workers, DecodeWorkerConfig, skip=SERVE_OWNS)
    add_flags(workers, PrefillWorkerConfig, skip=SERVE_OWNS)
    add_frontend_args(p)
