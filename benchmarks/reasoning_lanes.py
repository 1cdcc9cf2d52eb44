"""Low-effort TTFT beside high-effort thinking streams, with and without effort lanes.

    python -m benchmarks.reasoning_lanes [--low 60] [--interval 0.4] [--docs]

A real `diptych serve` (one decode worker, aggregated, SmolLM2-135M in bf16) made a
reasoning model by a chat template whose generation prompt opens a ``<think>`` block
(`--chat-template`, `--reasoning-parser deepseek_r1`). Low-effort requests (a
thinking budget of 16, 24 tokens in all, each prompt distinct) arrive every
`--interval` seconds; their TTFT is the client's time to the first streamed event.
Each server is measured twice in a row: with no other traffic, then with four
high-effort streams (a thinking budget of 2,000) kept in flight by closed-loop
clients. The servers differ only in `--long-thinking-tokens`: 1,024 (lanes, the
default) or 0 (one lane), with the default batch and with `--max-num-seqs 4` (the
four high-effort streams fill a batch: the case lanes are for). The high-effort
streams' inter-token latency is reported too: what the lanes cost them.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

from benchmarks.docs_section import write_subsection
from benchmarks.machine import commit, cpu_isa, cpu_name
from benchmarks.servers import ServerProcess, diptych_server

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}<|im_start|>assistant\n<think>\n"
)
HIGH_BUDGET, LOW_BUDGET, HIGH_STREAMS = 2000, 16, 4
# (row, --long-thinking-tokens, --max-num-seqs or None for the default)
SETTINGS = [
    ("lanes (--long-thinking-tokens 1024, the default)", "1024", None),
    ("one lane (--long-thinking-tokens 0)", "0", None),
    ("lanes, --max-num-seqs 4", "1024", "4"),
    ("one lane, --max-num-seqs 4", "0", "4"),
]
SMALL_BATCH_LOW = 16  # low-effort requests where a full batch makes them wait


MODEL: dict[str, str] = {}  # server URL -> the model it serves


async def stream(http: httpx.AsyncClient, url: str, prompt: str, budget: int, tokens: int,
                 gaps: list[float] | None = None) -> float:  # fmt: skip
    """One streamed chat's TTFT in seconds; its inter-event gaps (after the second event)
    go to `gaps` as they come."""
    body = {"model": MODEL[url], "messages": [{"role": "user", "content": prompt}], "stream": True,
            "max_tokens": tokens, "temperature": 0, "max_reasoning_tokens": budget}  # fmt: skip
    t0 = time.perf_counter()
    times: list[float] = []
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            event = line.startswith("data: ") and line != "data: [DONE]"
            if event and orjson.loads(line[6:]).get("choices"):
                times.append(time.perf_counter())
                if gaps is not None and len(times) > 2:
                    gaps.append(times[-1] - times[-2])
    return times[0] - t0


async def phase(url: str, args: argparse.Namespace, loaded: bool, tag: str) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=600) as http:
        stop = asyncio.Event()
        high_gaps: list[float] = []

        async def high(i: int) -> None:
            n = 0
            while not stop.is_set():
                prompt = f"[{tag} {i}.{n}] Think step by step about the history of tea."
                await stream(http, url, prompt, HIGH_BUDGET, HIGH_BUDGET + 48, high_gaps)
                n += 1

        highs = [asyncio.create_task(high(i)) for i in range(HIGH_STREAMS)] if loaded else []
        if loaded:
            await asyncio.sleep(3.0)  # all four thinking
        lows: list[asyncio.Task[float]] = []
        for j in range(args.low):
            prompt = f"[{tag} low {j}] What is {j} + {j}?"
            lows.append(asyncio.create_task(stream(http, url, prompt, LOW_BUDGET, 24)))
            await asyncio.sleep(args.interval)
        ttfts = sorted(await asyncio.gather(*lows))
        stop.set()
        for task in highs:
            task.cancel()
        await asyncio.gather(*highs, return_exceptions=True)
    return {
        "p50": statistics.median(ttfts),
        "p99": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
        "high_itl": statistics.median(high_gaps) if high_gaps else None,
    }


def measure(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        template = Path(tmp) / "think.jinja"
        template.write_text(TEMPLATE)
        for name, lanes, seqs in SETTINGS:
            server: ServerProcess = diptych_server(
                "aggregated", "--decode-workers", "1", "--dtype", "bfloat16",
                "--chat-template", str(template), "--reasoning-parser", "deepseek_r1",
                "--long-thinking-tokens", lanes, *(["--max-num-seqs", seqs] if seqs else []),
            )  # fmt: skip
            run = args
            if seqs:
                run = argparse.Namespace(low=min(args.low, SMALL_BATCH_LOW), interval=args.interval)
            with server:
                server.manifest()  # every child ready
                MODEL[server.url] = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
                asyncio.run(phase(server.url, argparse.Namespace(low=4, interval=0.3),
                                  False, f"warm {name}"))  # fmt: skip
                alone = asyncio.run(phase(server.url, run, False, f"alone {name}"))
                loaded = asyncio.run(phase(server.url, run, True, f"loaded {name}"))
            out[name] = {"alone": alone, "loaded": loaded, "low": run.low}
            print(name, out[name], flush=True)
    return out


def report(args: argparse.Namespace, r: dict[str, dict[str, Any]]) -> str:
    lines = [
        f"Command: `python -m benchmarks.reasoning_lanes{' --docs' if args.docs else ''}"
        f" --low {args.low} --interval {args.interval}`. {cpu_name()} ({cpu_isa()}), "
        f"SmolLM2-135M in bfloat16 as a reasoning model (a template opening `<think>`), one "
        f"decode worker, commit {commit()}, {time.strftime('%Y-%m-%d')}. Low-effort: "
        f"{args.low} chats, one every {args.interval} s, a thinking budget of {LOW_BUDGET} "
        f"and 24 tokens in all; high-effort: {HIGH_STREAMS} streams with a budget of "
        f"{HIGH_BUDGET}, kept in flight. TTFT: the client's time to the first event.",
        "",
        "| server | low-effort requests | TTFT p50, alone | p99, alone | p50, 4 high-effort "
        "in flight | p99, 4 in flight | p99 in flight / alone | high-effort ITL p50 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, v in r.items():
        a, b = v["alone"], v["loaded"]
        itl = "-" if b["high_itl"] is None else f"{b['high_itl'] * 1e3:.0f} ms"
        lines.append(
            f"| {name} | {v['low']} | {a['p50'] * 1e3:.0f} ms | {a['p99'] * 1e3:.0f} ms | "
            f"{b['p50'] * 1e3:.0f} ms | {b['p99'] * 1e3:.0f} ms | {b['p99'] / a['p99']:.2f}x | "
            f"{itl} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--low", type=int, default=60, help="low-effort requests per phase")
    p.add_argument("--interval", type=float, default=0.4, help="seconds between them")
    p.add_argument("--docs", action="store_true", help="write the docs/benchmarks.md section")
    args = p.parse_args()
    text = report(args, measure(args))
    print(text)
    if args.docs:
        write_subsection("### Reasoning models: low-effort TTFT beside high-effort streams", text)


if __name__ == "__main__":
    main()
