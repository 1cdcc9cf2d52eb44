"""TTFT and TPOT of a long prompt through `diptych serve`, aggregated vs disaggregated.

    python benchmarks/serving_ttft.py [--prompt-len 1024] [--gen-len 64] [--runs 5]
                                      [--write-docs]

Each mode is a real `diptych serve` process tree on this machine (default bf16 model
settings). Requests are streamed completions over token-id prompts, one at a time,
each prompt distinct so no prefix cache helps; TTFT is measured by the client to
the first streamed token, TPOT as (end - TTFT) / (tokens - 1). In disaggregated mode
the prefill and decode workers' Prometheus metrics give the remote prefill's
parts: the prefill worker's compute and KV write, and the decode worker's
publish-to-adopt time, so the transfer's share of TTFT is reported too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.serving import Server  # noqa: E402


def stream_one(url: str, model: str, prompt: list[int], gen: int) -> tuple[float, float, int]:
    body = {"model": model, "prompt": prompt, "max_tokens": gen, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    t0 = time.perf_counter()
    first = None
    n = 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                n += 1
                if first is None:
                    first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None
    return first - t0, (end - first) / max(n - 1, 1), n


def _hist(m: dict[str, float], name: str) -> tuple[float, float]:
    return m.get(f"{name}_sum", 0.0), m.get(f"{name}_count", 0.0)


def measure(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    flags = ["--prefill-workers", "0"] if mode == "aggregated" else ["--transfer", args.transfer]
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(Path(tmp), *flags)
        try:
            model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]

            def prompt() -> list[int]:
                return [rng.randrange(100, 49000) for _ in range(args.prompt_len)]

            for _ in range(2):
                stream_one(server.url, model, prompt(), 8)
            before = _worker_metrics(server, mode)
            ttft, tpot = [], []
            for _ in range(args.runs):
                a, b, n = stream_one(server.url, model, prompt(), args.gen_len)
                assert n == args.gen_len, n
                ttft.append(a)
                tpot.append(b)
            after = _worker_metrics(server, mode)
        finally:
            server.stop()
    result: dict[str, Any] = {
        "mode": mode,
        "ttft_ms": [1e3 * x for x in ttft],
        "tpot_ms": [1e3 * x for x in tpot],
    }
    if mode != "aggregated":
        for key, (worker, name) in {
            "transfer": ("prefill-0", "diptych_transfer_write_seconds"),
            "prefill": ("prefill-0", "diptych_worker_prefill_seconds"),
            "remote": ("decode-0", "diptych_worker_remote_prefill_seconds"),
        }.items():
            s1, c1 = _hist(after[worker], name)
            s0, c0 = _hist(before[worker], name)
            result[f"{key}_ms"] = 1e3 * (s1 - s0) / max(c1 - c0, 1)
        result["remote_requests"] = after["decode-0"].get(
            'diptych_worker_requests_total{prefill="remote"}', 0
        ) - before["decode-0"].get('diptych_worker_requests_total{prefill="remote"}', 0)
    return result


def _worker_metrics(server: Server, mode: str) -> dict[str, dict[str, float]]:
    names = ["decode-0"] if mode == "aggregated" else ["decode-0", "prefill-0"]
    return {n: server.metrics(n) for n in names}


def render(results: list[dict[str, Any]], args: argparse.Namespace, cmd: str) -> str:
    med = statistics.median
    lines = [
        f"Measured {datetime.date.today()} on {platform.processor() or platform.machine()}, "
        f"{_cpus()} CPUs, through `diptych serve` (default bfloat16 settings, "
        f"{args.transfer} transfer), one request at a time, {args.runs} runs per mode "
        f"(median, with min-max), a {args.prompt_len}-token prompt, {args.gen_len} tokens "
        "generated.",
        "",
        "```",
        cmd,
        "```",
        "",
        "| mode | TTFT ms | TPOT ms | remote prefill (publish to KV adopted) ms | "
        "prefill compute ms | KV write ms | KV write share of TTFT |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        t, p = r["ttft_ms"], r["tpot_ms"]
        row = (
            f"| {r['mode']} | {med(t):.0f} ({min(t):.0f}-{max(t):.0f}) | "
            f"{med(p):.1f} ({min(p):.1f}-{max(p):.1f}) |"
        )
        if r["mode"] == "aggregated":
            row += " - | - | - | - |"
        else:
            share = r["transfer_ms"] / med(t)
            row += (
                f" {r['remote_ms']:.0f} | {r['prefill_ms']:.0f} | {r['transfer_ms']:.1f} |"
                f" {share:.1%} |"
            )
        lines.append(row)
    lines += [
        "",
        "TTFT and TPOT are measured by the client (HTTP streaming through the frontend); "
        "the remote-prefill columns are means from the workers' Prometheus histograms over "
        "the same requests. Disaggregated TTFT adds the queue hop, the prefill worker's "
        "own engine step and the KV write to what aggregated mode does in one process; on "
        "two CPU cores both modes share the same cores, so disaggregation cannot win here: "
        "this measures its overhead, not its benefit (which needs separate machines).",
    ]
    return "\n".join(lines) + "\n"


def _cpus() -> int:
    import os

    return os.cpu_count() or 0


HEADING = "### Long-prompt TTFT and TPOT: aggregated vs disaggregated"


def write_docs(text: str) -> None:
    """Replace this script's subsection of `## Serving`, leaving the others alone."""
    from benchmarks.docs_section import write_subsection

    write_subsection(HEADING, text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--transfer", default="shm")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write-docs", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    results = [measure(m, args) for m in ("aggregated", "disaggregated")]
    cmd = "python benchmarks/serving_ttft.py " + " ".join(sys.argv[1:])
    text = render(results, args, cmd.strip())
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.write_docs:
        write_docs(text)
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    print("commit", rev.stdout.strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
