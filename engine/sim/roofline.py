"""How long a forward pass takes on a named accelerator: a roofline, with stated efficiencies.

A step is bound by whichever takes longer, its arithmetic or its memory traffic:

    compute  = FLOPs / (peak FLOP/s x compute_efficiency)
    memory   = bytes / (HBM bytes/s x bandwidth_efficiency)
    step     = max(compute, memory) + tensor-parallel all-reduces + step_overhead_s
    all-reduce = allreduce_latency_s + bytes x 2(n-1)/n / (link bytes/s x link_efficiency)

FLOPs are 2 per parameter per token for the matrix multiplies (embeddings excluded: a
lookup), plus attention: 4 x layers x heads x head_dim per (query, key) pair (QK^T and
PV, a multiply and an add each; MLA: 2 x (latent + rotary key + latent) a head, its
projections absorbed). Bytes are the weights, read once per step, plus the KV cache:
every key and value each query attends to is read, every new one written (MLA: one
latent row a token and layer, whole on every GPU).

    prefill(new, cached)            new tokens after `cached` already in the cache
    decode(batch, total_context)    one token for each of `batch` sequences whose
                                    contexts sum to `total_context`

With `tensor_parallel=n` each GPU holds 1/n of the weights and heads and runs 1/n of
the FLOPs, and each layer adds two all-reduces of the step's activations over the
accelerator's link. The efficiencies are what real kernels reach of the datasheet
peaks (defaults: 60 % of FLOP/s, 80 % of bandwidth); fit them to measurements, or use
a measured profile instead.

The latency terms, each from a published measurement (docs/benchmarks.md, "Decode
step by tensor-parallel size", holds the sources and the check against them):

- `link_efficiency` 0.82: NCCL reaches about 370 GB/s of NVLink 4's 450 GB/s line rate
  per direction (NVIDIA/nccl-tests issue #212, its maintainer);
- the accelerator's `allreduce_latency_s` per all-reduce, 160 of them a step for an
  80-layer model (1.6 ms at 10 us);
- `step_overhead_s` 4.1 ms: what a step costs beyond its arithmetic, memory traffic
  and collectives (launches, sampling, scheduling), fitted to vLLM's batch-1 step of
  Llama-3.1-70B FP8 on one H100 (30.5 ms, LambdaLabsML/vllm-benchmark); with it the
  roofline lands within a few percent of the same runs at TP 2, 4 and 8;
- `jitter_sigma` 0.017: a step's time varies by a log-normal factor of this sigma
  (the same runs' per-token ITL: p50 32.53 ms, p99 33.83 ms); the simulated engine
  draws it, the roofline's own times are the median.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from engine.config import ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1}


@dataclass(frozen=True)
class Accelerator:
    name: str
    flops: dict[str, float]  # dtype -> dense tensor-core FLOP/s
    hbm_bytes_per_s: float
    hbm_bytes: float
    link_bytes_per_s: float  # one direction's line rate
    allreduce_latency_s: float = 0.0  # per all-reduce, whatever its size

    def peak_flops(self, dtype: str) -> float:
        if dtype not in self.flops:
            raise ValueError(
                f"{self.name} has no {dtype} tensor cores; it has {sorted(self.flops)}"
            )
        return self.flops[dtype]


def _data(name: str) -> dict[str, Any]:
    text = resources.files("engine.sim").joinpath("data", name).read_text()
    doc: dict[str, Any] = json.loads(text)
    return {k: v for k, v in doc.items() if not k.startswith("_")}


def accelerators() -> dict[str, Accelerator]:
    """The accelerators shipped as data (engine/sim/data/accelerators.json)."""
    return {
        name: Accelerator(name=name, **spec) for name, spec in _data("accelerators.json").items()
    }


def models() -> dict[str, ModelConfig]:
    """The model architectures shipped as data (engine/sim/data/models.json)."""
    return {name: ModelConfig.from_hf_dict(cfg, name) for name, cfg in _data("models.json").items()}


@dataclass(frozen=True)
class Roofline:
    accelerator: Accelerator
    model: ModelConfig
    dtype: str = "bfloat16"  # of weights, KV cache and the matrix multiplies
    tensor_parallel: int = 1
    compute_efficiency: float = 0.6
    bandwidth_efficiency: float = 0.8
    link_efficiency: float = 0.82  # NCCL's ~370 of NVLink 4's 450 GB/s
    step_overhead_s: float = 4.1e-3  # launches, sampling, scheduling (fitted: docstring)
    jitter_sigma: float = 0.017  # a step's log-normal spread (measured: docstring)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        self.accelerator.peak_flops(self.dtype)
        if self.step_overhead_s < 0 or self.jitter_sigma < 0:
            raise ValueError("step_overhead_s and jitter_sigma must be >= 0")
        kv, tp = self.model.kv_cache_heads, self.tensor_parallel
        if tp < 1 or (kv % tp and tp % kv):
            raise ValueError(
                f"tensor_parallel={tp} must divide the {kv} KV heads or be a multiple of "
                "them (each then replicated, as the engine does)"
            )
        for name in ("compute_efficiency", "bandwidth_efficiency", "link_efficiency"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1]")
        if self.weight_bytes > self.accelerator.hbm_bytes:
            raise ValueError(
                f"{self.model.name} in {self.dtype} needs {self.weight_bytes / 1e9:.0f} GB of "
                f"weights per GPU, over the {self.accelerator.hbm_bytes / 1e9:.0f} GB of a "
                f"{self.accelerator.name}: raise tensor_parallel"
            )

    @property
    def name(self) -> str:
        return f"{self.accelerator.name}:{self.model.name}:tp{self.tensor_parallel}:{self.dtype}"

    # -- sizes (per GPU) ---------------------------------------------------------------

    @property
    def _bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @functools.cached_property
    def matmul_params(self) -> int:
        """Parameters that take part in a matrix multiply for every token, per GPU (of a
        mixture of experts, the experts a token's router chose)."""
        m = self.model
        # the input embedding is a lookup (when tied, the same matrix is the LM head,
        # which is a matmul); the norms' weights are elementwise
        lookup = 0 if m.tie_word_embeddings else m.vocab_size * m.hidden_size
        norms = (2 * m.num_hidden_layers + 1) * m.hidden_size
        return (m.active_params() - lookup - norms) // self.tensor_parallel

    @functools.cached_property
    def weight_bytes(self) -> float:
        """The weights held, per GPU (every expert)."""
        return self.model.num_params() / self.tensor_parallel * self._bytes

    @functools.cached_property
    def _expert_bytes(self) -> float:
        """One expert's weights in every sparse layer, per GPU (0 for a dense model)."""
        m = self.model
        return m.num_sparse_layers * m.expert_params / self.tensor_parallel * self._bytes

    def _weights_read(self, tokens: int) -> float:
        """Bytes of weights a step of `tokens` reads, per GPU: all of a dense model's; of
        a mixture of experts, the shared part and the experts its tokens chose, as many
        as `tokens` uniformly routed tokens choose on average."""
        e, k = self.model.num_experts, self.model.num_experts_per_tok
        if not e:
            return self.weight_bytes
        chosen = e * (1.0 - (1.0 - k / e) ** tokens)
        return self.weight_bytes - (e - chosen) * self._expert_bytes

    @functools.cached_property
    def kv_bytes_per_token(self) -> float:
        """K and V of one token over all layers, per GPU (MLA: its latent row, which
        every GPU holds whole)."""
        m = self.model
        # fewer KV heads than GPUs: each GPU holds one, replicated (as the engine does)
        per_gpu_heads = max(1, m.kv_cache_heads // self.tensor_parallel)
        return m.num_hidden_layers * m.kv_planes * per_gpu_heads * m.kv_cache_dim * self._bytes

    def _attention_flops(self, pairs: float) -> float:
        """Q K^T and P V for `pairs` (query, key) pairs: 2 (d_k + d_v) a head and pair
        (MLA, absorbed: d_k the latent and rotary key, d_v the latent)."""
        m = self.model
        d_k = m.kv_cache_dim
        d_v = m.kv_lora_rank if m.mla else m.head_dim
        return (
            2
            * m.num_hidden_layers
            * (m.num_attention_heads // self.tensor_parallel)
            * ((d_k + d_v) * pairs)
        )

    # -- time ----------------------------------------------------------------------------

    def _step(self, tokens: int, pairs: float, kv_read: float) -> float:
        flops = 2 * self.matmul_params * tokens + self._attention_flops(pairs)
        compute = flops / (self.accelerator.peak_flops(self.dtype) * self.compute_efficiency)
        traffic = self._weights_read(tokens) + (kv_read + tokens) * self.kv_bytes_per_token
        memory = traffic / (self.accelerator.hbm_bytes_per_s * self.bandwidth_efficiency)
        return max(compute, memory) + self._all_reduce_s(tokens) + self.step_overhead_s

    def _all_reduce_s(self, tokens: int) -> float:
        n = self.tensor_parallel
        if n == 1:
            return 0.0
        m = self.model
        # a ring all-reduce moves 2(n-1)/n of the data through each GPU's link, after
        # a fixed latency; two per layer (after attention and after the MLP)
        data = tokens * m.hidden_size * self._bytes * 2 * (n - 1) / n
        link = self.accelerator.link_bytes_per_s * self.link_efficiency
        each = self.accelerator.allreduce_latency_s + data / link
        return 2 * m.num_hidden_layers * each

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Compute `new_tokens` of one prompt after `cached_tokens` already cached."""
        if new_tokens < 1 or cached_tokens < 0:
            raise ValueError("prefill needs new_tokens >= 1 and cached_tokens >= 0")
        # query i (0-based) attends to the cached tokens and to new tokens 0..i
        pairs = new_tokens * cached_tokens + new_tokens * (new_tokens + 1) / 2
        return self._step(new_tokens, pairs, kv_read=cached_tokens)

    def step_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        """One step over `chunks`, each (new tokens, tokens already cached before them):
        a mixed batch of prefill chunks and decodes (a decode is (1, context))."""
        if not chunks or any(new < 1 or ctx < 0 for new, ctx in chunks):
            raise ValueError("a step needs at least one chunk, each with new >= 1, context >= 0")
        tokens = sum(new for new, _ in chunks)
        pairs = sum(new * ctx + new * (new + 1) / 2 for new, ctx in chunks)
        return self._step(tokens, pairs, kv_read=sum(ctx for _, ctx in chunks))

    def kv_capacity_tokens(self, memory_utilization: float = 0.9) -> int:
        """Tokens of KV one GPU holds: its memory share less the weights, per token."""
        free = self.accelerator.hbm_bytes * memory_utilization - self.weight_bytes
        return max(int(free // self.kv_bytes_per_token), 0)

    def decode_step_s(self, batch: int, total_context: int) -> float:
        """One token for each of `batch` sequences whose contexts sum to `total_context`."""
        if batch < 1 or total_context < batch:
            raise ValueError("decode needs batch >= 1 and total_context >= batch")
        return self._step(batch, total_context, kv_read=total_context)
