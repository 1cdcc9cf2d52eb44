"""One workload against Diptych and its peers, on the same model and machine, in one run.

    python benchmarks/peers.py [--concurrency 1,8,32] [--input-len 256] [--output-len 128]
        [--peers diptych-aggregated,diptych-disaggregated,llama-cpp-python,transformers-serve]
        [--json peers.json] [--write-docs]

Peers, one after another (never two servers at once):

- diptych-aggregated / diptych-disaggregated: `diptych serve` with `--prefill-workers 0`,
  or with one prefill and one decode worker (shm transfer); default bf16 settings.
- llama-cpp-python: its OpenAI server (`python -m llama_cpp.server`) on the same GGUF
  file, all CPU threads, its own Q4_1 kernels (no dequantization).
- transformers-serve: `transformers serve` (continuous batching, bfloat16, offline) on
  the same GGUF dequantized once into a local safetensors checkpoint (its own GGUF
  path fails offline). Reported as unavailable if it cannot start.

Every peer gets the same `diptych bench` workload per concurrency: random prompts of
exactly --input-len tokens (the model's tokenizer), greedy, --output-len tokens with
EOS ignored (llama-cpp-python gets `min_tokens` and transformers `min_new_tokens`,
as neither has `ignore_eos`), with
`--max-concurrency` at each level and as many requests as the level allows
(max(16, 3 x concurrency)), fresh prompts per level, two warm-up requests first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import build_parser, config_from_args, run_benchmark  # noqa: E402
from bench.workloads import PromptBuilder, load_tokenizer  # noqa: E402
from benchmarks import machine  # noqa: E402
from benchmarks.docs_section import write_subsection  # noqa: E402
from benchmarks.servers import (  # noqa: E402
    MODEL_NAME,
    ServerProcess,
    ServerUnavailable,
    diptych_server,
    hf_checkpoint,
    llama_cpp_server,
    transformers_server,
)

PEERS = ("diptych-aggregated", "diptych-disaggregated", "llama-cpp-python", "transformers-serve")
HEADING = "### Peers: Diptych vs llama-cpp-python vs transformers serve"


def _gguf() -> Path:
    from engine.weights.source import default_model_path

    return default_model_path()


def peer_server(name: str, gguf: Path) -> tuple[ServerProcess, str | None]:
    """The server of one peer, and the model name to request (None: the server's first)."""
    if name == "diptych-aggregated":
        return diptych_server("aggregated"), None
    if name == "diptych-disaggregated":
        return diptych_server("disaggregated"), None
    if name == "llama-cpp-python":
        return llama_cpp_server(gguf), MODEL_NAME
    if name == "transformers-serve":
        model_dir = hf_checkpoint(gguf)
        return transformers_server(model_dir), str(model_dir)
    raise ValueError(f"unknown peer {name!r}: choose from {', '.join(PEERS)}")


def length_flags(name: str, output_len: int) -> list[str]:
    """Flags that make a peer produce exactly `output_len` tokens, greedy.

    Diptych takes `ignore_eos`; llama-cpp-python has no such field (it ignores it) but
    takes `min_tokens`; `transformers serve` refuses unknown fields and takes a
    `generation_config` JSON string with `min_new_tokens`.
    """
    if name == "llama-cpp-python":
        body: dict[str, Any] = {"min_tokens": output_len}
    elif name == "transformers-serve":
        cfg = {"min_new_tokens": output_len, "max_new_tokens": output_len, "do_sample": False}
        body = {"generation_config": json.dumps(cfg)}
    else:
        return ["--ignore-eos"]
    return ["--no-ignore-eos", "--extra-body", json.dumps(body)]


def bench_argv(
    url: str, model: str | None, conc: int, args: argparse.Namespace, lengths: list[str]
) -> list[str]:
    argv = [
        "--base-url",
        url,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--num-prompts",
        str(max(args.min_prompts, args.prompts_per_slot * conc)),
        "--max-concurrency",
        str(conc),
        "--temperature",
        "0",
        *lengths,
        "--seed",
        str(args.seed + conc),
        "--num-warmups",
        str(args.warmups),
        "--request-timeout",
        str(args.request_timeout),
        "--label",
        "peers",
    ]
    if model:
        argv += ["--model", model]
    if not sys.stderr.isatty():
        argv.append("--disable-tqdm")
    return argv


def run_peer(name: str, args: argparse.Namespace, builder: PromptBuilder) -> list[dict[str, Any]]:
    server, model = peer_server(name, _gguf())
    rows = []
    with server:
        for conc in args.concurrency:
            argv = bench_argv(server.url, model, conc, args, length_flags(name, args.output_len))
            print(f"\n== {name}, concurrency {conc}: diptych bench {' '.join(argv)}", flush=True)
            [doc] = asyncio.run(
                run_benchmark(config_from_args(build_parser().parse_args(argv)), builder)
            )
            rows.append({"peer": name, "concurrency": conc} | _scalars(doc))
    return rows


def _scalars(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if not isinstance(v, (list, dict))}


def render(
    rows: list[dict[str, Any]],
    skipped: dict[str, str],
    args: argparse.Namespace,
    env: str,
    cmd: str,
) -> str:
    fmt: Callable[[Any], str] = lambda v: f"{v:.0f}" if v >= 100 else f"{v:.1f}"  # noqa: E731
    lines = [
        env,
        "",
        f"Workload: random prompts of exactly {args.input_len} tokens, {args.output_len} "
        "output tokens (greedy, EOS ignored), `--max-concurrency` at each level, "
        f"max({args.min_prompts}, {args.prompts_per_slot} x concurrency) requests per level. "
        "Times in ms (p50 / p99); throughput is output tokens per second of the whole run.",
        "",
        "```",
        cmd,
        "```",
        "",
        "| server | concurrency | done / failed | req/s | output tok/s | TTFT p50 / p99 | "
        "TPOT p50 / p99 | ITL p50 | E2EL p50 | peak conc. |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        exact = r["total_output_tokens"] == r["completed"] * args.output_len
        lines.append(
            f"| {r['peer']} | {r['concurrency']} | {r['completed']} / {r['failed']} | "
            f"{r['request_throughput']:.2f} | {r['output_throughput']:.1f}"
            f"{'' if exact else ' (!)'} | {fmt(r['median_ttft_ms'])} / {fmt(r['p99_ttft_ms'])} | "
            f"{fmt(r['median_tpot_ms'])} / {fmt(r['p99_tpot_ms'])} | {fmt(r['median_itl_ms'])} | "
            f"{fmt(r['median_e2el_ms'])} | {r['max_concurrent_requests']} |"
        )
    for name, why in skipped.items():
        lines.append(
            f"| {name} | - | not available here: {why.splitlines()[0][:120]} | | | | | | | |"
        )
    if any(r["total_output_tokens"] != r["completed"] * args.output_len for r in rows):
        lines += ["", "(!) the server returned a different number of output tokens than asked."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prompts-per-slot", type=int, default=3)
    ap.add_argument("--min-prompts", type=int, default=16)
    ap.add_argument("--warmups", type=int, default=2)
    ap.add_argument("--request-timeout", type=float, default=1800.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write every run's figures here")
    ap.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    builder = PromptBuilder(load_tokenizer(None))
    start = machine.snapshot()
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    for name in args.peers.split(","):
        try:
            rows += run_peer(name, args, builder)
        except ServerUnavailable as e:
            print(f"{name}: not available: {e}", file=sys.stderr)
            skipped[name] = str(e)
    end = machine.snapshot()
    cmd = "python benchmarks/peers.py " + " ".join(sys.argv[1:])
    text = render(rows, skipped, args, machine.describe(start, end), cmd.strip())
    print("\n" + text)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"machine": [start, end], "runs": rows, "skipped": skipped}, indent=1)
        )
    if args.write_docs:
        write_subsection(HEADING, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
