"""What `--deterministic` costs: decode throughput at batch 1 / 8 / 64 and the time to
first token of a 1,024-token prompt, with and without it, on SmolLM2-135M in bf16.

    python -m benchmarks.deterministic                  # the table
    python -m benchmarks.deterministic --docs           # and the docs/benchmarks.md section
    env $(python -m kernels --env generic) python -m benchmarks.deterministic --docs

Each of `--repeats` processes builds both engines (in alternating orders) and runs every
row once, the two taking turns; each figure is the median over the processes (a
process's own speed varies with where its memory lands, so one process is one
sample). `EngineCore` is driven step by step (model load excluded): decode throughput
counts the tokens of steps in which every row decodes, over those steps' time (the
prompts' prefill is outside it); TTFT is the wall time from submitting a prompt of
distinct random tokens (no prefix hits) to its first token, one step under the default
2,048-token budget. The ISA level is the process's (forced with `python -m kernels --env
LEVEL`), named in the section's heading.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import statistics
import time
from concurrent.futures import ProcessPoolExecutor

from benchmarks.docs_section import write_subsection
from benchmarks.machine import commit, cpu_isa, cpu_name
from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.model_runner import ModelRunner
from engine.request import NewRequest
from kernels import cpu_isa as isa
from protocol.sampling import SamplingParams

BATCHES = (1, 8, 64)
MODES = {"default": False, "deterministic": True}


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def decode_rate(core: EngineCore, batch: int, prompt_len: int, new: int, seed: int) -> float:
    """Tokens per second of the decode-only steps of `batch` requests run together."""
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        core.submit(NewRequest(f"d{seed}-{i}", _prompt(rng, prompt_len), params))
    tokens, seconds = 0, 0.0
    while core.has_unfinished_requests():
        t = time.perf_counter()
        outs = core.step()
        dt = time.perf_counter() - t
        if outs and core.last_step_tokens == len(outs):
            tokens += len(outs)
            seconds += dt
    return tokens / seconds


def ttft(core: EngineCore, prompt_len: int, seed: int) -> float:
    """Seconds from submitting one fresh prompt to its first token."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    core.submit(NewRequest(f"t{seed}", _prompt(random.Random(seed), prompt_len), params))
    first = None
    while core.has_unfinished_requests():
        for o in core.step():
            if o.new_token_ids and first is None:
                first = time.perf_counter() - t
    assert first is not None
    return first


def _measure_turn(args: argparse.Namespace, first: str, rep: int) -> tuple[dict[str, float], int]:
    """One turn of every row, the engine `first` built first; and the engine's threads."""
    order = sorted(MODES, key=lambda name: name != first)
    cores = {
        name: EngineCore(EngineConfig(dtype="bfloat16", deterministic=MODES[name], max_num_seqs=64))
        for name in order
    }
    row: dict[str, float] = {}
    for core in cores.values():  # warm-up: kernels, allocator
        decode_rate(core, 8, args.prompt_len, 8, 999)
        ttft(core, args.ttft_len, 998)
    for b in BATCHES:
        for name, core in cores.items():
            rate = decode_rate(core, b, args.prompt_len, args.new, rep * 100 + b)
            row[f"{name}/decode{b}"] = rate
    for name, core in cores.items():
        row[f"{name}/ttft"] = ttft(core, args.ttft_len, rep)
    runner = cores[first].runner
    assert isinstance(runner, ModelRunner)
    return row, runner.threads


def measure(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Medians over `args.repeats` processes, one turn each, that build the engines in
    alternating orders. A process's own speed varied by up to a quarter at batch 1 on
    the dev VM (the same engine, from one process to the next: memory placement), and
    of two engines in one process the one built first was often the slower, so turns
    in one process would measure that process alone, and one order would favour a mode."""
    rows: dict[str, list[float]] = {}
    threads = 0
    ctx = multiprocessing.get_context("spawn")  # a fresh process: no engine built before
    with ProcessPoolExecutor(1, mp_context=ctx, max_tasks_per_child=1) as pool:
        for rep in range(args.repeats):
            first = list(MODES)[rep % 2]
            row, threads = pool.submit(_measure_turn, args, first, rep).result()
            for key, value in row.items():
                rows.setdefault(key, []).append(value)
    out: dict[str, dict[str, float]] = {}
    for key, values in rows.items():
        name, row_name = key.split("/")
        out.setdefault(name, {})[row_name] = statistics.median(values)
    out["_engine"] = {"threads": float(threads)}
    return out


def report(args: argparse.Namespace, r: dict[str, dict[str, float]]) -> str:
    probe = isa.probe()
    level = probe.level + (f" (forced; the CPU's own is {probe.native})" if probe.forced else "")
    lines = [
        f"Command: `python -m benchmarks.deterministic{' --docs' if args.docs else ''}"
        f"{f' --repeats {args.repeats}' if args.repeats != 3 else ''}`"
        f"{'' if not probe.forced else f' under `python -m kernels --env {probe.level}`'}. "
        f"{cpu_name()} ({cpu_isa()}), ISA level {level}, {r['_engine']['threads']:.0f} threads, "
        f"SmolLM2-135M in bfloat16, commit {commit()}, {time.strftime('%Y-%m-%d')}. Decode: "
        f"{args.prompt_len} random prompt tokens and {args.new} greedy tokens per request, "
        f"tokens of decode-only steps over their time; TTFT: one {args.ttft_len}-token prompt "
        f"alone. Median of {args.repeats} processes, each building both engines (in "
        "alternating orders) and running every row once with the two taking turns.",
        "",
        "| | default | `--deterministic` | `--deterministic` against default |",
        "|---|---:|---:|---:|",
    ]
    d, x = r["default"], r["deterministic"]
    for b in BATCHES:
        k = f"decode{b}"
        lines.append(f"| decode tok/s, batch {b} | {d[k]:.0f} | {x[k]:.0f} | "
                     f"{x[k] / d[k] - 1:+.0%} throughput |")  # fmt: skip
    lines.append(f"| TTFT, {args.ttft_len}-token prompt | {d['ttft'] * 1e3:.0f} ms | "
                 f"{x['ttft'] * 1e3:.0f} ms | {x['ttft'] / d['ttft'] - 1:+.0%} time |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new", type=int, default=64, help="tokens each decode request generates")
    p.add_argument("--ttft-len", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--docs", action="store_true", help="write the docs/benchmarks.md section")
    args = p.parse_args(argv)
    table = report(args, measure(args))
    print(table)
    if args.docs:
        probe = isa.probe()
        heading = f"### Deterministic serving: its cost at ISA level {probe.level}"
        write_subsection(heading, table, section="## Engine")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
