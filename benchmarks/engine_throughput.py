#!/usr/bin/env python
"""Engine throughput: Diptych beside HF transformers and beside the machine's own limits.

    python benchmarks/engine_throughput.py                     # full run, bf16
    python benchmarks/engine_throughput.py --dtype float32 --json out.json
    python benchmarks/engine_throughput.py --write-docs        # refresh docs/benchmarks.md
    python benchmarks/engine_throughput.py --quick --skip-hf   # smoke run, well under a minute

One process measures, on one machine with one model and one dtype:

- the machine's limits: copy bandwidth (memcpy throughput: bytes copied per
  second into memory allocated beforehand; STREAM would count read + written
  bytes, twice this) and square-GEMM FLOP/s in the run dtype, each the best of
  several, once before and once after the engines run;
- Diptych's `EngineCore` driven step by step (model load excluded), so each run
  splits into a prefill phase (until every sequence has its first token) and a
  decode phase (the rest), with greedy decoding, EOS ignored, and distinct
  seeded random prompts salted per run so the prefix cache never hits;
- HF transformers `generate` on the same prompts (left-padded batch, greedy,
  `min_new_tokens = max_new_tokens`), its first-token time taken by a no-op
  logits processor;
- time to first token for one long prompt;
- efficiency: batch-1 decode as weight bytes x tok/s / copy bandwidth, the
  largest batch's decode as model FLOPs x tok/s / GEMM FLOP/s, and the batch-1
  speedup over transformers, each against its target.

Every batch size is warmed up first (a whole run at batch 1, a few tokens above it)
on prompts of its own. Batch sizes up to `--repeat-max-batch` then run `--repeats`
times and report the median run; larger batches run once. HF and Diptych alternate
per batch size, so a noisy neighbour hurts both alike.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import io
import json
import os
import platform
import random
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
# first, also when the root is on PYTHONPATH: benchmarks/kernels.py would shadow `kernels`
if sys.path[:1] != [str(REPO_ROOT)]:
    sys.path.insert(0, str(REPO_ROOT))
# Before any torch op: probes the CPU and applies DIPTYCH_CPU_ISA to the libraries.
import kernels  # noqa: E402, F401

if TYPE_CHECKING:
    from engine import EngineCore

TARGET_BANDWIDTH_EFF = 0.60
TARGET_FLOP_EFF = 0.50
TARGET_SPEEDUP = 2.0
# Prompt tokens are drawn above the special tokens, so prompts look like (odd) text.
FIRST_ORDINARY_TOKEN = 100
# Warm-up: a whole run at batch 1, this many tokens at larger batches (enough to settle
# allocations and kernel choices for the prefill and decode shapes).
WARMUP_TOKENS = 16
# Above this share of time spent waiting for a CPU (Linux PSI), the docs call the machine busy.
BUSY_THRESHOLD = 0.10


# -- results ----------------------------------------------------------------------


@dataclass
class MachineLimits:
    copy_gbps: float  # bytes copied / s (memcpy throughput), best of all tries
    gemm_gflops: float  # 2 n^3 / s in the run dtype, best of all tries
    copy_buffer_mib: int
    gemm_n: int
    tries: list[dict[str, float]] = field(default_factory=list)
    read_gbps: float = 0.0  # bytes read / s summing a buffer: the ceiling of a read stream
    fp32_gemm_gflops: float = 0.0  # the same in fp32 (the arithmetic of bf16 weights
    # widened in registers, on CPUs without bf16 instructions)


@dataclass
class RunResult:
    """One generation run of `batch` sequences (Diptych or HF)."""

    batch: int
    total_s: float
    prefill_s: float  # start until every sequence has its first token
    decode_s: float  # from then until the last token
    output_tokens: int
    decode_tokens: int  # tokens that came out during the decode phase
    steps: int = 0
    decode_step_ms_median: float = 0.0
    cached_prompt_tokens: int = 0

    @property
    def total_tok_s(self) -> float:
        return self.output_tokens / self.total_s

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")


@dataclass
class BatchResult:
    batch: int
    diptych: list[RunResult]
    hf: list[RunResult] = field(default_factory=list)
    # Sequences whose whole greedy output matched HF's, and the mean matching prefix.
    hf_identical_sequences: int | None = None
    hf_mean_common_prefix: float | None = None


def median_run(runs: Sequence[RunResult]) -> RunResult:
    """The run with the median total time (the lower middle for an even count)."""
    ordered = sorted(runs, key=lambda r: r.total_s)
    return ordered[(len(ordered) - 1) // 2]


# -- machine ----------------------------------------------------------------------


def cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
        if not line.strip() and fields:
            break
    name = fields.get("model name", platform.machine())
    flags = set(fields.get("flags", "").split())
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    family, model = fields.get("cpu family"), fields.get("model")
    extra = f" (family {family}, model {model}; {' '.join(isa)})" if family else ""
    return name + extra


def machine_info() -> dict[str, Any]:
    import transformers

    return {
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_start": _loadavg(),
        "cpu_pressure_start": _cpu_pressure(),
        "cpu_busy_samples": [busy_share(_cpu_pressure())],
        "git": git_state(),
    }


def git_state() -> dict[str, Any]:
    """The commit measured, and engine/kernels files that differ from it (read-only git)."""

    def git(*cmd: str) -> str:
        return subprocess.run(
            ["git", *cmd], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30, check=True
        ).stdout

    try:
        head = git("rev-parse", "--short", "HEAD").strip()
        changed = git("status", "--porcelain", "--", "engine", "kernels").splitlines()
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"commit": head, "uncommitted_engine_files": [line[3:] for line in changed]}


def busy_share(psi: str | None) -> float | None:
    """The avg10 figure of a PSI line, as a fraction."""
    match = re.search(r"avg10=([0-9.]+)", psi or "")
    return float(match.group(1)) / 100 if match else None


def _cpu_pressure() -> str | None:
    """Linux PSI line for CPU ("some avg10=..."): the share of time tasks waited for a core."""
    try:
        return Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def best_seconds(fn: Callable[[], object], tries: int) -> float:
    """The fastest of `tries` timed calls of `fn`, after one untimed call (warm-up:
    pages faulted in, kernels chosen)."""
    fn()
    best = float("inf")
    for _ in range(tries):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def copy_bandwidth(nbytes: int, tries: int) -> float:
    """Best GB/s (bytes copied per second) of copying `nbytes` into memory allocated
    beforehand: what a memcpy benchmark reports."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return nbytes / best_seconds(lambda: dst.copy_(src), tries) / 1e9


def read_bandwidth(nbytes: int, tries: int) -> float:
    """Best GB/s of reading `nbytes` once (a sum), the ceiling for streaming weights."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    return nbytes / best_seconds(src.sum, tries) / 1e9


def gemm_flops(n: int, dtype: torch.dtype, tries: int) -> float:
    """Best GFLOP/s of an n x n x n matmul into an output allocated beforehand."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(dtype)
    b = torch.randn(n, n, generator=gen).to(dtype)
    c = torch.empty(n, n, dtype=dtype)
    return 2 * n**3 / best_seconds(lambda: torch.mm(a, b, out=c), tries) / 1e9


def onednn_fp32_gemm_flops(n: int, tries: int) -> float:
    """Best GFLOP/s of the same product through oneDNN's fp32 linear (0 without it).
    torch's fp32 matmul is MKL's, and MKL may not use a non-Intel CPU's AVX-512."""
    try:
        gen = torch.Generator().manual_seed(0)
        a = torch.randn(n, n, generator=gen)
        w = torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, n, generator=gen), n)
        seconds = best_seconds(
            lambda: torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], ""), tries
        )
    except (AttributeError, RuntimeError):
        return 0.0
    return 2 * n**3 / seconds / 1e9


def measure_limits(limits: MachineLimits | None, args: argparse.Namespace) -> MachineLimits:
    """Measure once more; keep the best figures seen so far. The fp32 GEMM is the best
    of MKL's and oneDNN's; a bf16 GEMM is measured only where the CPU (at the ISA level
    in use) has bf16 instructions: elsewhere torch's bf16 matmul is emulated, takes
    minutes at this size, and no Diptych kernel computes in bf16 there."""
    from kernels import cpu_ops

    mib = 256 if args.quick else 1024
    n = 1024 if args.quick else 4096
    bw = copy_bandwidth(mib << 20, 4 if args.quick else 10)
    rd = read_bandwidth(mib << 20, 4 if args.quick else 10)
    fl32 = max(gemm_flops(n, torch.float32, 2), onednn_fp32_gemm_flops(n, 2))
    native_bf16 = cpu_ops.dispatch_report(torch.bfloat16)["gemm"] in ("vnni", "amx", "onednn")
    if args.torch_dtype == torch.float32:
        fl = fl32
    elif native_bf16:
        fl = gemm_flops(n, args.torch_dtype, 2 if args.quick else 5)
    else:
        fl = 0.0
    print(
        f"  copy {bw:.1f} GB/s (bytes copied, {mib} MiB), read {rd:.1f} GB/s, "
        f"{args.torch_dtype} GEMM {fl:.0f} GFLOP/s ({n}^3; 0: not measured), "
        f"fp32 GEMM {fl32:.0f} GFLOP/s"
    )
    tried = {"copy_gbps": bw, "read_gbps": rd, "gemm_gflops": fl, "fp32_gemm_gflops": fl32}
    if limits is None:
        return MachineLimits(bw, fl, mib, n, [tried], rd, fl32)
    limits.tries.append(tried)
    limits.copy_gbps = max(limits.copy_gbps, bw)
    limits.read_gbps = max(limits.read_gbps, rd)
    limits.gemm_gflops = max(limits.gemm_gflops, fl)
    limits.fp32_gemm_gflops = max(limits.fp32_gemm_gflops, fl32)
    return limits


# -- workload ---------------------------------------------------------------------


def make_prompts(seed: int, batch: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(FIRST_ORDINARY_TOKEN, vocab) for _ in range(length)] for _ in range(batch)
    ]


# -- Diptych ------------------------------------------------------------------------


def build_engine(args: argparse.Namespace) -> EngineCore:
    from engine import EngineConfig, EngineCore
    from engine.weights import load_model_config
    from protocol.kv_layout import KvLayout

    mc = load_model_config(None)
    block_size = 16
    block_bytes = KvLayout(
        1,
        mc.num_hidden_layers,
        block_size,
        mc.num_key_value_heads,
        mc.head_dim,
        str(args.torch_dtype).removeprefix("torch."),
    ).block_bytes
    per_seq = -(-(args.prompt_len + args.gen_len) // block_size)
    # Every batch at once, plus the long prompt, plus slack for the null block.
    blocks = max(args.batch_sizes) * per_seq + -(-(args.ttft_prompt_len + 1) // block_size) + 8
    config = EngineConfig(
        dtype=args.dtype,
        block_size=block_size,
        kv_cache_memory_bytes=max(1 << 30, blocks * block_bytes),
        max_num_seqs=max(128, max(args.batch_sizes)),
    )
    return EngineCore(config)


def run_diptych(
    core: EngineCore, prompts: list[list[int]], gen_len: int, salt: str
) -> tuple[RunResult, list[list[int]]]:
    """Generate `gen_len` greedy tokens for every prompt; the cache salt keeps runs apart."""
    from engine import NewRequest, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=gen_len, ignore_eos=True)
    ids = [f"{salt}-{i}" for i in range(len(prompts))]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    cached = 0
    step_times: list[float] = []
    decode_tokens = 0
    prefill_done: float | None = None
    steps = 0
    gc.collect()
    t0 = time.perf_counter()
    for rid, p in zip(ids, prompts):
        core.submit(NewRequest(rid, p, params, cache_salt=salt))
    last = t0
    while core.has_unfinished_requests():
        outs = core.step()
        now = time.perf_counter()
        steps += 1
        n_new = 0
        for out in outs:
            toks = tokens[out.request_id]
            if not toks:
                cached += out.num_cached_tokens
            toks.extend(out.new_token_ids)
            n_new += len(out.new_token_ids)
        if prefill_done is not None:
            decode_tokens += n_new
            step_times.append(now - last)
        elif all(tokens.values()):
            prefill_done = now
        last = now
    end = last
    assert prefill_done is not None
    lengths = {len(t) for t in tokens.values()}
    if lengths != {gen_len}:
        raise RuntimeError(f"Diptych produced output lengths {sorted(lengths)}, wanted {gen_len}")
    result = RunResult(
        batch=len(prompts),
        total_s=end - t0,
        prefill_s=prefill_done - t0,
        decode_s=end - prefill_done,
        output_tokens=len(prompts) * gen_len,
        decode_tokens=decode_tokens,
        steps=steps,
        decode_step_ms_median=1e3 * statistics.median(step_times) if step_times else 0.0,
        cached_prompt_tokens=cached,
    )
    return result, [tokens[rid] for rid in ids]


def diptych_ttft(core: EngineCore, prompt: list[int], salt: str) -> float:
    """Seconds from adding one request to its first token."""
    from engine import NewRequest, SamplingParams

    gc.collect()
    t0 = time.perf_counter()
    core.submit(
        NewRequest(salt, prompt, SamplingParams(temperature=0, max_tokens=2), cache_salt=salt)
    )
    while not any(out.new_token_ids for out in core.step()):
        if not core.has_unfinished_requests():
            raise RuntimeError("the long-prompt request finished without a token")
    dt = time.perf_counter() - t0
    core.abort_request(salt)
    return dt


def loaded_parameter_bytes(core: EngineCore) -> int:
    """Bytes the loaded model's parameters occupy (a cross-check of the analytic count;
    it would miss weights an engine repacks into buffers)."""
    return sum(p.numel() * p.element_size() for p in core.runner.model.parameters())


# -- HF transformers -------------------------------------------------------------------


def load_hf(dtype: torch.dtype) -> Any:
    import transformers
    from transformers import AutoModelForCausalLM

    from engine.weights import default_model_path

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    path = default_model_path()
    kwargs: dict[str, Any] = {}
    try:  # newer transformers may keep GGUF blocks packed; this run compares dense models
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    with contextlib.redirect_stderr(io.StringIO()):  # the GGUF converter's progress bar
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=dtype, **kwargs
        ).eval()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module.weight.dtype != dtype:
            raise RuntimeError(f"HF layer {name} holds {module.weight.dtype}, not {dtype}")
    return model


class _StepClock:
    """A logits processor that only records when it is called (once per generated token)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


def run_hf(model: Any, prompts: list[list[int]], gen_len: int) -> tuple[RunResult, list[list[int]]]:
    from transformers import LogitsProcessorList

    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = model.generation_config.eos_token_id
    pad = int(pad[0] if isinstance(pad, list) else pad)
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    clock = _StepClock()
    gc.collect()
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=gen_len,
            min_new_tokens=gen_len,
            pad_token_id=pad,
            logits_processor=LogitsProcessorList([clock]),
        )
        end = time.perf_counter()
    new = out[:, width:]
    if new.shape[1] != gen_len or len(clock.times) != gen_len:
        raise RuntimeError(f"HF generated {new.shape[1]} tokens, wanted {gen_len}")
    first = clock.times[0]
    gaps = [b - a for a, b in zip(clock.times, clock.times[1:])]
    result = RunResult(
        batch=len(prompts),
        total_s=end - t0,
        prefill_s=first - t0,
        decode_s=end - first,
        output_tokens=len(prompts) * gen_len,
        decode_tokens=len(prompts) * (gen_len - 1),
        steps=gen_len,
        decode_step_ms_median=1e3 * statistics.median(gaps) if gaps else 0.0,
    )
    return result, new.tolist()


def hf_ttft(model: Any, prompt: list[int]) -> float:
    """One forward pass over the prompt (building the KV cache) and the argmax of its last row."""
    ids = torch.tensor([prompt])
    gc.collect()
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        int(out.logits[0, -1].argmax())
        return time.perf_counter() - t0


def compare_outputs(ours: list[list[int]], theirs: list[list[int]]) -> tuple[int, float]:
    prefixes = []
    for a, b in zip(ours, theirs):
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefixes.append(k)
    identical = sum(1 for a, b in zip(ours, theirs) if a == b)
    return identical, statistics.fmean(prefixes)


# -- the benchmark ---------------------------------------------------------------------


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    info = machine_info()
    print(
        f"machine: {info['cpu']}, {info['logical_cpus']} CPUs, "
        f"torch {info['torch']} with {info['torch_threads']} threads"
    )
    busy = info["cpu_busy_samples"][0]
    if busy is not None and busy > 0.2 and torch.get_num_threads() > 1:
        print(
            f"warning: tasks waited for a CPU {100 * busy:.0f} % of the last 10 s: other work "
            "is running, and multi-threaded torch ops stall at every barrier when a thread "
            "loses its core; expect slow, noisy figures (--threads 1 is steadier)"
        )
    print("machine limits (before):")
    limits = measure_limits(None, args)

    t = time.perf_counter()
    core = build_engine(args)
    mc = core.model_config
    print(
        f"Diptych loaded {mc.name} in {time.perf_counter() - t:.1f} s "
        f"({core.layout.num_blocks} KV blocks)"
    )
    hf_model = None
    if not args.skip_hf:
        t = time.perf_counter()
        hf_model = load_hf(args.hf_torch_dtype)
        print(f"HF transformers loaded the same file in {time.perf_counter() - t:.1f} s")

    vocab = mc.vocab_size
    p_len, g_len = args.prompt_len, args.gen_len

    # Long-prompt TTFT first: it also warms the big prefill shapes for both.
    long_prompt = make_prompts(args.seed + 7, 1, args.ttft_prompt_len, vocab)[0]
    diptych_ttft(core, long_prompt, "ttft-warm")
    ttft = [diptych_ttft(core, long_prompt, f"ttft-{i}") for i in range(args.repeats)]
    hf_ttft_s: list[float] = []
    if hf_model is not None:
        hf_ttft(hf_model, long_prompt)
        hf_ttft_s = [hf_ttft(hf_model, long_prompt) for _ in range(args.repeats)]
    print(
        f"TTFT {args.ttft_prompt_len}-token prompt: Diptych "
        f"{1e3 * statistics.median(ttft):.0f} ms"
        + (f", HF {1e3 * statistics.median(hf_ttft_s):.0f} ms" if hf_ttft_s else "")
    )

    batches: list[BatchResult] = []
    for bs in args.batch_sizes:
        prompts = make_prompts(args.seed + bs, bs, p_len, vocab)
        warm = make_prompts(args.seed + 1000 + bs, bs, p_len, vocab)
        repeats = args.repeats if bs <= args.repeat_max_batch else 1
        warm_len = g_len if bs == 1 else min(g_len, WARMUP_TOKENS)
        run_diptych(core, warm, warm_len, f"warm{bs}")
        br = BatchResult(bs, [])
        for i in range(repeats):
            run, d_out = run_diptych(core, prompts, g_len, f"b{bs}r{i}")
            br.diptych.append(run)
        m = median_run(br.diptych)
        line = f"batch {bs:>3}: Diptych {m.total_tok_s:7.1f} tok/s (decode {m.decode_tok_s:7.1f})"
        if hf_model is not None:
            run_hf(hf_model, warm, warm_len)
            for _ in range(repeats):
                run, h_out = run_hf(hf_model, prompts, g_len)
                br.hf.append(run)
            br.hf_identical_sequences, br.hf_mean_common_prefix = compare_outputs(d_out, h_out)
            h = median_run(br.hf)
            line += (
                f" | HF {h.total_tok_s:7.1f} tok/s (decode {h.decode_tok_s:7.1f})"
                f" | same greedy output {br.hf_identical_sequences}/{bs}"
            )
        print(line, flush=True)
        batches.append(br)
        info["cpu_busy_samples"].append(busy_share(_cpu_pressure()))

    print("machine limits (after):")
    limits = measure_limits(limits, args)
    info["loadavg_end"] = _loadavg()
    info["cpu_pressure_end"] = _cpu_pressure()
    info["cpu_busy_samples"].append(busy_share(info["cpu_pressure_end"]))

    # Every parameter is read once per decode step; a tied embedding once, by the lm_head.
    n_params = mc.num_params()
    wbytes = n_params * torch.empty((), dtype=args.torch_dtype).element_size()
    mean_ctx = p_len + g_len / 2
    attn_flops = 4 * mc.num_hidden_layers * mc.num_attention_heads * mc.head_dim * mean_ctx
    flops_per_token = 2 * n_params + attn_flops
    return {
        "config": {
            "dtype": str(args.torch_dtype).removeprefix("torch."),
            "hf_dtype": str(args.hf_torch_dtype).removeprefix("torch."),
            "kernels": core.runner.kernel_paths(),
            "model": mc.name,
            "batch_sizes": args.batch_sizes,
            "prompt_len": p_len,
            "gen_len": g_len,
            "ttft_prompt_len": args.ttft_prompt_len,
            "repeats": args.repeats,
            "repeat_max_batch": args.repeat_max_batch,
            "seed": args.seed,
            "quick": args.quick,
            "skip_hf": args.skip_hf,
            "threads": torch.get_num_threads(),
            "note": args.note,
            "engine": {
                "block_size": core.config.block_size,
                "num_blocks": core.layout.num_blocks,
                "max_num_batched_tokens": core.config.max_num_batched_tokens,
                "max_num_seqs": core.config.max_num_seqs,
                "attention_backend": type(core.runner.attn_backend).__name__,
            },
            "hf_attn_implementation": (
                hf_model.config._attn_implementation if hf_model is not None else None
            ),
        },
        "machine": info,
        "limits": dataclasses.asdict(limits),
        "model": {
            "parameters": n_params,
            "weight_bytes": wbytes,
            "loaded_parameter_bytes": loaded_parameter_bytes(core),
            "flops_per_token": flops_per_token,
            "attention_flops_per_token_at_mean_context": attn_flops,
            "mean_decode_context": mean_ctx,
        },
        "ttft_s": {"diptych": ttft, "hf": hf_ttft_s},
        "batches": [
            {
                "batch": b.batch,
                "diptych": [_run_dict(r) for r in b.diptych],
                "hf": [_run_dict(r) for r in b.hf],
                "hf_identical_sequences": b.hf_identical_sequences,
                "hf_mean_common_prefix": b.hf_mean_common_prefix,
            }
            for b in batches
        ],
    }


def _run_dict(r: RunResult) -> dict[str, Any]:
    d = dataclasses.asdict(r)
    d["total_tok_s"] = r.total_tok_s
    d["decode_tok_s"] = r.decode_tok_s
    return d


# -- figures and report ----------------------------------------------------------------


def _median_of(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not runs:
        return None
    ordered = sorted(runs, key=lambda r: r["total_s"])
    return ordered[(len(ordered) - 1) // 2]


def efficiency(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The three figures with their targets; a figure whose inputs are absent is None."""
    limits, model = res["limits"], res["model"]
    by_batch = {b["batch"]: b for b in res["batches"]}
    small = by_batch.get(1)
    large_bs = 64 if 64 in by_batch else max(by_batch)
    large = by_batch[large_bs]
    figs: list[dict[str, Any]] = []

    bw = achieved_bw = None
    if small:
        d1 = _median_of(small["diptych"])
        assert d1 is not None
        achieved_bw = model["weight_bytes"] * d1["decode_tok_s"] / 1e9
        bw = achieved_bw / limits["copy_gbps"]
    figs.append(
        {
            "name": "batch-1 decode bandwidth efficiency",
            "formula": "weight bytes x decode tok/s / copy bandwidth",
            "achieved": None
            if achieved_bw is None
            else (
                f"{achieved_bw:.1f} GB/s of weights "
                f"({achieved_bw / max(limits.get('read_gbps', 0.0), 1e-9):.0%} of the "
                f"{limits.get('read_gbps', 0.0):.1f} GB/s read bandwidth)"
            ),
            "value": bw,
            "target": TARGET_BANDWIDTH_EFF,
            "unit": "%",
        }
    )
    dl = _median_of(large["diptych"])
    assert dl is not None
    achieved_fl = model["flops_per_token"] * dl["decode_tok_s"] / 1e9
    arith = arithmetic_dtype(res["config"])
    peak = limits["gemm_gflops"]
    if (arith == "float32" or not peak) and limits.get("fp32_gemm_gflops"):
        arith, peak = "float32", limits["fp32_gemm_gflops"]
    fl = achieved_fl / peak
    figs.append(
        {
            "name": f"batch-{large_bs} decode FLOP efficiency",
            "formula": "(2 x params + attention at mean context) x decode tok/s / "
            f"{arith} GEMM FLOP/s",
            "achieved": f"{achieved_fl:.0f} GFLOP/s",
            "value": fl,
            "target": TARGET_FLOP_EFF,
            "unit": "%",
        }
    )
    sp = achieved_sp = None
    if small and small["hf"]:
        d1, h1 = _median_of(small["diptych"]), _median_of(small["hf"])
        assert d1 is not None and h1 is not None
        sp = d1["total_tok_s"] / h1["total_tok_s"]
        achieved_sp = f"{d1['total_tok_s']:.1f} vs {h1['total_tok_s']:.1f} tok/s"
    figs.append(
        {
            "name": "batch-1 speedup vs transformers",
            "formula": "Diptych tok/s / HF tok/s (median runs, prefill included)",
            "achieved": achieved_sp,
            "value": sp,
            "target": TARGET_SPEEDUP,
            "unit": "x",
        }
    )
    return figs


def arithmetic_dtype(cfg: dict[str, Any]) -> str:
    """The dtype the linears compute in: bf16 weights widened to fp32 in registers
    (the "f32acc" GEMM, on CPUs without bf16 instructions) compute in fp32."""
    if (cfg.get("kernels") or {}).get("gemm") == "f32acc":
        return "float32"
    return str(cfg["dtype"])


def _fmt_fig(value: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    return f"{100 * value:.1f} %" if unit == "%" else f"{value:.2f}x"


def _verdict(f: dict[str, Any]) -> str:
    if f["value"] is None:
        return "not measured"
    return "PASS" if f["value"] >= f["target"] else "FAIL"


def _spread(runs: list[dict[str, Any]]) -> str:
    """ " (min–max)" of tok/s over repeated runs; empty for a single run."""
    if len(runs) < 2:
        return ""
    rates = [r["total_tok_s"] for r in runs]
    return f" ({min(rates):.1f}–{max(rates):.1f})"


def tables(res: dict[str, Any]) -> str:
    """The results as markdown: throughput, TTFT, efficiency vs targets."""
    hf_on = not res["config"]["skip_hf"]
    head = ["batch", "Diptych tok/s", "decode tok/s", "prefill s", "step ms"]
    if hf_on:
        head += ["HF tok/s", "HF decode tok/s", "HF prefill s", "speedup", "same output"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for b in res["batches"]:
        d = _median_of(b["diptych"])
        assert d is not None
        n = len(b["diptych"])
        cells = [
            f"{b['batch']}" + (f" (median of {n})" if n > 1 else ""),
            f"{d['total_tok_s']:.1f}" + _spread(b["diptych"]),
            f"{d['decode_tok_s']:.1f}",
            f"{d['prefill_s']:.2f}",
            f"{d['decode_step_ms_median']:.1f}",
        ]
        if hf_on:
            h = _median_of(b["hf"])
            assert h is not None
            cells += [
                f"{h['total_tok_s']:.1f}" + _spread(b["hf"]),
                f"{h['decode_tok_s']:.1f}",
                f"{h['prefill_s']:.2f}",
                f"{d['total_tok_s'] / h['total_tok_s']:.2f}x",
                f"{b['hf_identical_sequences']}/{b['batch']}",
            ]
        rows.append("| " + " | ".join(cells) + " |")

    cfg, lim = res["config"], res["limits"]
    ttft = res["ttft_s"]
    ttft_line = (
        f"Time to first token, one {cfg['ttft_prompt_len']:,}-token prompt "
        f"(median of {len(ttft['diptych'])}): Diptych "
        f"{1e3 * statistics.median(ttft['diptych']):.0f} ms"
    )
    if ttft["hf"]:
        ttft_line += (
            f", HF transformers {1e3 * statistics.median(ttft['hf']):.0f} ms "
            "(one forward pass over the prompt)"
        )
    limits_line = (
        f"Machine limits in this run (best of {len(lim['tries'])} rounds): copy "
        f"{lim['copy_gbps']:.1f} GB/s (bytes copied per second, memcpy of "
        f"{lim['copy_buffer_mib']} MiB buffers; STREAM counts twice that), read "
        f"{lim.get('read_gbps', 0.0):.1f} GB/s (summing the buffer), "
        + (
            f"{cfg['dtype']} GEMM {lim['gemm_gflops']:.0f} GFLOP/s ({lim['gemm_n']}^3 matmul)"
            if lim["gemm_gflops"]
            else f"no {cfg['dtype']} GEMM (the CPU has no {cfg['dtype']} instructions here)"
        )
        + (
            f", float32 GEMM {lim['fp32_gemm_gflops']:.0f} GFLOP/s (the better of MKL and oneDNN)."
            if cfg["dtype"] != "float32" and lim.get("fp32_gemm_gflops")
            else "."
        )
    )
    m = res["model"]
    model_line = (
        f"Model: {cfg['model']}, {m['parameters'] / 1e6:.1f} M parameters, "
        f"{m['weight_bytes'] / 1e6:.0f} MB of weights in {cfg['dtype']}, "
        f"{m['flops_per_token'] / 1e6:.0f} MFLOP per token "
        f"(2 x params + attention at mean context {m['mean_decode_context']:.0f})."
    )
    eff = [
        "| figure | computed as | achieved | value | target | result |",
        "|---|---|---:|---:|---:|---|",
    ]
    for f in efficiency(res):
        target = f"≥ {100 * f['target']:.0f} %" if f["unit"] == "%" else f"≥ {f['target']:.0f}x"
        eff.append(
            f"| {f['name']} | {f['formula']} | {f['achieved'] or 'n/a'} "
            f"| {_fmt_fig(f['value'], f['unit'])} | {target} | {_verdict(f)} |"
        )
    hf_dtype = cfg.get("hf_dtype", cfg["dtype"])
    both = (
        f"both run in {cfg['dtype']}"
        if hf_dtype == cfg["dtype"]
        else f"Diptych runs in {cfg['dtype']}, HF in {hf_dtype}"
    )
    notes = "tok/s of repeated batches: median run (slowest–fastest run)." + (
        f" same output: sequences whose greedy tokens all equal HF's; {both}, where "
        "near-tied logits can break either way, so this is a sanity check, not a parity "
        "test (the fp32 parity tests are in tests/engine)."
        if hf_on
        else ""
    )
    return "\n".join(
        [
            "\n".join(rows),
            "",
            notes,
            "",
            ttft_line + ".",
            "",
            limits_line,
            model_line,
            "",
            "\n".join(eff),
        ]
    )


def command_line(argv: Sequence[str]) -> str:
    return shlex.join(["python", "benchmarks/engine_throughput.py", *argv])


def docs_section(res: dict[str, Any], command: str) -> str:
    info, cfg = res["machine"], res["config"]
    date = datetime.date.today().isoformat()
    busy = [b for b in info.get("cpu_busy_samples", []) if b is not None]
    load = ""
    if info.get("loadavg_start") and info.get("loadavg_end"):
        load = (
            f" Load average {info['loadavg_start'][0]:.1f} at the start, "
            f"{info['loadavg_end'][0]:.1f} at the end."
        )
    if busy and max(busy) > BUSY_THRESHOLD:
        machine_note = (
            "**These numbers were taken on a shared, busy machine (other jobs running beside "
            f"this one): tasks waited for a CPU up to {100 * max(busy):.0f} % of the time "
            f"(mean {100 * statistics.fmean(busy):.0f} %, Linux CPU pressure sampled "
            f"{len(busy)} times).{load} Read them as indicative and rerun the command on a "
            "quiet machine.**"
        )
    elif busy:
        machine_note = (
            f"The machine was quiet: tasks waited for a CPU at most {100 * max(busy):.0f} % of "
            f"the time (Linux CPU pressure sampled {len(busy)} times).{load}"
        )
    else:
        machine_note = f"CPU pressure was not available on this machine.{load}"
    if cfg.get("note"):
        machine_note += f" {cfg['note']}"
    git = info.get("git") or {}
    code = ""
    if git.get("commit"):
        changed = git.get("uncommitted_engine_files") or []
        code = f" Code: commit {git['commit']}" + (
            f" plus uncommitted changes to {', '.join(f'`{c}`' for c in changed)}."
            if changed
            else "."
        )
    hf = (
        ""
        if cfg["skip_hf"]
        else (
            f" HF transformers {info['transformers']} (`generate`, {cfg['hf_attn_implementation']} "
            "attention, left-padded batch, `min_new_tokens` = `max_new_tokens`) runs the same "
            "prompts, alternating with Diptych per batch size."
        )
    )
    method = (
        "Method: one process measures the machine's copy bandwidth and GEMM FLOP/s (best of "
        "several, before and after the engines run), then drives Diptych's `EngineCore` step "
        f"by step on {cfg['prompt_len']}-token seeded random prompts, distinct per sequence "
        "and salted per run so the prefix cache never hits, generating "
        f"{cfg['gen_len']} greedy tokens with EOS ignored. Model load is excluded; each batch "
        f"size is warmed up first (a whole run at batch 1, {WARMUP_TOKENS} tokens above it) on "
        f"prompts of its own; batches up to {cfg['repeat_max_batch']} report the median "
        f"of {cfg['repeats']} runs, larger ones a single run. tok/s counts every output token "
        "over the whole run (prefill included); decode tok/s counts the tokens produced after "
        "the last sequence got its first token, over that time; step ms is the median decode "
        f"step; prefill s is the time until every sequence had its first token.{hf} "
        "Raw figures: `--json PATH`."
    )
    return "\n".join(
        [
            "## Engine",
            "",
            f"Measured {date} on {info['cpu']}, {info['logical_cpus']} cores, "
            f"torch {info['torch']} ({info['torch_threads']} "
            f"thread{'s' if info['torch_threads'] != 1 else ''}), "
            f"Python {info['python']}; {cfg['dtype']}, "
            f"{cfg['model']} (GGUF dequantized to {cfg['dtype']}).{code}",
            "",
            machine_note,
            "",
            "```",
            command,
            "```",
            "",
            tables(res),
            "",
            method,
            "",
        ]
    )


def write_docs(path: Path, section: str) -> None:
    """Replace the "## Engine" section's own text (up to its first "### " subsection or
    the next "## " heading) and nothing else: other benchmarks write the subsections."""
    text = path.read_text()
    match = re.search(r"^## Engine[ \t]*\n", text, flags=re.MULTILINE)
    if match is None:
        raise ValueError(f'{path} has no "## Engine" heading')
    nxt = re.search(r"^###? ", text[match.end() :], flags=re.MULTILINE)
    end = match.end() + nxt.start() if nxt else len(text)
    body = section if nxt is None else section.rstrip("\n") + "\n\n"
    path.write_text(text[: match.start()] + body + text[end:])


# -- entry point -----------------------------------------------------------------------


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="Diptych engine throughput beside HF transformers and the machine's limits."
    )
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument(
        "--hf-dtype",
        default=None,
        choices=["bfloat16", "float32"],
        help="HF transformers' dtype (default: --dtype; float32 is its fast path on CPUs "
        "without bf16 instructions)",
    )
    ap.add_argument("--batch-sizes", default=None, help="comma-separated (default 1,8,32,64)")
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 128)")
    ap.add_argument("--gen-len", type=int, default=None, help="generated tokens (default 128)")
    ap.add_argument(
        "--ttft-prompt-len",
        type=int,
        default=None,
        help="prompt tokens of the TTFT measurement (default 1024)",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed runs of the small batches, median reported (default 3)",
    )
    ap.add_argument(
        "--repeat-max-batch",
        type=int,
        default=8,
        help="largest batch size that is repeated (default 8)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="small smoke workload: batches 1,4, 32+16 tokens, 256-token TTFT",
    )
    ap.add_argument("--skip-hf", action="store_true", help="don't run HF transformers")
    ap.add_argument("--json", type=Path, default=None, help="write raw results here")
    ap.add_argument(
        "--write-docs",
        action="store_true",
        help='rewrite the "## Engine" section of docs/benchmarks.md',
    )
    ap.add_argument("--note", default="", help="a sentence to add to the docs section")
    ap.add_argument("--docs-path", type=Path, default=REPO_ROOT / "docs" / "benchmarks.md")
    args = ap.parse_args(argv)
    quick = args.quick
    if args.batch_sizes is None:
        args.batch_sizes = "1,4" if quick else "1,8,32,64"
    try:
        args.batch_sizes = sorted({int(x) for x in args.batch_sizes.split(",") if x.strip()})
    except ValueError:
        ap.error(f"--batch-sizes takes integers separated by commas, got {args.batch_sizes!r}")
    args.prompt_len = args.prompt_len or (32 if quick else 128)
    args.gen_len = args.gen_len or (16 if quick else 128)
    args.ttft_prompt_len = args.ttft_prompt_len or (256 if quick else 1024)
    args.repeats = args.repeats or (1 if quick else 3)
    for name in ("prompt_len", "gen_len", "ttft_prompt_len", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        ap.error("--batch-sizes must be positive integers")
    if args.gen_len < 2:
        ap.error("--gen-len must be >= 2 to separate prefill from decode")
    args.torch_dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    args.hf_dtype = args.hf_dtype or args.dtype
    args.hf_torch_dtype = torch.bfloat16 if args.hf_dtype == "bfloat16" else torch.float32
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    res = benchmark(args)
    res["wall_s"] = time.perf_counter() - started
    res["command"] = command_line(argv)
    res["efficiency"] = efficiency(res)
    print()
    print(tables(res))
    print(f"\nwall time {res['wall_s'] / 60:.1f} min")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2, default=str) + "\n")
        print(f"raw results: {args.json}")
    if args.write_docs:
        write_docs(args.docs_path, docs_section(res, res["command"]))
        print(f'rewrote the "## Engine" section of {args.docs_path}')
    return 0


if __name__ == "__main__":
    sys.exit(main())
