"""`diptych profile`: measure real step times into a simulated engine's profile.

    diptych profile --url http://127.0.0.1:8000 --output cpu.json   (a running server)
    diptych profile --output cpu.json          (an engine in this process; engine flags
                                                as for `diptych serve`)
    diptych serve --engine sim --profile cpu.json
    diptych simulate --profile cpu.json ...

It times what the simulated engine replaces:

    prefill   from a prompt's admission to its first token, over new tokens x tokens
              already in the prefix cache (a first request caches the prefix)
    decode    one step of `batch` sequences of `context` tokens each: in-process, the
              median step after their prefills; against a server, the median gap
              between streamed tokens while all `batch` streams run
    mixed     what a prefill chunk of `new` tokens adds to a decode step of `batch`
              sequences it joins (chunked prefill): in-process, that step less the
              median decode step; against a server, the longest gap the streams see
              while the prefill runs less their median gap before it. Under load the
              engine shares the CPU with the serving around it, so this is what a
              busy server's prefills cost, which a lone prompt's TTFT understates.

Against a running worker (`--url`) every point includes what serving adds (HTTP,
tokenization, detokenization, the frontend, the load generator sharing the
machine): the latencies a client sees at that load, which is what a simulated fleet
must reproduce. In-process it is the forward passes alone. Each point is the median
of `--repeats` fresh prompts. The JSON is what `engine.sim.timing.ProfileTiming`
reads; the PNG shows both grids.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypedDict

from diptych.profile_http import HttpProfiler
from engine import EngineConfig, SamplingParams
from engine.config import ModelConfig
from engine.engine_core import EngineCore
from engine.request import NewRequest
from engine.sim.timing import PROFILE_KIND, PROFILE_VERSION
from engine.weights import load_model_config, resolve_model
from protocol.kv_layout import KvLayout


class PrefillGrid(TypedDict):
    new_tokens: list[int]
    cached_tokens: list[int]
    seconds: list[list[float]]  # [new][cached]


class DecodeGrid(TypedDict):
    batch: list[int]
    context: list[int]
    seconds: list[list[float]]  # [batch][context]


class MixedGrid(TypedDict):
    new_tokens: list[int]
    batch: list[int]
    extra_seconds: list[list[float]]  # [new][batch]


class ProfileDoc(TypedDict):
    """The profile's JSON, as `engine.sim.timing.ProfileTiming` reads it."""

    kind: str
    version: int
    name: str
    measured_at: str
    machine: dict[str, str]
    engine: dict[str, object]
    model: dict[str, object]
    kv_bytes_per_token: float
    kv_capacity_tokens: int
    prefill: PrefillGrid
    decode: DecodeGrid
    mixed: MixedGrid


class Profiler:
    def __init__(self, core: EngineCore, seed: int = 0) -> None:
        self.core = core
        self.rng = random.Random(seed)
        self._n = 0
        vocab = core.model_config.vocab_size
        self._vocab = range(min(64, vocab - 1), vocab)

    def _prompt(self, n: int) -> list[int]:
        return self.rng.choices(self._vocab, k=n)

    def _submit(self, prompt: list[int], max_tokens: int) -> str:
        self._n += 1
        rid = f"profile-{self._n}"
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.core.submit(NewRequest(rid, prompt, params))
        return rid

    def _drain(self) -> None:
        while self.core.has_unfinished_requests():
            self.core.step()

    def prefill_s(self, new: int, cached: int) -> float:
        """Seconds from admission to the first token of `new` tokens after `cached`."""
        prefix = self._prompt(cached)
        if cached:
            self._submit(prefix, 1)
            self._drain()
        self._submit(prefix + self._prompt(new), 1)
        started = time.perf_counter()
        self._drain()
        return time.perf_counter() - started

    def _decoding(self, batch: int, context: int) -> None:
        """`batch` sequences of `context` prompt tokens, prefilled and decoding."""
        for _ in range(batch):
            self._submit(self._prompt(context), 1 << 20)
        core = self.core
        while any(r.num_output_tokens == 0 for r in core.scheduler.requests.values()):
            core.step()

    def _steps(self, n: int, batch: int = 0) -> list[float]:
        times = []
        for _ in range(n):
            if batch and len(self.core.scheduler.running) != batch:
                raise RuntimeError(f"decode batch {batch}: the pool preempted")
            started = time.perf_counter()
            self.core.step()
            times.append(time.perf_counter() - started)
        return times

    def decode_s(self, batch: int, context: int, steps: int = 6) -> float:
        """The median step of `batch` sequences decoding at `context` tokens each."""
        self._decoding(batch, context)
        times = self._steps(steps, batch)
        self.core.abort_all()
        return statistics.median(times)

    def mixed_s(self, new: int, batch: int, context: int = 128, steps: int = 4) -> float:
        """What a prefill of `new` tokens adds to the decode step of `batch` sequences."""
        self._decoding(batch, context)
        core = self.core
        times = self._steps(steps)
        self._submit(self._prompt(new), 1)
        started = time.perf_counter()
        core.step()
        mixed = time.perf_counter() - started
        core.abort_all()
        return max(mixed - statistics.median(times), 0.0)


def profile(config: EngineConfig, args: argparse.Namespace) -> ProfileDoc:
    """Measure both grids, in this process or (`args.url`) through a running server."""
    from kernels.cpu_isa import probe

    if args.url:
        model, kv_per_token, capacity, kernels = _served(config)
        http = HttpProfiler(args.url, model.vocab_size)

        def prefill_s(new: int, cached: int) -> float:
            return asyncio.run(http.prefill_s(new, cached))

        def decode_s(batch: int, context: int) -> float:
            return asyncio.run(http.decode_s(batch, context))

        def mixed_s(new: int, batch: int) -> float:
            return asyncio.run(http.mixed_s(new, batch))

        p: Profiler | None = None
    else:
        core = EngineCore(config)
        model = core.model_config
        layout = core.layout
        kv_per_token = layout.block_bytes / layout.block_size
        capacity = (layout.num_blocks - 1) * layout.block_size
        kernels = core.runner.kernel_summary()
        p = Profiler(core)
        prefill_s, decode_s, mixed_s = p.prefill_s, p.decode_s, p.mixed_s
    limit = config.max_model_len or model.max_position_embeddings
    if limit <= max(args.prefill_tokens) + max(args.cached_tokens):
        raise ValueError("the prefill grid reaches past the context window; lower it")
    if limit <= max(args.contexts) + 64:
        raise ValueError("the decode contexts reach past the context window; lower them")
    if max(args.mixed_tokens) + max(args.mixed_batches) > config.max_num_batched_tokens:
        raise ValueError(
            "a mixed point must fit one step: --mixed-tokens plus --mixed-batches at most "
            f"--max-num-batched-tokens ({config.max_num_batched_tokens})"
        )
    need = max(args.batch_sizes) * (max(args.contexts) + 64)
    if need > capacity:
        raise ValueError(
            f"the largest decode point needs {need} tokens of KV, the pool holds {capacity}: "
            "raise --kv-cache-memory or lower --batch-sizes / --contexts"
        )
    prefill_s(64, 0)  # warm up
    where = args.url or "in this process"
    print(f"profiling {model.name} ({where}): {kernels}", flush=True)
    prefill = _grid(
        args.prefill_tokens, args.cached_tokens, prefill_s, args.repeats, "prefill new x cached"
    )
    decode = _grid(
        args.batch_sizes, args.contexts, decode_s, args.repeats, "decode batch x context"
    )
    mixed = _grid(
        args.mixed_tokens, args.mixed_batches, mixed_s, args.repeats, "prefill new x batch"
    )
    isa = probe()
    return {
        "kind": PROFILE_KIND,
        "version": PROFILE_VERSION,
        "name": f"{model.name}@{isa.model}" + (" (served)" if args.url else ""),
        "measured_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpu": isa.model,
            "arch": isa.arch,
            "isa_level": isa.level,
            "device": str(config.torch_device()),
        },
        "engine": {
            "dtype": str(config.torch_dtype()).removeprefix("torch."),
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "kernels": kernels,
            "through": "http" if args.url else "in-process",
        },
        "model": model.to_dict(),
        "kv_bytes_per_token": kv_per_token,
        "kv_capacity_tokens": capacity,
        "prefill": {
            "new_tokens": args.prefill_tokens,
            "cached_tokens": args.cached_tokens,
            "seconds": prefill,
        },
        "decode": {"batch": args.batch_sizes, "context": args.contexts, "seconds": decode},
        "mixed": {
            "new_tokens": args.mixed_tokens,
            "batch": args.mixed_batches,
            "extra_seconds": mixed,
        },
    }


def _served(config: EngineConfig) -> tuple[ModelConfig, float, int, str]:
    """What the server's engine is, from the same flags: (model, KV bytes per token,
    KV capacity in tokens, a description); only the checkpoint's metadata is read."""
    model = load_model_config(resolve_model(config.model))
    dtype = str(config.torch_dtype()).removeprefix("torch.")
    layout = KvLayout(
        1,
        model.num_hidden_layers,
        config.block_size,
        model.num_key_value_heads,
        model.head_dim,
        dtype,
        model.name,
    )
    blocks = config.num_blocks or config.kv_cache_memory_bytes // layout.block_bytes
    per_token = layout.block_bytes / config.block_size
    return model, per_token, (blocks - 1) * config.block_size, "a running server"


def _grid(
    xs: Sequence[int],
    ys: Sequence[int],
    measure: Callable[[int, int], float],
    repeats: int,
    what: str,
) -> list[list[float]]:
    rows = []
    for x in xs:
        row = []
        for y in ys:
            row.append(statistics.median(measure(x, y) for _ in range(repeats)))
            print(f"  {what} {x:>5} x {y:>5}: {1e3 * row[-1]:8.2f} ms", flush=True)
        rows.append(row)
    return rows


def plot_profile(doc: ProfileDoc, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5))
    pre, dec = doc["prefill"], doc["decode"]
    for j, cached in enumerate(pre["cached_tokens"]):
        a.plot(
            pre["new_tokens"],
            [1e3 * row[j] for row in pre["seconds"]],
            "o-",
            label=f"{cached} cached",
        )
    a.set(xlabel="new prompt tokens", ylabel="time to first token (ms)", title="prefill")
    for j, ctx in enumerate(dec["context"]):
        b.plot(dec["batch"], [1e3 * row[j] for row in dec["seconds"]], "o-", label=f"context {ctx}")
    b.set(xlabel="batch (sequences)", ylabel="step (ms)", title="decode")
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{doc['name']} ({doc['engine']['dtype']})")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def run(config: EngineConfig, args: argparse.Namespace) -> int:
    if config.sim is not None:
        raise ValueError("diptych profile measures a real engine; drop --engine sim")
    doc = profile(config, args)
    out = Path(args.output)
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}", flush=True)
    try:
        print(f"wrote {plot_profile(doc, out.with_suffix('.png'))}", flush=True)
    except ImportError:
        print("no plot: matplotlib is not installed", flush=True)
    return 0
