"""OpenAI-API load generator compatible with `vllm bench serve`: `diptych bench`.

Workloads (`bench.workloads`) are built with the served model's tokenizer so prompt
lengths are exact; `bench.runner` sends them with Poisson/gamma arrivals or a
concurrency cap; `bench.metrics` turns what the client saw into vLLM's figures and
JSON keys; a list of request rates is a sweep, plotted by `bench.plot`.

Nothing here imports Diptych's serving code: the server is reached over HTTP only,
and `engine.tokenizer` is used for the tokenizer alone.
"""

from bench.benchmark import run_benchmark
from bench.cli import build_parser, config_from_args, main
from bench.config import BenchConfig
from bench.metrics import RequestResult, compute_metrics
from bench.plot import plot_sweep
from bench.request import Request
from bench.slo import parse_goodput
from bench.workloads import PromptBuilder, WorkloadSpec, build_workload

__all__ = [
    "BenchConfig",
    "PromptBuilder",
    "Request",
    "RequestResult",
    "WorkloadSpec",
    "build_parser",
    "build_workload",
    "compute_metrics",
    "config_from_args",
    "main",
    "parse_goodput",
    "plot_sweep",
    "run_benchmark",
]
