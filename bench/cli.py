"""`diptych bench` (also `python -m bench`): flags named as in `vllm bench serve`.

    diptych bench --num-prompts 200 --random-input-len 512 --random-output-len 128 \\
        --max-concurrency 8 --temperature 0
    diptych bench --dataset-name bursty --request-rate 1,2,4,8,inf \\
        --goodput ttft:2000 tpot:100 --result-dir results/
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from bench.arrivals import parse_rates
from bench.config import BenchConfig
from bench.slo import parse_goodput
from bench.workloads.spec import WORKLOADS, WorkloadSpec

# Workloads whose output lengths are designed: EOS is ignored unless --no-ignore-eos.
_FIXED_LENGTH = ("random", "bursty", "multiturn", "agentic", "reasoning")


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default=None, help="server URL (default http://HOST:PORT)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument(
        "--backend",
        default="openai",
        choices=["openai", "openai-chat", "vllm"],
        help="openai/vllm: /v1/completions; openai-chat: /v1/chat/completions",
    )
    g.add_argument("--endpoint", default=None, help="API path (default: by --backend)")
    g.add_argument("--model", default=None, help="model name (default: the server's first)")
    g.add_argument("--served-model-name", default=None, help="alias of --model")
    g.add_argument(
        "--tokenizer",
        default=None,
        help="a .gguf file or HF directory whose tokenizer builds the prompts "
        "(default: Diptych's default model, SmolLM2-135M-Instruct)",
    )
    g.add_argument("--header", nargs="*", default=[], metavar="KEY=VALUE")
    g.add_argument("--request-timeout", type=float, default=6 * 3600.0, help="seconds")
    g.add_argument(
        "--ready-check-timeout-sec",
        type=float,
        default=0.0,
        help="retry a test request this long before starting (0: no check)",
    )

    g = p.add_argument_group("workload")
    g.add_argument("--dataset-name", default="random", choices=WORKLOADS)
    g.add_argument(
        "--dataset-path",
        default=None,
        help='sharegpt: a ShareGPT .json; custom: .jsonl ({"prompt": ...}) or .txt',
    )
    g.add_argument("--num-prompts", type=int, default=1000)
    g.add_argument("--input-len", type=int, default=None, help="sets --random-input-len")
    g.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="output length of every workload but the bursty long prompts",
    )
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0)
    g.add_argument("--random-prefix-len", type=int, default=0)
    g.add_argument("--sharegpt-output-len", type=int, default=None)
    g.add_argument("--custom-output-len", type=int, default=256)
    g.add_argument(
        "--bursty-short-sharegpt",
        action="store_true",
        help="the short requests take ShareGPT-like lengths instead of the fixed ones",
    )
    g.add_argument("--bursty-short-input-len", type=int, default=128)
    g.add_argument("--bursty-short-output-len", type=int, default=128)
    g.add_argument("--bursty-long-input-len", type=int, default=2048)
    g.add_argument("--bursty-long-output-len", type=int, default=16)
    g.add_argument("--bursty-long-every", type=int, default=8, help="every k-th request is long")
    g.add_argument("--multiturn-turns", type=int, default=4)
    g.add_argument("--multiturn-system-len", type=int, default=512)
    g.add_argument("--multiturn-num-system-prompts", type=int, default=4)
    g.add_argument("--multiturn-user-len", type=int, default=64)
    g.add_argument("--multiturn-output-len", type=int, default=64)
    g.add_argument("--multiturn-think-time", type=float, default=0.0, help="seconds")
    g.add_argument("--agentic-tool-len", type=int, default=256,
                   help="agentic: a tool result's mean tokens (lognormal)")  # fmt: skip
    g.add_argument("--agentic-tool-len-sigma", type=float, default=0.5)
    g.add_argument("--agentic-tool-latency", type=float, default=1.0,
                   help="agentic: a tool's mean seconds (exponential) before the next "
                   "turn")  # fmt: skip
    g.add_argument(
        "--multiturn-system-prompt-share", type=float, default=None,
        help="the share of sessions on the first system prompt (a skewed workload: one "
        "prompt most traffic shares); the rest spread evenly over the others (default: "
        "every session picks one uniformly)",
    )  # fmt: skip
    g.add_argument("--reasoning-input-len", type=int, default=256)
    g.add_argument("--reasoning-low-thinking", type=int, default=64,
                   help="reasoning: a low-effort request's thinking budget")  # fmt: skip
    g.add_argument("--reasoning-high-thinking", type=int, default=2000,
                   help="reasoning: a high-effort request's thinking budget")  # fmt: skip
    g.add_argument("--reasoning-answer-len", type=int, default=64,
                   help="reasoning: tokens of answer after the thinking")  # fmt: skip
    g.add_argument("--reasoning-high-every", type=int, default=5,
                   help="reasoning: every k-th request is high-effort")  # fmt: skip
    g.add_argument(
        "--session-header", action="store_true",
        help="send each multi-turn request's session as an X-Session-Id header",
    )  # fmt: skip

    g = p.add_argument_group("load")
    g.add_argument(
        "--request-rate",
        default="inf",
        help="req/s, or a comma-separated list for a sweep, e.g. 1,2,4,inf",
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of inter-arrival gaps: 1 Poisson, <1 burstier",
    )
    g.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="the server runs simulated time this many times faster than the wall "
        "(`diptych serve --engine sim --time-scale`): rates, think times and every "
        "reported duration are in simulated seconds",
    )
    g.add_argument("--max-concurrency", type=int, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--num-warmups", type=int, default=0)

    g = p.add_argument_group("sampling")
    g.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"default: on for {', '.join(_FIXED_LENGTH)} and synthetic sharegpt",
    )
    for name in (
        "temperature",
        "top-p",
        "min-p",
        "frequency-penalty",
        "presence-penalty",
        "repetition-penalty",
    ):
        g.add_argument(f"--{name}", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--extra-body", type=json.loads, default=None, help="JSON merged into bodies")

    g = p.add_argument_group("results")
    g.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="KEY:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:10000",
    )
    g.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    g.add_argument("--metric-percentiles", default="50,90,95,99")
    g.add_argument("--save-result", action="store_true")
    g.add_argument(
        "--save-detailed",
        action="store_true",
        help="keep per-request lists (ttfts, itls, texts, errors) in the JSON",
    )
    g.add_argument("--result-dir", default=None)
    g.add_argument("--result-filename", default=None)
    g.add_argument("--label", default=None)
    g.add_argument("--metadata", nargs="*", default=[], metavar="KEY=VALUE")
    g.add_argument("--plot", default=None, help="PNG path of a sweep's plot")
    g.add_argument("--disable-tqdm", "--no-progress", dest="no_progress", action="store_true")


def _pairs(items: Sequence[str], flag: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{flag} {item!r} is not KEY=VALUE")
        out[key.strip()] = value.strip()
    return out


def _headers(items: Sequence[str]) -> dict[str, str]:
    """--header pairs, plus a bearer token from $OPENAI_API_KEY (as vLLM does)."""
    out = _pairs(items, "--header")
    key = os.environ.get("OPENAI_API_KEY")
    if key and not any(k.lower() == "authorization" for k in out):
        out["Authorization"] = f"Bearer {key}"
    return out


def config_from_args(args: Any) -> BenchConfig:
    out_len = args.output_len
    spec = WorkloadSpec(
        name=args.dataset_name,
        num_prompts=args.num_prompts,
        seed=args.seed,
        dataset_path=args.dataset_path,
        input_len=args.input_len or args.random_input_len,
        output_len=out_len or args.random_output_len,
        range_ratio=args.random_range_ratio,
        prefix_len=args.random_prefix_len,
        sharegpt_output_len=out_len or args.sharegpt_output_len,
        custom_output_len=out_len or args.custom_output_len,
        short_sharegpt=args.bursty_short_sharegpt,
        short_input_len=args.bursty_short_input_len,
        short_output_len=out_len or args.bursty_short_output_len,
        long_input_len=args.bursty_long_input_len,
        long_output_len=args.bursty_long_output_len,
        long_every=args.bursty_long_every,
        turns=args.multiturn_turns,
        system_len=args.multiturn_system_len,
        num_systems=args.multiturn_num_system_prompts,
        user_len=args.multiturn_user_len,
        turn_output_len=out_len or args.multiturn_output_len,
        think_time=args.multiturn_think_time,
        system_share=args.multiturn_system_prompt_share,
        tool_len=args.agentic_tool_len,
        tool_len_sigma=args.agentic_tool_len_sigma,
        tool_latency=args.agentic_tool_latency,
        reasoning_input_len=args.reasoning_input_len,
        low_thinking=args.reasoning_low_thinking,
        high_thinking=args.reasoning_high_thinking,
        answer_len=args.reasoning_answer_len,
        high_every=args.reasoning_high_every,
    )
    ignore_eos = args.ignore_eos
    if ignore_eos is None:
        synthetic_sharegpt = spec.name == "sharegpt" and not spec.dataset_path
        ignore_eos = spec.name in _FIXED_LENGTH or synthetic_sharegpt
    sampling = {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "frequency_penalty": args.frequency_penalty,
        "presence_penalty": args.presence_penalty,
        "repetition_penalty": args.repetition_penalty,
    }
    extra = {k: v for k, v in sampling.items() if v is not None} | (args.extra_body or {})
    endpoint = args.endpoint or (
        "/v1/chat/completions" if args.backend == "openai-chat" else "/v1/completions"
    )
    return BenchConfig(
        base_url=args.base_url or f"http://{args.host}:{args.port}",
        endpoint=endpoint,
        backend=args.backend,
        model=args.model or args.served_model_name,
        tokenizer=args.tokenizer,
        label=args.label,
        workload=spec,
        rates=parse_rates(args.request_rate),
        burstiness=args.burstiness,
        time_scale=args.time_scale,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        ignore_eos=ignore_eos,
        extra_body=extra,
        headers=_headers(args.header),
        session_header=args.session_header,
        goodput=parse_goodput(args.goodput),
        percentiles=[float(p) for p in args.metric_percentiles.split(",") if p.strip()],
        percentile_metrics=[m.strip() for m in args.percentile_metrics.split(",") if m.strip()],
        num_warmups=args.num_warmups,
        ready_check_timeout_s=args.ready_check_timeout_sec,
        request_timeout_s=args.request_timeout,
        save_result=args.save_result,
        save_detailed=args.save_detailed,
        result_dir=args.result_dir,
        result_filename=args.result_filename,
        plot=args.plot,
        metadata=_pairs(args.metadata, "--metadata"),
        progress=not args.no_progress,
    )


def run_from_args(args: Any) -> int:
    """Entry point of `diptych bench`: 0 when at least one request of each run completed."""
    from bench.benchmark import run_benchmark

    docs = asyncio.run(run_benchmark(config_from_args(args)))
    return 0 if all(d["completed"] > 0 for d in docs) else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="diptych bench",
        description="Benchmark an OpenAI-compatible server (flags as in `vllm bench serve`).",
    )
    add_arguments(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run_from_args(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"diptych bench: error: {e}", file=sys.stderr)
        return 2
