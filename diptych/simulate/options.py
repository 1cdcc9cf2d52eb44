"""`diptych simulate`'s flags and the routers it can simulate, apart from the
simulator so that building the command line's parser imports no engine."""

from __future__ import annotations

import argparse

from bench.cli import add_arguments as add_bench_arguments
from decode_worker.config import DecodeWorkerConfig
from diptych.flags import add_flags
from diptych.planner_options import add_planner_arguments
from diptych.serve_options import ServeOptions
from engine.config import EngineConfig
from engine.sim.config import SimConfig
from frontend.config import KvRouterConfig
from prefill_worker.config import PrefillWorkerConfig

ROUTERS = ("kv", "kv-approx", "kv-session", "least-loaded", "oracle")
# the declared flags a simulated fleet takes: those that shape its timing and scheduling
SIM_FLAGS = ("profile", "mean_output_tokens")
ENGINE_FLAGS = ("block_size", "num_blocks", "max_num_batched_tokens", "max_num_seqs",
                "max_model_len", "enable_prefix_caching", "enable_chunked_prefill",
                "kv_host_memory_bytes")  # fmt: skip
DECODE_FLAGS = ("min_remote_prefill_tokens", "min_remote_prefill_share",
                "max_local_prefill_tokens", "max_queue_depth")  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_bench_arguments(p)
    g = p.add_argument_group("simulated fleet")
    add_flags(g, SimConfig, only=SIM_FLAGS)
    add_flags(g, ServeOptions, only=("prefill_workers", "decode_workers"))
    add_flags(g, EngineConfig, only=ENGINE_FLAGS)
    add_flags(g, DecodeWorkerConfig, only=DECODE_FLAGS)
    add_flags(g, PrefillWorkerConfig, only=("max_batch",))
    g.add_argument(
        "--transfer-gbps",
        type=float,
        default=400.0,
        help="KV transfer line rate per worker, Gbit/s (400: one ConnectX-7); the "
        "simulation moves KV at 375/400 of it, what a healthy NDR port achieves",
    )
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
    add_flags(r, KvRouterConfig, only=("overlap_weight", "temperature", "peer_pull",
                                      "peer_pull_cost", "peer_pull_min_blocks",
                                      "host_hit_cost", "disk_hit_cost"))
    add_planner_arguments(p)
