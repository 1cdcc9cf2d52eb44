"""`diptych simulate`'s flags and the routers it can simulate, apart from the
simulator so that building the command line's parser imports no engine."""

from __future__ import annotations

import argparse

from bench.cli import add_arguments as add_bench_arguments
from diptych.planner_options import add_planner_arguments
from engine.sim.config import DEFAULT_PROFILE

ROUTERS = ("kv", "kv-approx", "kv-session", "least-loaded", "oracle")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_bench_arguments(p)
    g = p.add_argument_group("simulated fleet")
    g.add_argument(
        "--profile",
        default=DEFAULT_PROFILE,
        help="timing: ACCELERATOR:MODEL[:tpN] or a `diptych profile` JSON",
    )
    g.add_argument("--prefill-workers", type=int, default=1, help="0 runs aggregated")
    g.add_argument("--decode-workers", type=int, default=1)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV blocks per worker (default: what the device holds)",
    )
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--no-chunked-prefill", action="store_true")
    g.add_argument("--min-remote-prefill-tokens", type=int, default=128)
    g.add_argument("--min-remote-prefill-share", type=float, default=0.5)
    g.add_argument("--max-local-prefill-tokens", type=int, default=4096)
    g.add_argument("--max-queue-depth", type=int, default=64)
    g.add_argument("--max-batch", type=int, default=8, help="prompts a prefill worker holds")
    g.add_argument(
        "--transfer-gbps",
        type=float,
        default=400.0,
        help="KV transfer bandwidth per worker, Gbit/s (400: one ConnectX-7)",
    )
    g.add_argument("--sim-mean-output-tokens", type=int, default=256)
    g.add_argument(
        "--timeline-every",
        type=float,
        default=None,
        help="timeline sample period, simulated s (default: 1/400 of the run)",
    )
    g.add_argument(
        "--trace",
        default=None,
        help="a Mooncake-format JSONL trace (timestamp ms, input_length, output_length, "
        "hash_ids) instead of the --dataset-name workload and --request-rate",
    )
    g.add_argument(
        "--trace-block-tokens", type=int, default=512, help="tokens each trace hash id stands for"
    )
    g.add_argument(
        "--startup", type=float, default=60.0, help="seconds from scale-up to a ready worker"
    )
    r = p.add_argument_group("simulated routing")
    r.add_argument(
        "--router", choices=ROUTERS, default="kv",
        help="the frontend's router: kv (KV events), kv-approx (predicted from its own "
        "routing), kv-session (X-Session-Id hint), least-loaded, or oracle (the KV router "
        "reading every worker's cache and load directly: the bound)",
    )  # fmt: skip
    r.add_argument("--frontends", type=int, default=1, help="frontend replicas, one router each")
    r.add_argument(
        "--event-latency-ms", type=float, default=1.0,
        help="worker -> frontend delay of KV events and load reports",
    )  # fmt: skip
    r.add_argument("--router-overlap-weight", type=float, default=4.0)
    r.add_argument("--router-temperature", type=float, default=0.0)
    add_planner_arguments(p)
