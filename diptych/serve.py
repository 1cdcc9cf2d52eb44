"""`diptych serve`: start every role on this machine and print where to send requests."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING

from decode_worker.config import DecodeWorkerConfig
from diptych import options
from diptych.flags import build, flag_value
from diptych.launcher import Launcher, LaunchError
from diptych.local_fleet import ControlServer, LocalFleet
from diptych.planner_options import plan_settings
from diptych.serve_options import ServeOptions
from frontend.config import FrontendConfig

if TYPE_CHECKING:
    from diptych.role_config import RoleConfig
    from planner.config import PlannerConfig, PlanSettings


def _child_args(args: argparse.Namespace, state_dir: str, **role: object) -> argparse.Namespace:
    """The serve flags as one child's flags: the same parsed values, the launcher's
    state directory, and the child's own identity (`role`) on top."""
    worker = {"worker_id": "", "host": "127.0.0.1", "port": 0, "metrics_port": 0}
    return argparse.Namespace(**{**vars(args), **worker, "state_dir": state_dir, **role})


# how long `serve --planner --min-decode 0` holds a request for a decode worker (wall
# seconds): a worker's cold start with room to spare
SCALE_FROM_ZERO_HOLD_S = 300.0


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity; a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def engine_threads(cpus: int, engine_processes: int) -> int:
    """Threads for each engine process `diptych serve` starts on one machine: the CPUs
    but one (the frontend's, and the client's on a benchmark box) shared out evenly,
    at least one each. An engine whose intra-op threads outnumber the free cores loses
    a core mid-step to the frontend and waits for it at every barrier: on 2 vCPUs,
    chat 128/128 with one decode worker measured TPOT 45.6 ms with 2 threads and 28.3 ms
    with 1 at concurrency 1, and 69.5 vs 104.7 output tok/s at concurrency 8."""
    return max(1, (cpus - 1) // max(1, engine_processes))


def serve(args: argparse.Namespace) -> int:
    began = time.monotonic()
    print(
        "diptych serve: starting the workers and the frontend (a first start on a machine "
        "compiles the CPU kernels: minutes; later starts load them from the cache)",
        file=sys.stderr, flush=True,
    )  # fmt: skip
    opts = build(ServeOptions, args)
    if getattr(args, "lora_modules", None) and not hasattr(args, "enable_lora"):
        args.enable_lora = True  # adapters named at start: the workers serve adapters
    tp = getattr(args, "tensor_parallel_size", 1)  # a tensor-parallel engine: a process a rank
    prefill_tp = opts.prefill_tensor_parallel_size or tp
    # experts spread over every rank of each role (a prefill worker's own TP size)
    ep = getattr(args, "expert_parallel_size", 1)
    prefill_ep = {"expert_parallel_size": prefill_tp} if ep > 1 else {}
    if not hasattr(args, "threads"):
        engines = opts.decode_workers * tp + opts.prefill_workers * prefill_tp
        args.threads = engine_threads(usable_cpus(), engines)
    for pool, size in (("prefill", prefill_tp), ("decode", tp)):  # what a worker costs
        if not hasattr(args, f"{pool}_accelerators"):  # the planner's budget
            setattr(args, f"{pool}_accelerators", size)
    planning = getattr(args, "planner", None) is not None
    plan = plan_settings(args) if planning else None  # bad planner flags fail here
    if plan is not None and plan.min_decode == 0 and not hasattr(args, "hold_for_workers"):
        # the decode pool may scale to zero: the frontend holds requests until it is back
        args.hold_for_workers = SCALE_FROM_ZERO_HOLD_S
    if planning and args.planner_profile:  # and a profile named but unreadable
        from diptych.planner_process import check_profile

        check_profile(args.planner_profile)
    front = options.frontend_config(args)  # bad flags fail here, before any process starts
    # under a planner the prefill pool may grow from zero: decode workers must be
    # ready to hand prompts to it (with no prefill worker they prefill locally)
    alone = {"no_remote_prefill": True} if opts.prefill_workers == 0 and not planning else {}
    decode = options.decode_config(_child_args(args, "/", **alone))
    launcher = Launcher(state_dir=args.state_dir)
    stop: list[int] = []  # the signal handler only appends: no locks in handlers

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.append(signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    state = launcher.state_dir
    local = not decode.remote_prefill
    verbose = bool(args.verbose)
    config_of: dict[str, Callable[[str], RoleConfig]] = {
        "decode": lambda wid: options.decode_config(
            _child_args(args, state, worker_id=wid, no_remote_prefill=local)
        ),
        "prefill": lambda wid: options.prefill_config(
            _child_args(args, state, worker_id=wid, tensor_parallel_size=prefill_tp,
                        **prefill_ep)
        ),
    }
    fleet = LocalFleet(launcher, config_of, drain_timeout=decode.drain_timeout, verbose=verbose)
    control: ControlServer | None = None
    try:
        children = [(f"decode-{i}", "decode") for i in range(opts.decode_workers)]
        children += [(f"prefill-{i}", "prefill") for i in range(opts.prefill_workers)]
        # in waves: dozens of workers importing torch at once on a few cores starve the
        # control plane they must reach within its timeouts
        wave = opts.startup_parallelism or max(4, 2 * (os.cpu_count() or 1))
        frontend = None
        for first in range(0, len(children), wave):
            started = [
                launcher.spawn(name, role, config_of[role](name), verbose=verbose)
                for name, role in children[first : first + wave]
            ]
            if frontend is None:  # it starts beside the first workers: it only watches
                # discovery until they join, and its imports overlap their model loads
                config = options.frontend_config(
                    _child_args(args, state, host=front.host, port=front.port)
                )
                frontend = launcher.spawn("frontend", "frontend", config, verbose=verbose)
            for w in started:
                launcher.wait_ready(w, opts.startup_timeout, lambda: bool(stop))
        fleet.adopt("decode", opts.decode_workers)
        fleet.adopt("prefill", opts.prefill_workers)
        assert frontend is not None  # there is at least one decode worker
        details = launcher.wait_ready(frontend, opts.startup_timeout, lambda: bool(stop))
        url = str(details.get("url", f"http://{front.host}:{front.port}"))
        # the frontend is up, but finds the workers through discovery: "serving" only once
        # it knows one, so a request sent at once is not answered 503
        _wait_until_routable(url, opts.startup_timeout, lambda: bool(stop))
        planner_details: dict[str, object] = {}
        if plan is not None:
            control = ControlServer(fleet)
            launcher.extra_manifest["control"] = control.url
            decode_details = launcher.children[0].details
            pconfig = _planner_config(args, plan, decode, state, url, control.url, decode_details)
            child = launcher.spawn("planner", "planner", pconfig, verbose=verbose)
            planner_details = launcher.wait_ready(child, opts.startup_timeout, lambda: bool(stop))
    except (LaunchError, OSError) as e:
        print(f"diptych serve: {e}", file=sys.stderr)
        if control is not None:
            control.close()
        launcher.shutdown()
        return 1
    launcher.write_manifest()
    mode = (
        f"{opts.prefill_workers} prefill + {opts.decode_workers} decode workers, "
        f"{decode.transfer_backend} transfer"
        if opts.prefill_workers
        else f"aggregated: {opts.decode_workers} decode workers"
    )
    plane = "embedded control plane" if not (args.etcd or args.nats) else "etcd/NATS"
    print(
        f"Diptych is serving {details.get('model', 'the model')} at {url}/v1 "
        f"({mode}, {plane}; ready in {time.monotonic() - began:.0f} s)."
    )
    kernels = launcher.children[0].details.get("kernels")
    if kernels:
        print(f"Kernels: {kernels}")
    if planner_details:
        policy = planner_details.get("policy", plan.policy if plan else "")
        print(f"Planner ({policy} policy): {planner_details['dashboard']}")
    print("Stop with Ctrl-C.", flush=True)
    code = _supervise(launcher, fleet, stop)
    if control is not None:
        control.close()
    launcher.shutdown()
    return code


def _wait_until_routable(url: str, timeout: float, stopping: Callable[[], bool]) -> None:
    """Until the frontend's /ready says it knows a decode worker."""
    import httpx

    end = time.monotonic() + timeout
    while time.monotonic() < end and not stopping():
        try:
            r = httpx.get(f"{url}/ready", timeout=2.0, verify=False)  # our child, on loopback
            if r.status_code == 200 and r.json().get("decode_workers", 0) > 0:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.05)
    if not stopping():
        raise LaunchError(f"the frontend at {url} saw no decode worker within {timeout:.0f} s")


def _planner_config(
    args: argparse.Namespace,
    plan: PlanSettings,
    decode: DecodeWorkerConfig,
    state: str,
    frontend_url: str,
    control_url: str,
    details: dict[str, object],
) -> PlannerConfig:
    from planner.config import PlannerConfig

    sim = decode.engine.sim
    profile = args.planner_profile or (sim.profile if sim else None)
    kv_tokens = details.get("kv_tokens")
    return PlannerConfig(
        plan=plan,
        profile=profile,
        max_batch=int(str(details.get("max_batch") or decode.engine.max_num_seqs)),
        kv_tokens=int(str(kv_tokens)) if kv_tokens is not None else None,
        frontend_urls=(frontend_url,),
        discovery_url=options.discovery_url(_child_args(args, state)),
        namespace=args.namespace,
        host=str(flag_value(args, FrontendConfig, "host")),
        port=args.planner_port,
        connector="local",
        connector_options={"url": control_url},
        time_scale=sim.speedup if sim else 1.0,
    )


def _supervise(launcher: Launcher, fleet: LocalFleet, stop: list[int]) -> int:
    """Keep the pools at their desired sizes: restart workers that die (their requests
    fall back or migrate meanwhile), start and drain workers as the planner asks. A
    dead frontend, or a worker that keeps dying, ends the server.

    Polls with sleep rather than waiting on a threading.Event: the stop request comes
    from a signal handler, which must not touch a lock the main thread may hold."""
    ready = _readiness(launcher)
    while not stop:
        for c in list(launcher.children):
            if c.proc.poll() is None or fleet.is_retiring(c):
                continue
            if c.name.startswith("frontend"):
                print(f"diptych serve: {c.death_report()}\n  stopping", file=sys.stderr)
                return 1
            print(f"diptych serve: {c.death_report()}\n  restarting it", file=sys.stderr)
            try:
                launcher.respawn(c)
            except LaunchError as e:
                print(f"diptych serve: {e}; stopping", file=sys.stderr)
                return 1
        changed = fleet.reconcile()
        now_ready = _readiness(launcher)
        if changed or now_ready != ready:
            ready = now_ready
            launcher.write_manifest()
        time.sleep(0.25)
    return 0


def _readiness(launcher: Launcher) -> tuple[tuple[str, bool], ...]:
    return tuple((c.name, c.ready.is_set()) for c in launcher.children)
