"""Model and engine configuration.

`ModelConfig` is the architecture description every loader produces (from a HF
`config.json` or from GGUF metadata); `EngineConfig` holds the knobs of one engine
instance (cache size, token budget, dtype, device), each declared once with its type,
default, range and help: the `diptych` commands' engine flags are generated from it
(`diptych/flags.py`). This module does not import torch, so a command line parses
without it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.sim.config import SimConfig
from protocol.declare import check_fields, spec
from protocol.sampling import LONG_THINKING_TOKENS, MAX_SPECULATIVE_TOKENS

if TYPE_CHECKING:
    import torch

GiB = 1 << 30

# Architectures of the Llama family and the switches that tell them apart.
# qkv_bias: Qwen2/2.5 carry biases on q/k/v projections.
# qk_norm: Qwen3 applies a per-head RMSNorm to q and k before rotary.
# The mixture-of-experts members (Qwen3-MoE, Mixtral) have the same attention; their
# MLPs are experts behind a router (`ModelConfig.num_experts`, engine/models/moe.py).
_ARCH_SWITCHES: dict[str, dict[str, bool]] = {
    "llama": {"qkv_bias": False, "qk_norm": False},
    "mistral": {"qkv_bias": False, "qk_norm": False},
    "qwen2": {"qkv_bias": True, "qk_norm": False},
    "qwen3": {"qkv_bias": False, "qk_norm": True},
    "qwen3_moe": {"qkv_bias": False, "qk_norm": True},
    "mixtral": {"qkv_bias": False, "qk_norm": False},
    "deepseek_v3": {"qkv_bias": False, "qk_norm": False},
}

_HF_ARCH_NAMES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}

SUPPORTED_ARCHITECTURES = tuple(_ARCH_SWITCHES)


class UnsupportedModelError(ValueError):
    """The checkpoint uses an architecture or weight format this engine cannot run."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    # HF-style rope scaling dict ({"rope_type": "llama3", "factor": ...}) or None.
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""
    # Mixture of experts (0 experts: every MLP dense). Each sparse layer's MLP is
    # `num_experts` experts of `moe_intermediate_size` behind a softmax router that
    # sends each token to its `num_experts_per_tok` most probable experts, their
    # probabilities renormalized to sum to 1 when `norm_topk_prob` (Mixtral always;
    # Qwen3-MoE as its config says). The layers in `dense_layers` keep a dense MLP of
    # `intermediate_size` (Qwen3-MoE's `mlp_only_layers` and `decoder_sparse_step`).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    dense_layers: tuple[int, ...] = ()
    # DeepSeek-V3's router ("sigmoid"): each expert's sigmoid score, plus the layer's
    # `e_score_correction_bias` for choosing only; the top `num_experts_per_tok` among
    # the experts of the `topk_group` best of `n_group` groups (a group scored by its two
    # best); their scores renormalized (`norm_topk_prob`) and times
    # `routed_scaling_factor`. `n_shared_experts` experts' worth of dense MLP runs for
    # every token beside them.
    router: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    # Multi-head latent attention (DeepSeek-V2/V3; `kv_lora_rank` 0: none). K and V
    # come from a per-token latent of `kv_lora_rank` values (after `kv_a_layernorm`)
    # and one rotary key of `head_dim` (= qk_rope_head_dim) shared by every head; the
    # KV cache holds just those (`kv_cache_dim` values a token and layer, one plane).
    # Queries: `qk_nope_head_dim` + `head_dim` a head, through a `q_lora_rank`
    # bottleneck when nonzero; values `v_head_dim` a head. `rope_interleave`: the
    # rotary dimensions pair up as (0, 1), (2, 3), ... (DeepSeek's layout).
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False

    def __post_init__(self) -> None:
        if self.architecture not in _ARCH_SWITCHES:
            raise UnsupportedModelError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.router not in ("softmax", "sigmoid"):
            raise UnsupportedModelError(f"unknown router {self.router!r}")
        if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise UnsupportedModelError(
                f"{self.num_experts} experts in {self.n_group} groups, the best "
                f"{self.topk_group} kept: the groups must be equal and topk_group 1 to n_group"
            )
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise UnsupportedModelError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be 1 to "
                f"num_experts={self.num_experts}"
            )

    @property
    def mla(self) -> bool:
        """Whether attention is multi-head latent attention (engine/models/mla.py)."""
        return self.kv_lora_rank > 0

    @property
    def kv_cache_heads(self) -> int:
        """Heads a KV cache row is kept for: the KV heads, or MLA's one latent."""
        return 1 if self.mla else self.num_key_value_heads

    @property
    def kv_cache_dim(self) -> int:
        """Values of one cached head: head_dim, or MLA's latent and rotary key."""
        return self.kv_lora_rank + self.head_dim if self.mla else self.head_dim

    @property
    def kv_planes(self) -> int:
        """Tensors cached a token: K and V, or MLA's latent alone (read as both)."""
        return 1 if self.mla else 2

    def kv_bytes_per_token(self, element_bytes: float) -> float:
        """KV cache bytes of one token over every layer."""
        planes = self.kv_planes * self.kv_cache_heads * self.kv_cache_dim
        return self.num_hidden_layers * planes * element_bytes

    def sparse_layer(self, layer: int) -> bool:
        """Whether `layer`'s MLP is experts behind a router."""
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def num_sparse_layers(self) -> int:
        return sum(self.sparse_layer(n) for n in range(self.num_hidden_layers))

    @property
    def expert_params(self) -> int:
        """One expert's parameters (gate, up and down)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def active_params(self) -> int:
        """The parameters one token runs through: all but the experts its router did
        not choose (`num_params` for a dense model)."""
        idle = self.num_experts - self.num_experts_per_tok
        return self.num_params() - self.num_sparse_layers * idle * self.expert_params

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.mla:
            heads, qk = self.num_attention_heads, self.qk_nope_head_dim + self.head_dim
            r, q = self.kv_lora_rank, self.q_lora_rank
            attn = (q * (h + 1) + q * heads * qk if q else h * heads * qk)
            attn += h * (r + self.head_dim) + r
            attn += r * heads * (self.qk_nope_head_dim + self.v_head_dim)
            attn += heads * self.v_head_dim * h
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * self.head_dim
        experts = self.num_experts * (self.expert_params + h)  # and the router
        experts += self.n_shared_experts * self.expert_params
        if self.router == "sigmoid":
            experts += self.num_experts  # e_score_correction_bias
        mlps = sum(
            experts if self.sparse_layer(n) else 3 * h * i for n in range(self.num_hidden_layers)
        )
        head = 0 if self.tie_word_embeddings else v * h
        return self.num_hidden_layers * (attn + 2 * h) + mlps + v * h + head + h

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], name: str = "") -> ModelConfig:
        """Build from a HF `config.json` dictionary."""
        archs = cfg.get("architectures") or []
        arch = None
        for a in archs:
            arch = _HF_ARCH_NAMES.get(a)
            if arch:
                break
        if arch is None:
            arch = cfg.get("model_type")
        if arch not in _ARCH_SWITCHES:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {', '.join(_HF_ARCH_NAMES)}"
            )
        n_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
        rope_params = cfg.get("rope_parameters") or {}
        rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        rope_scaling = cfg.get("rope_scaling")
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = dict(rope_params)
        if rope_scaling is not None:
            rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if rope_type not in ("default", "llama3", "linear", "yarn"):
                raise UnsupportedModelError(f"unsupported rope scaling type {rope_type!r}")
            if rope_type == "default":
                rope_scaling = None
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        if arch in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
            sliding = None
        switches = _ARCH_SWITCHES[arch]
        layers = cfg["num_hidden_layers"]
        experts = int(
            cfg.get("num_experts") or cfg.get("num_local_experts")
            or cfg.get("n_routed_experts") or 0
        )  # fmt: skip
        dense: tuple[int, ...] = ()
        deepseek = arch == "deepseek_v3"
        if deepseek:
            head_dim = int(cfg["qk_rope_head_dim"])
            if experts:
                dense = tuple(range(min(layers, int(cfg.get("first_k_dense_replace") or 0))))
        if experts and arch == "qwen3_moe":
            step = int(cfg.get("decoder_sparse_step") or 1)
            only = set(cfg.get("mlp_only_layers") or ())
            dense = tuple(n for n in range(layers) if n in only or (n + 1) % step)
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=layers,
            num_attention_heads=n_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", switches["qkv_bias"])),
            qk_norm=switches["qk_norm"],
            rope_scaling=rope_scaling,
            sliding_window=sliding,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
            num_experts=experts,
            num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
            # Mixtral's experts are `intermediate_size` wide, and it always renormalizes
            moe_intermediate_size=(
                int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]) if experts else 0
            ),
            norm_topk_prob=arch == "mixtral" or bool(cfg.get("norm_topk_prob", False)),
            dense_layers=dense,
            router="sigmoid" if deepseek and experts else "softmax",
            n_group=int(cfg.get("n_group") or 1) if deepseek else 1,
            topk_group=int(cfg.get("topk_group") or 1) if deepseek else 1,
            routed_scaling_factor=(
                float(cfg.get("routed_scaling_factor") or 1.0) if deepseek else 1.0
            ),
            n_shared_experts=int(cfg.get("n_shared_experts") or 0) if deepseek and experts else 0,
            kv_lora_rank=int(cfg["kv_lora_rank"]) if deepseek else 0,
            q_lora_rank=int(cfg.get("q_lora_rank") or 0) if deepseek else 0,
            qk_nope_head_dim=int(cfg["qk_nope_head_dim"]) if deepseek else 0,
            v_head_dim=int(cfg["v_head_dim"]) if deepseek else 0,
            rope_interleave=bool(cfg.get("rope_interleave", True)) if deepseek else False,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# a dtype's names -> torch's name for it
_DTYPES = {
    "float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}  # fmt: skip
DTYPES = ("auto", *_DTYPES)


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        found: torch.dtype = getattr(torch, _DTYPES[dtype.lower()])
        return found
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}") from None


SCHEDULING_POLICIES = ("fcfs", "priority")
# `EngineConfig.quantization` / `--quantization`: how the linear weights are held
# (engine.weights.weights_for).
#   gguf   a GGUF's Q4_0 / Q4_1 / Q4_K / Q8_0 / Q6_K / Q5_0 tensors kept as stored
#   int8   weight-only int8 per output channel, quantized at load (any checkpoint)
#   int4   weight-only int4 per group of 32 (the embedding / head get int8)
#   fp8    FP8 e4m3 weights: an FP8 checkpoint's as stored (also without the flag),
#          any other's linears quantized at load per output channel
QUANTIZATIONS = ("gguf", "int8", "int4", "fp8")

# The KV cache's element type (`EngineConfig.kv_cache_dtype`): "auto" is the model's
# dtype; "int8" and "fp8" (alias "fp8_e4m3") keep each head's K/V row as one-byte
# codes (int8, or fp8 e4m3) and an fp16 scale (kernels.kv_quant): about half the
# bytes of bf16 a token, so twice the tokens fit.
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3")


def default_device() -> torch.device:
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class EngineConfig:
    """Knobs of one engine instance.

    The KV pool is sized from `kv_cache_memory_bytes` (or, on GPU, from the free
    memory times `gpu_memory_utilization`) unless `num_blocks` is given. A field with
    `help` is a flag of every command that runs an engine (`--max-num-seqs`; `flag`
    names it otherwise, `scale` converts its unit).
    """

    model: str | None = spec(None, help="a .gguf file or HF directory (default: SmolLM2-135M)")
    dtype: str = spec(
        "auto", choices=DTYPES,
        help="auto (bfloat16 where this CPU or GPU has a fast bf16 path, else float32)",
    )  # fmt: skip
    device: str | None = spec(None, help="cpu or cuda (default: cuda if available)")
    block_size: int = spec(16, lo=1, help="tokens a KV block holds (a power of two)")
    num_blocks: int | None = spec(None, lo=1, help="KV blocks (overrides --kv-cache-memory)")
    kv_cache_memory_bytes: int = spec(
        GiB, lo=0, lo_open=True, flag="kv-cache-memory", scale=GiB, help="KV cache GiB (CPU)"
    )
    gpu_memory_utilization: float = spec(0.85, lo=0.0, lo_open=True, hi=1.0)
    kv_host_memory_bytes: int = spec(
        0, lo=0, flag="kv-host-memory", scale=GiB,
        help="GiB of host RAM for KV blocks the device pool evicts (a tier under the prefix "
        "cache, LRU): a later prefix hit there is copied back instead of computed again",
    )  # fmt: skip
    kv_disk_dir: str = spec(
        "", max_chars=4096,
        help="a directory for KV blocks the host tier evicts (content-addressed files, "
        "checked before use; kept across restarts of the same model and layout)",
    )  # fmt: skip
    kv_disk_bytes: int = spec(
        0, lo=0, flag="kv-disk-gib", scale=GiB, help="GiB the --kv-disk-dir tier may hold"
    )
    kv_session_ttl_s: float = spec(
        0.0, lo=0.0, flag="kv-session-ttl",
        help="seconds a session's last finished turn keeps its KV blocks on the device for "
        "the next turn (the session: the X-Session-Id header or the body's user); 0 off. "
        "Holds yield to requests that need blocks; an expired hold's blocks join the "
        "prefix cache's LRU (and from there the host tier)",
    )  # fmt: skip
    max_num_batched_tokens: int = spec(2048, lo=1, help="tokens a step computes at most")
    max_num_seqs: int = spec(128, lo=1, help="requests a step runs at most")
    max_model_len: int | None = spec(None, lo=2, help="context window (default: the model's)")
    enable_prefix_caching: bool = spec(
        True, flag="no-prefix-caching", help="recompute every prompt (no prefix cache)"
    )
    enable_chunked_prefill: bool = spec(
        True, flag="no-chunked-prefill",
        help="prefill a prompt in one step, not in chunks under the token budget",
    )  # fmt: skip
    attention_backend: str = "auto"
    # CPU, bf16: a second copy of each linear weight packed for batches of 4-256 rows
    # (our AVX512-BF16 GEMM, else oneDNN; ~1.6-2x torch's linear at batch 64);
    # doubles weight memory. False keeps one copy.
    cpu_weight_prepack: bool = spec(
        True, flag="no-weight-prepack",
        help="CPU bf16: skip the packed copy of the weights (saves their size in memory, "
        "slower above batch 3)",
    )  # fmt: skip
    quantization: str | None = spec(
        None, choices=(None, *QUANTIZATIONS),
        help="keep linear weights quantized: gguf (a GGUF's Q4_0/Q4_1/Q4_K/Q8_0/Q6_K/Q5_0 "
        "blocks as stored), int8 (per output channel) or int4 (per 32 values), both "
        "quantized at load, or fp8 (e4m3: an FP8 checkpoint's weights as stored, which is "
        "also the default for one; any other's quantized at load per output channel). "
        "A mixture of experts' experts stay FP8 under fp8, in --dtype under int8/int4 "
        "(default: dense weights in --dtype)",
    )  # fmt: skip
    kv_cache_dtype: str = spec(
        "auto", choices=KV_CACHE_DTYPES,
        help="auto: the KV cache in --dtype; int8 / fp8 (e4m3): each K/V row as one-byte "
        "codes with an fp16 scale per token and head (about half the bytes of bf16: twice "
        "the tokens fit, and a remote prefill moves half as much). Prefill and decode "
        "workers must agree",
    )  # fmt: skip
    num_speculative_tokens: int = spec(
        0, lo=0, hi=MAX_SPECULATIVE_TOKENS,
        help="speculative decoding: draft up to N tokens a step (by prompt lookup from the "
        "request's own context, or with --speculative-model) and verify them in one pass; "
        "the output is the model's own (greedy: identical; sampled: the same "
        "distribution). 0: off; 2-4 suit code edits and quoting",
    )  # fmt: skip
    speculative_model: str | None = spec(
        None,
        help="draft with this smaller model of the same tokenizer (a GGUF or safetensors "
        "path) instead of prompt lookup; it runs in this process with its own KV cache",
    )
    speculative_quantization: str | None = spec(
        None, choices=(None, *QUANTIZATIONS),
        help="keep the draft model's linear weights quantized, as --quantization",
    )  # fmt: skip
    threads: int | None = spec(
        None, lo=1,
        help="CPU threads of each engine process (default: the machine's cores, shared "
        "out among the engine processes `diptych serve` starts)",
    )  # fmt: skip
    tensor_parallel_size: int = spec(
        1, lo=1,
        help="split the model over N ranks (one process each: gloo on CPU, NCCL on N GPUs): "
        "attention heads, the MLP and the vocabulary are divided, the KV cache by KV head. "
        "--quantization int8/int4/fp8 quantize each rank's shard; a --speculative-model runs whole "
        "on rank 0",
    )  # fmt: skip
    expert_parallel_size: int = spec(
        1, lo=1,
        help="a mixture of experts: spread the experts over N ranks of the tensor-parallel "
        "group, whole (N = --tensor-parallel-size; default 1: a slice of every expert's "
        "width a rank). Each rank routes its share of a step's tokens and sends each to "
        "the ranks holding its experts, and their outputs back, by all-to-all",
    )  # fmt: skip
    tensor_parallel_nodes: int = spec(
        1, lo=1, hi=64,
        help="hosts the tensor-parallel group spans, each running size / nodes ranks: "
        "this one rank 0 and its neighbours, the others `diptych tp-node` (a "
        "LeaderWorkerSet's pods)",
    )  # fmt: skip
    tensor_parallel_leader: str = spec(
        "", max_chars=300,
        help="host:port where the other hosts' ranks meet rank 0 (its TCP store listens "
        "on the port), with --tensor-parallel-nodes above 1",
    )  # fmt: skip
    enable_lora: bool = spec(
        False,
        help="serve LoRA adapters of the model (PEFT directories): a request names one as "
        "its model; a step mixes requests for different adapters and the base model",
    )  # fmt: skip
    max_loras: int = spec(
        4, lo=1, hi=256,
        help="LoRA adapters on the device at once (slots): a step serves at most this many; "
        "a request for another waits for a slot",
    )  # fmt: skip
    max_lora_rank: int = spec(
        16, lo=1, hi=512, help="the largest LoRA rank served (the slots' size)"
    )
    max_cpu_loras: int | None = spec(
        None, lo=1,
        help="LoRA adapters kept in host memory, least recently used dropped (re-read from "
        "their directory when asked again) (default: --max-loras)",
    )  # fmt: skip
    deterministic: bool = spec(
        False,
        help="batch-invariant serving: a greedy or seeded request gives the same tokens "
        "(and logits) whatever else is batched with it, whether its prompt was cached or "
        "chunked, aggregated or disaggregated; every linear runs one fixed-order GEMM, "
        "every token attends as a decode row (bf16 on CPU, any dtype on the Triton "
        "path; see docs/architecture.md)",
    )  # fmt: skip
    scheduling_policy: str = spec(
        "fcfs", choices=SCHEDULING_POLICIES,
        help="fcfs, or priority: lower request priority first, preempting the lowest",
    )  # fmt: skip
    long_thinking_tokens: int = spec(
        LONG_THINKING_TOKENS, lo=0, flag="long-thinking-tokens",
        help="a request with at least this much thinking budget left (max_reasoning_tokens) "
        "runs in the long lane: prompts of the short lane are admitted before it, take "
        "their first step without the long lane's decodes, and keep a quarter of the "
        "sequence slots (0: one lane)",
    )  # fmt: skip
    seed: int = 0
    # a simulated engine (engine/sim/): no weights; a timing model stands in for the
    # forward pass and `model` only names the tokenizer (its vocabulary and EOS)
    sim: SimConfig | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, str):  # a torch.dtype: its name
            self.dtype = str(self.dtype).removeprefix("torch.")
        check_fields(self)
        nodes = self.tensor_parallel_nodes
        if self.tensor_parallel_size % nodes:
            raise ValueError(f"tensor parallel size {self.tensor_parallel_size} does not split "
                             f"over {nodes} nodes evenly")  # fmt: skip
        tiers = self.kv_host_memory_bytes or self.kv_disk_dir or self.kv_disk_bytes
        if bool(self.kv_disk_dir) != bool(self.kv_disk_bytes):
            raise ValueError("--kv-disk-dir and --kv-disk-gib go together")
        if tiers and self.tensor_parallel_size > 1:
            raise ValueError("KV tiers (--kv-host-memory, --kv-disk-dir) run at tensor "
                             "parallel size 1 (each rank's blocks would need their own)")
        if self.kv_disk_dir and self.sim is not None:
            raise ValueError("the simulated engine keeps a host tier only (no --kv-disk-dir)")
        ep = self.expert_parallel_size
        if ep > 1 and ep != self.tensor_parallel_size:
            raise ValueError(f"--expert-parallel-size {ep} spreads the experts over the "
                             "tensor-parallel ranks: it must be 1 or --tensor-parallel-size "
                             f"({self.tensor_parallel_size})")  # fmt: skip
        if nodes > 1:
            leader_address(self.tensor_parallel_leader)  # it must say where
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError("LoRA adapters (--enable-lora) run at tensor parallel size 1 "
                             "(each rank would need its shard of every adapter)")  # fmt: skip
        if self.enable_lora and self.sim is not None:
            raise ValueError("LoRA adapters (--enable-lora) need a real model; this engine "
                             "is simulated")  # fmt: skip
        if self.deterministic:
            from engine.determinism import check_config

            check_config(self)

    @property
    def expert_parallel(self) -> bool:
        """Whether each rank holds its share of the experts whole (and tokens go to
        them by all-to-all)."""
        return self.expert_parallel_size > 1

    @property
    def ranks_per_node(self) -> int:
        """The tensor-parallel ranks each host of the group runs."""
        return self.tensor_parallel_size // self.tensor_parallel_nodes

    def torch_device(self) -> torch.device:
        import torch

        return torch.device(self.device) if self.device else default_device()

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return auto_dtype(self.torch_device())
        return parse_dtype(self.dtype)


def auto_dtype(device: torch.device) -> torch.dtype:
    """`dtype="auto"`: bf16 on GPUs that have it (else fp16); on CPU what the kernels'
    capability probe calls fastest and exact enough (`kernels.cpu_ops.auto_dtype`)."""
    import torch

    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "cpu":
        from kernels import cpu_ops

        return cpu_ops.auto_dtype()
    return torch.float32


def leader_address(address: str) -> tuple[str, int]:
    """(host, port) of `--tensor-parallel-leader`; ValueError, saying why, if it is not
    host:port."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--tensor-parallel-leader must be host:port, got {address!r}")
    return host.strip("[]"), int(port)
