"""`diptych serve`: start every role on this machine and print where to send requests."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from types import FrameType
from typing import Any

from diptych import options
from diptych.launcher import Launcher, LaunchError
from diptych.local_fleet import ControlServer, LocalFleet
from diptych.planner_options import plan_settings


def _child_args(args: Any, state_dir: str, **role: Any) -> argparse.Namespace:
    """The serve flags as one child's flags: the same parsed values, the launcher's
    state directory, and the child's own identity (`role`) on top."""
    worker = {"worker_id": "", "host": "127.0.0.1", "port": 0, "metrics_port": 0}
    return argparse.Namespace(**{**vars(args), **worker, "state_dir": state_dir, **role})


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


def serve(args: Any) -> int:
    if args.prefill_workers < 0 or args.decode_workers < 1:
        raise ValueError("need --decode-workers >= 1 and --prefill-workers >= 0")
    if getattr(args, "threads", None) is None:
        engines = args.decode_workers + args.prefill_workers
        args.threads = engine_threads(usable_cpus(), engines)
    planning = getattr(args, "planner", None) is not None
    plan = plan_settings(args) if planning else None  # bad planner flags fail here
    launcher = Launcher(state_dir=args.state_dir)
    stop: list[int] = []  # the signal handler only appends: no locks in handlers

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.append(signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    state = launcher.state_dir
    # under a planner the prefill pool may grow from zero: decode workers must be
    # ready to hand prompts to it (with no prefill worker they prefill locally)
    local = args.no_remote_prefill or (args.prefill_workers == 0 and not planning)
    verbose = bool(args.verbose)
    config_of = {
        "decode": lambda wid: options.decode_config(
            _child_args(args, state, worker_id=wid, no_remote_prefill=local)
        ),
        "prefill": lambda wid: options.prefill_config(_child_args(args, state, worker_id=wid)),
    }
    fleet = LocalFleet(launcher, config_of, drain_timeout=args.drain_timeout, verbose=verbose)
    control: ControlServer | None = None
    try:
        children = [(f"decode-{i}", "decode") for i in range(args.decode_workers)]
        children += [(f"prefill-{i}", "prefill") for i in range(args.prefill_workers)]
        # in waves: dozens of workers importing torch at once on a few cores starve the
        # control plane they must reach within its timeouts
        wave = args.startup_parallelism or max(4, 2 * (os.cpu_count() or 1))
        for first in range(0, len(children), wave):
            started = [
                launcher.spawn(name, role, config_of[role](name), verbose=verbose)
                for name, role in children[first : first + wave]
            ]
            for w in started:
                launcher.wait_ready(w, args.startup_timeout, lambda: bool(stop))
        fleet.adopt("decode", args.decode_workers)
        fleet.adopt("prefill", args.prefill_workers)
        config = options.frontend_config(_child_args(args, state, host=args.host, port=args.port))
        frontend = launcher.spawn("frontend", "frontend", config, verbose=verbose)
        details = launcher.wait_ready(frontend, args.startup_timeout, lambda: bool(stop))
        url = details.get("url", f"http://{args.host}:{args.port}")
        planner_details: dict[str, Any] = {}
        if plan is not None:
            control = ControlServer(fleet)
            launcher.extra_manifest["control"] = control.url
            decode_details = launcher.children[0].details
            pconfig = _planner_config(args, plan, state, url, control.url, decode_details)
            child = launcher.spawn("planner", "planner", pconfig, verbose=verbose)
            planner_details = launcher.wait_ready(child, args.startup_timeout, lambda: bool(stop))
    except (LaunchError, OSError) as e:
        print(f"diptych serve: {e}", file=sys.stderr)
        if control is not None:
            control.close()
        launcher.shutdown()
        return 1
    launcher.write_manifest()
    mode = (
        f"{args.prefill_workers} prefill + {args.decode_workers} decode workers, "
        f"{args.transfer} transfer"
        if args.prefill_workers
        else f"aggregated: {args.decode_workers} decode workers"
    )
    plane = "embedded control plane" if not (args.etcd or args.nats) else "etcd/NATS"
    print(f"Diptych is serving {details.get('model', 'the model')} at {url}/v1 ({mode}, {plane}).")
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


def _planner_config(
    args: Any, plan: Any, state: str, frontend_url: str, control_url: str, decode: dict[str, Any]
) -> Any:
    from engine.sim.config import DEFAULT_PROFILE
    from planner.config import PlannerConfig

    sim = getattr(args, "engine", "model") == "sim"
    profile = args.planner_profile or ((args.profile or DEFAULT_PROFILE) if sim else None)
    return PlannerConfig(
        plan=plan,
        profile=profile,
        max_batch=int(decode.get("max_batch") or args.max_num_seqs),
        kv_tokens=decode.get("kv_tokens"),
        frontend_urls=(frontend_url,),
        discovery_url=options.discovery_url(_child_args(args, state)),
        namespace=args.namespace,
        host=args.host,
        port=args.planner_port,
        connector="local",
        connector_options={"url": control_url},
        time_scale=args.time_scale if sim else 1.0,
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
