#!/usr/bin/env python
"""Served chat streaming, Diptych against llama.cpp's own server, driven by two clients.

    python benchmarks/served_llama.py --llama-server PATH --aiperf PATH
        [--concurrency 1,8,32] [--input-len 128] [--output-len 128] [--json F] [--write-docs]

One machine, one run, one server at a time:

- diptych: `diptych serve --prefill-workers 0 --quantization gguf` (one decode worker
  on the default GGUF's Q4_1 blocks; engine threads sized by `diptych serve`);
- llama-server: llama.cpp's native server (`benchmarks.servers.native_llama_server`) on
  the same GGUF, 32 slots of 512 tokens (every request fits), once per `--llama-threads`
  entry: by default with the threads Diptych's engine gets (the CPUs but one, which
  `diptych serve` leaves to the frontend and the client) and with all CPUs
  (llama.cpp's own default). On 2 vCPUs with aiperf beside it, all-CPU llama-server
  spins at its thread barriers against the client's processes and its inter-token
  latency climbs from 11 ms to 0.9 s within four requests.

At each concurrency every server is driven twice, one client after the other:
`diptych bench` (our client: random prompts of exactly --input-len tokens on the chat
endpoint, streamed, greedy, EOS ignored) and NVIDIA's `aiperf` (a client we did not
write: synthetic prompts of --input-len tokens before the chat template, streamed,
`ignore_eos` in the body). Requests per level: max(16, 3 x concurrency), two warm-ups.
Reported per client: output tok/s over the run, TPOT or inter-token latency p50, TTFT
p50 and failed requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import build_parser, config_from_args, run_benchmark  # noqa: E402
from bench.workloads import PromptBuilder, load_tokenizer  # noqa: E402
from benchmarks import machine  # noqa: E402
from benchmarks.docs_section import write_subsection  # noqa: E402
from benchmarks.servers import ServerProcess, diptych_server, native_llama_server  # noqa: E402
from engine.tokenizer import cache_key, tokenizer_cache_root  # noqa: E402
from engine.weights import default_model_path  # noqa: E402

HEADING = "### Served chat streaming: Diptych vs llama-server, two clients"
REQUEST_TIMEOUT_S = 120  # a 128-token reply slower than this counts as failed
LEVEL_LIMIT_S = 300  # aiperf stops a level here; requests not sent count as failed


def servers(args: argparse.Namespace) -> dict[str, ServerProcess]:
    gguf = default_model_path()
    return {
        "diptych (Q4_1, --quantization gguf)": diptych_server(
            "aggregated", "--quantization", "gguf"
        ),
        **{
            f"llama-server (Q4_1, 32 slots, {t} thread{'s' if t > 1 else ''})": native_llama_server(
                args.llama_server, gguf, threads=t, slots=32, n_ctx=512
            )
            for t in args.llama_threads
        },
    }


def requests_for(conc: int) -> int:
    return max(16, 3 * conc)


def run_bench(url: str, model: str, conc: int, args: argparse.Namespace) -> dict[str, Any]:
    argv = [
        "--base-url", url, "--model", model, "--backend", "openai-chat",
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--num-prompts", str(requests_for(conc)),
        "--max-concurrency", str(conc), "--temperature", "0", "--ignore-eos",
        "--seed", str(conc), "--num-warmups", "2", "--label", "served-llama", "--disable-tqdm",
    ]  # fmt: skip
    builder = PromptBuilder(load_tokenizer(None))
    [doc] = asyncio.run(run_benchmark(config_from_args(build_parser().parse_args(argv)), builder))
    return {
        "tok_s": doc["output_throughput"], "itl_ms": doc["median_tpot_ms"],
        "ttft_ms": doc["median_ttft_ms"], "failed": doc["failed"], "completed": doc["completed"],
        "output_tokens": doc["total_output_tokens"],
    }  # fmt: skip


def run_aiperf(url: str, model: str, conc: int, args: argparse.Namespace) -> dict[str, Any]:
    tokenizer = tokenizer_cache_root() / cache_key(default_model_path())
    with tempfile.TemporaryDirectory(prefix="aiperf-") as out:
        cmd = [
            str(args.aiperf), "profile", "--model", model, "--url", url,
            "--endpoint-type", "chat", "--streaming", "--concurrency", str(conc),
            "--request-count", str(requests_for(conc)), "--warmup-request-count", "2",
            "--prompt-input-tokens-mean", str(args.input_len), "--prompt-input-tokens-stddev", "0",
            "--prompt-output-tokens-mean", str(args.output_len),
            "--prompt-output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true",
            "--tokenizer", str(tokenizer), "--random-seed", str(conc),
            "--output-artifact-dir", out, "--no-server-metrics", "--no-gpu-telemetry",
            "--no-auto-plot", "--request-timeout-seconds", str(REQUEST_TIMEOUT_S),
            "--benchmark-duration", str(LEVEL_LIMIT_S),
            # llama-server reads max_tokens, not max_completion_tokens (aiperf's default)
            "--use-legacy-max-tokens",
        ]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=out, timeout=3600)
        if done.returncode != 0:
            raise RuntimeError(f"aiperf failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
        d = json.loads((Path(out) / "profile_export_aiperf.json").read_text())

    def stat(name: str, key: str = "avg") -> float:
        return float(d.get(name, {}).get(key, 0.0) or 0.0)

    completed = stat("completed_request_count")
    return {
        "tok_s": stat("output_token_throughput"), "itl_ms": stat("inter_token_latency", "p50"),
        "ttft_ms": stat("time_to_first_token", "p50"), "completed": int(completed),
        "failed": requests_for(conc) - int(stat("request_count")),
        "error_rate_pct": stat("request_error_rate"), "output_tokens": stat("total_output_tokens"),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--llama-server", type=Path, required=True)
    ap.add_argument("--aiperf", type=Path, required=True, help="the aiperf executable")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument(
        "--llama-threads", default=None,
        help="comma list of llama-server --threads values (default: CPUs-1 and CPUs)",
    )  # fmt: skip
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    cpus = os.cpu_count() or 1
    default_threads = sorted({max(1, cpus - 1), cpus})
    args.llama_threads = (
        [int(t) for t in args.llama_threads.split(",")] if args.llama_threads else default_threads
    )
    start = machine.snapshot()
    rows: list[dict[str, Any]] = []
    for name, server in servers(args).items():
        with server:
            model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
            for conc in levels:
                for client, run in (("diptych bench", run_bench), ("aiperf", run_aiperf)):
                    row = {"server": name, "client": client, "concurrency": conc,
                           **run(server.url, model, conc, args)}  # fmt: skip
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    report = {"machine": machine.describe(start, machine.snapshot()), "rows": rows,
              "input_len": args.input_len, "output_len": args.output_len}  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    if args.write_docs:
        write_subsection(HEADING, docs_body(report), section="## Quantization")


def docs_body(report: dict[str, Any]) -> str:
    lines = [
        report["machine"],
        "",
        "| client | concurrency | server | output tok/s | ITL / TPOT p50 ms | TTFT p50 ms | "
        "failed |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in sorted(report["rows"], key=lambda r: (r["client"], r["concurrency"])):
        lines.append(
            f"| {r['client']} | {r['concurrency']} | {r['server']} | {r['tok_s']:.1f} | "
            f"{r['itl_ms']:.1f} | {r['ttft_ms']:.0f} | {r['failed']} |"
        )
    lines += [
        "",
        "Reproduce: `python benchmarks/served_llama.py --llama-server LLAMA_SERVER --aiperf AIPERF "
        "--write-docs` (aiperf from PyPI in its own virtual environment). Chat endpoint, "
        f"streamed, {report['input_len']} prompt tokens (aiperf: before the chat template), "
        f"{report['output_len']} output tokens with EOS ignored, max(16, 3 x concurrency) "
        "requests per level after two warm-ups; one server at a time, both clients in turn.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
