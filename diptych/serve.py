"""`diptych serve`: start every role on this machine and print where to send requests."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from types import FrameType
from typing import Any

from diptych import options
from diptych.launcher import Launcher, LaunchError


def _child_args(args: Any, state_dir: str, **role: Any) -> argparse.Namespace:
    """The serve flags as one child's flags: the same parsed values, the launcher's
    state directory, and the child's own identity (`role`) on top."""
    worker = {"worker_id": "", "host": "127.0.0.1", "port": 0, "metrics_port": 0}
    return argparse.Namespace(**{**vars(args), **worker, "state_dir": state_dir, **role})


def serve(args: Any) -> int:
    if args.prefill_workers < 0 or args.decode_workers < 1:
        raise ValueError("need --decode-workers >= 1 and --prefill-workers >= 0")
    launcher = Launcher(state_dir=args.state_dir)
    stop: list[int] = []  # the signal handler only appends: no locks in handlers

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.append(signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    state = launcher.state_dir
    local = args.no_remote_prefill or args.prefill_workers == 0
    verbose = bool(args.verbose)
    try:
        children = []
        for i in range(args.decode_workers):
            child = _child_args(args, state, worker_id=f"decode-{i}", no_remote_prefill=local)
            children.append((f"decode-{i}", "decode", options.decode_config(child)))
        for i in range(args.prefill_workers):
            config = options.prefill_config(_child_args(args, state, worker_id=f"prefill-{i}"))
            children.append((f"prefill-{i}", "prefill", config))
        # in waves: dozens of workers importing torch at once on a few cores starve the
        # control plane they must reach within its timeouts
        wave = args.startup_parallelism or max(4, 2 * (os.cpu_count() or 1))
        for first in range(0, len(children), wave):
            started = [
                launcher.spawn(name, role, config, verbose=verbose)
                for name, role, config in children[first : first + wave]
            ]
            for w in started:
                launcher.wait_ready(w, args.startup_timeout, lambda: bool(stop))
        config = options.frontend_config(_child_args(args, state, host=args.host, port=args.port))
        frontend = launcher.spawn("frontend", "frontend", config, verbose=verbose)
        details = launcher.wait_ready(frontend, args.startup_timeout, lambda: bool(stop))
    except LaunchError as e:
        print(f"diptych serve: {e}", file=sys.stderr)
        launcher.shutdown()
        return 1
    url = details.get("url", f"http://{args.host}:{args.port}")
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
    print("Stop with Ctrl-C.", flush=True)
    code = _supervise(launcher, stop, args.startup_timeout)
    launcher.shutdown()
    return code


def _supervise(launcher: Launcher, stop: list[int], startup_timeout: float) -> int:
    """Restart workers that die (their requests fall back or migrate meanwhile); a dead
    frontend, or a worker that keeps dying, ends the server."""
    while True:
        died = launcher.wait_any_exit(lambda: bool(stop))
        if died is None:
            return 0
        if died.name.startswith("frontend"):
            print(f"diptych serve: {died.death_report()}\n  stopping", file=sys.stderr)
            return 1
        print(f"diptych serve: {died.death_report()}\n  restarting it", file=sys.stderr)
        try:
            fresh = launcher.respawn(died)
            launcher.wait_ready(fresh, startup_timeout, lambda: bool(stop))
            launcher.write_manifest()
        except LaunchError as e:
            print(f"diptych serve: {e}; stopping", file=sys.stderr)
            return 1
