"""`diptych serve`: start every role on this machine and print where to send requests."""

from __future__ import annotations

import signal
import sys
from types import FrameType
from typing import Any

from diptych.launcher import Launcher, LaunchError


def _engine_flags(args: Any) -> list[str]:
    flags = [
        "--dtype", args.dtype,
        "--kv-cache-memory", str(args.kv_cache_memory),
        "--block-size", str(args.block_size),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--max-num-seqs", str(args.max_num_seqs),
    ]  # fmt: skip
    if args.model:
        flags += ["--model", args.model]
    if args.device:
        flags += ["--device", args.device]
    if args.num_blocks:
        flags += ["--num-blocks", str(args.num_blocks)]
    if args.max_model_len:
        flags += ["--max-model-len", str(args.max_model_len)]
    if args.no_prefix_caching:
        flags.append("--no-prefix-caching")
    if args.no_weight_prepack:
        flags.append("--no-weight-prepack")
    return flags


def _role(args: Any, state_dir: str, role: str, *flags: str) -> list[str]:
    """`[-v] <role> <flags> <control plane>`: the command line of one child."""
    plane = ["--state-dir", state_dir, "--namespace", args.namespace]
    if args.etcd:
        plane += ["--etcd", args.etcd]
    if args.nats:
        plane += ["--nats", args.nats]
    return [*(["-v"] if args.verbose else []), role, *flags, *plane]


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
    engine = _engine_flags(args)
    disagg = [
        "--transfer", args.transfer,
        "--min-remote-prefill-tokens", str(args.min_remote_prefill_tokens),
        "--max-queue-depth", str(args.max_queue_depth),
        "--remote-prefill-timeout", str(args.remote_prefill_timeout),
    ]  # fmt: skip
    if args.no_remote_prefill or args.prefill_workers == 0:
        disagg.append("--no-remote-prefill")
    try:
        workers = []
        for i in range(args.decode_workers):
            cmd = _role(args, state, "decode", "--worker-id", f"decode-{i}", *engine, *disagg)
            workers.append(launcher.spawn(f"decode-{i}", cmd))
        for i in range(args.prefill_workers):
            flags = ["--worker-id", f"prefill-{i}", *engine, "--transfer", args.transfer]
            workers.append(launcher.spawn(f"prefill-{i}", _role(args, state, "prefill", *flags)))
        for w in workers:
            launcher.wait_ready(w, args.startup_timeout, lambda: bool(stop))
        front = ["--host", args.host, "--port", str(args.port)]
        if args.model:
            front += ["--model", args.model]
        if args.served_model_name:
            front += ["--served-model-name", args.served_model_name]
        frontend = launcher.spawn("frontend", _role(args, state, "frontend", *front))
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
    kernels = workers[0].details.get("kernels")
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
