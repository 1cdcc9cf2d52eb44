"""The Llama family in one definition: Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3.

Attribute names follow the HF checkpoints (`model.layers.N.self_attn.o_proj`, ...),
so weights load by name. q/k/v and gate/up projections are fused into one matmul
each; `load_weights` fills the fused tensors from the checkpoint's separate ones.
Switches from `ModelConfig`: `qkv_bias` (Qwen2), `qk_norm` (Qwen3),
`tie_word_embeddings`, `sliding_window` (Mistral), rope scaling (Llama 3).

Inputs are one flattened ragged batch of tokens (see `engine.attention.backend.BatchLayout`).
Inside the layer stack submodules are called through `.forward` directly: no hooks
are used, and `nn.Module.__call__`'s hook machinery cost ~0.4 ms of a ~10 ms
batch-1 decode step (30 layers x 9 module calls).

Building blocks of the Llama family: RMSNorm and rotary position embedding.

A decode step's decoder layers in one C++ call (`kernels/csrc/decode_stack_cpu.cpp`).

At batch 1 the layer loop of `engine.models.llama` runs ~11 ops a layer, 330 a step
for a 30-layer model, each a few tens of microseconds of kernel plus the interpreter,
`kernels.ops`'s path checks and the dispatcher. `DecodeStack` hands the whole loop to
one C++ op that calls the same kernels, so the output is bit-identical and only the
per-op overhead goes.

It is built once, after the weights are loaded (`ModelRunner`), when the model can
take it: on CPU with the C++ ops, the torch attention backend, no q/k norm (Qwen3)
and a head size the C++ decode kernel takes. Linears kept quantized (`--quantization`)
run the integer dot-product kernel; dense ones (a dense model, or a GGUF's linears of
a type dequantized at load, such as Q5_1 or Q5_K) what `kernels.ops.linear` picks:
the small-M GEMV up to its rows, then our GEMM on the packed copy (bf16 with
`cpu_weight_prepack`: the VNNI GEMM up to its 256 rows, the fp32-sum GEMM, which has
no plain copy beside it, at any), else torch's linear. A step uses the op when all its
rows are decode rows (decodes and speculative verify rows: no prompt rows in
`TorchAttentionMetadata`) and no more than `max_rows`: 64 (quantized or unpacked
linears), 256 (VNNI), any (fp32-sum), or the GEMV's 1-2 where a dense linear has
oneDNN's packed copy (AMX), which the op does not reproduce; in a row-invariant step
(`kernels.ops.row_invariant`: one that verifies drafts) every dense linear with a plain
weight takes the GEMV, so up to its 8 rows too. Under `--deterministic` the op runs
the linears on their fixed-order packed weights and attention on the batch-invariant
kernel, for any number of rows of one token a sequence. Without the op the Python
loop's overhead had made a batch-1 decode 33 % slower (AVX512-BF16 EPYC, 2 threads),
and stopping the default mode at the GEMV's rows had cost batch 8 about 30 %.
Anything else runs the layer loop.
`DIPTYCH_DECODE_STACK=0` turns it off (for A/B measurements).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine.attention import AttentionBackend
from engine.attention.backend import RowsMetadata, TorchAttention, TorchAttentionMetadata
from engine.config import ModelConfig
from engine.models.mla import MlaAttention
from engine.models.moe import SparseMoE, checkpoint_name, expert_target, filled, load_expert
from kernels import cpu_ops, ops
from kernels.cpu_ops import PackedWeight
from kernels.quant import ROWS, QuantTensor, cat_rows

if TYPE_CHECKING:
    from engine.lora.slots import LoraBatch, LoraStack
    from engine.parallel.group import TpGroup


class Linear(nn.Linear):
    """nn.Linear whose matmul goes through `kernels.ops.linear` (GEMV kernel at decode).

    `packed` is an optional second copy of the weight laid out for batched decode (see
    `LlamaForCausalLM.prepack_weights`); it is not a parameter and never saved.

    `quant` holds the weight kept quantized instead (`set_quant`): one tensor per run of
    rows sharing a layout (a fused q/k/v of Q4_K and Q6_K parts has two).

    `lora` holds its LoRA adapters' slots when the engine serves adapters
    (engine/lora/): each row of a step adds its own adapter's delta to the output.
    """

    packed: PackedWeight | None = None
    quant: tuple[QuantTensor, ...] = ()
    lora: LoraStack | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.run(x)
        if self.lora is not None:
            self.lora.apply(out, x)
        return out

    def run(self, x: torch.Tensor, fp32_out: bool = False) -> torch.Tensor:
        """forward, optionally returning fp32 sums (the head's logits)."""
        if self.quant:
            if len(self.quant) == 1:
                return ops.quant_linear(x, self.quant[0], self.bias, fp32_out)
            out = torch.cat([ops.quant_linear(x, q, None, fp32_out) for q in self.quant], -1)
            return out if self.bias is None else out + self.bias
        return ops.linear(x, self.weight, self.bias, self.packed, fp32_out)

    def set_quant(self, parts: list[QuantTensor]) -> None:
        """Keep the weight as `parts` (stacked rows, in order) and drop the dense one."""
        if sum(p.shape[0] for p in parts) != self.out_features or any(
            p.shape[1] != self.in_features for p in parts
        ):
            raise ValueError(f"quantized parts do not make a {self.out_features}x"
                             f"{self.in_features} weight")  # fmt: skip
        runs: list[list[QuantTensor]] = []
        for p in parts:
            last = runs[-1] if runs else None
            if last and last[0].layout_key == p.layout_key and last[-1].shape[0] % ROWS == 0:
                last.append(p)
            else:
                runs.append([p])
        self.quant = tuple(cat_rows(r) if len(r) > 1 else r[0] for r in runs)
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)
        self.packed = None


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back, as the HF reference does.

    `forward(x, residual)` fuses the residual add: it returns (norm(x + residual),
    x + residual), so a decoder layer carries the residual stream without extra ops.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize over the last dim, any leading shape."""
        flat = x.reshape(-1, x.shape[-1])
        return ops.rms_norm(flat, None, self.weight, self.eps)[0].view(x.shape)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None = None
) -> torch.Tensor:
    """Inverse frequencies of rotary embedding, with llama3/linear/yarn scaling. Computed
    on the CPU whatever device a model is built under: on the meta device these ops run
    torch's Python decompositions, whose import cost seconds of every start."""
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu")
    inv = 1.0 / (theta ** (steps.float() / head_dim))
    if not scaling:
        return inv
    kind = rope_kind(scaling)
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv / factor
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if kind == "yarn":
        return _yarn_inv_freq(inv, head_dim, theta, factor, scaling)
    raise ValueError(f"unsupported rope scaling {kind!r}")


def _yarn_inv_freq(
    inv: torch.Tensor, dim: int, theta: float, factor: float, scaling: dict[str, Any]
) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): the fast-turning dimensions keep their frequency, the
    slow ones are divided by `factor`, and a linear ramp blends the dimensions between
    the one that turns `beta_fast` times over the original context and the one that
    turns `beta_slow` times (rounded outward unless `truncate` is false)."""
    ctx = float(scaling["original_max_position_embeddings"])

    def dim_turning(turns: float) -> float:
        return dim * math.log(ctx / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_turning(float(scaling.get("beta_fast") or 32)), dim_turning(
        float(scaling.get("beta_slow") or 1)
    )
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    steps = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((steps - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency, 0: divided by the factor
    return inv / factor * (1 - keep) + inv * keep


def rope_kind(scaling: dict[str, Any] | None) -> str | None:
    """A rope scaling's type ("llama3", "yarn", ...; older configs say "type"), or None."""
    return scaling.get("rope_type", scaling.get("type")) if scaling else None


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context `factor` times the original."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What a rope scaling multiplies cos and sin by (YaRN's; 1 for the others)."""
    if scaling is None or rope_kind(scaling) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling.get("factor", 1.0))
    mscale, all_dims = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and all_dims:
        return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(all_dims))
    return yarn_mscale(factor)


class RotaryEmbedding:
    """Half-split (HF/NeoX) rotary embedding; cos/sin computed once per step."""

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: dict[str, Any] | None,
        device: torch.device | None = None,
    ) -> None:
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling).to(device)
        self.attention_factor = rope_attention_factor(scaling)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 [T, d/2] tables for `kernels.ops.rotary_`."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        if self.attention_factor != 1.0:
            return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor
        return freqs.cos(), freqs.sin()


@dataclass
class StepInputs:
    """Per-step inputs shared by every layer."""

    attn_meta: Any
    cos: torch.Tensor
    sin: torch.Tensor


class LlamaAttention(nn.Module):
    def __init__(
        self, cfg: ModelConfig, backend: AttentionBackend, tp: TpGroup | None = None
    ) -> None:
        super().__init__()
        self.tp = tp  # row-parallel o_proj: its partial products summed over the ranks
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.attn = backend

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, step: StepInputs) -> torch.Tensor:
        t = x.shape[0]
        qkv: torch.Tensor = self.qkv_proj.forward(x)
        q, k, v = torch.split(qkv, [self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm.norm(q)
            k = self.k_norm.norm(k)
        ops.rotary_(q, step.cos, step.sin)
        ops.rotary_(k, step.cos, step.sin)
        o = self.attn.forward(q, k, v, kv_cache, step.attn_meta)
        out: torch.Tensor = self.o_proj.forward(o)
        return out if self.tp is None else self.tp.all_reduce(out)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TpGroup | None = None) -> None:
        super().__init__()
        self.tp = tp  # row-parallel down_proj, as o_proj
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj.forward(ops.silu_and_mul(self.gate_up_proj.forward(x)))
        return out if self.tp is None else self.tp.all_reduce(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, backend: AttentionBackend, tp: TpGroup | None = None,
        sparse: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        self.self_attn: LlamaAttention | MlaAttention = (
            MlaAttention(cfg, backend, tp) if cfg.mla else LlamaAttention(cfg, backend, tp)
        )
        self.mlp: LlamaMLP | SparseMoE = (
            SparseMoE(cfg, Linear(cfg.hidden_size, cfg.num_experts, bias=False), tp)
            if sparse
            else LlamaMLP(cfg, tp)
        )
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        step: StepInputs,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm.forward(x, residual)
        h = self.self_attn.forward(h, kv_cache, step)
        h, residual = self.post_attention_layernorm.forward(h, residual)
        return self.mlp.forward(h), residual


class LlamaModel(nn.Module):
    def __init__(
        self, cfg: ModelConfig, backend: AttentionBackend, tp: TpGroup | None = None
    ) -> None:
        super().__init__()
        self.tp = tp  # vocab-parallel embedding: this rank's rows of the vocabulary
        # its weight given, not drawn: a random init on the meta device runs torch's
        # Python decompositions, whose import (torch._dynamo) cost 3 s of every start
        shape = (cfg.vocab_size if tp is None else tp.shard.vocab_rows, cfg.hidden_size)
        self.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, backend, tp, cfg.sparse_layer(n))
            for n in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    # the embedding kept quantized (a tied head's weight): rows dequantized per lookup
    embed_quant: QuantTensor | None = None
    # the layer loop of a decode step in one C++ call, where the model can take it
    # (engine/models/llama.py; set by the model runner after loading)
    decode_stack: DecodeStack | None = None
    # this step's LoRA rows, when the engine serves adapters (engine/lora/slots.py)
    lora_batch: LoraBatch | None = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is not None:  # each id's row from the one rank that holds it
            start, rows = self.tp.shard.vocab_start, self.tp.shard.vocab_rows
            local = input_ids - start
            outside = (local < 0) | (local >= rows)
            out = self._rows(local.clamp(0, rows - 1)).masked_fill_(outside[:, None], 0)
            return self.tp.all_reduce(out)
        return self._rows(input_ids)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of this rank's embedding table (dequantized when it is kept quantized)."""
        if self.embed_quant is None:
            out: torch.Tensor = self.embed_tokens(ids)
            return out
        return self.embed_quant.dequantize_rows(ids, self.norm.weight.dtype)

    def forward(
        self, input_ids: torch.Tensor, kv_caches: list[torch.Tensor], step: StepInputs
    ) -> torch.Tensor:
        x = self.embed(input_ids)
        # the one-call stack has no LoRA deltas: a step with adapter rows runs the loop
        lora = self.lora_batch
        stack = self.decode_stack if lora is None or lora.slots is None else None
        fused = stack.run(x, kv_caches, step.attn_meta, step.cos, step.sin) if stack else None
        if fused is not None:
            x, residual = fused
        else:
            residual = None
            for layer, cache in zip(self.layers, kv_caches):
                x, residual = layer.forward(x, residual, cache, step)
        out: torch.Tensor = self.norm(x, residual)[0]
        return out


# checkpoint name fragment -> (fused parameter, shard index)
_FUSED = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class LlamaForCausalLM(nn.Module):
    """With `tp`, rank `tp.rank`'s part of the model: `cfg` is its local shape
    (`TpShard.local_config`), the embedding and head hold its vocabulary rows, and the
    forward pass runs the group's collectives (engine/parallel/)."""

    def __init__(
        self, cfg: ModelConfig, backend: AttentionBackend, tp: TpGroup | None = None
    ) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.model = LlamaModel(cfg, backend, tp)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    def init_rotary(self, device: torch.device) -> None:
        """(Re)build the rotary tables on `device`: a model built on the meta device has none."""
        cfg = self.config
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, device)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            # in the model's dtype: built after the model was cast, it would be fp32
            dtype = self.model.norm.weight.dtype
            rows = cfg.vocab_size if self.tp is None else self.tp.shard.vocab_rows
            self.lm_head = Linear(cfg.hidden_size, rows, bias=False, device=device, dtype=dtype)

    def step_inputs(self, positions: torch.Tensor, attn_meta: Any) -> StepInputs:
        cos, sin = self.rotary.cos_sin(positions)
        return StepInputs(attn_meta, cos, sin)

    def forward(
        self, input_ids: torch.Tensor, kv_caches: list[torch.Tensor], step: StepInputs
    ) -> torch.Tensor:
        hidden: torch.Tensor = self.model(input_ids, kv_caches, step)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits. On CPU the head's kernels sum in fp32 and hand those sums over:
        rounded to bf16 first (ulp 0.125 at 25), logits tie often and argmax breaks the
        tie by token id, which can turn a near-tie the wrong way. With `tp`, every rank's
        vocabulary slice, gathered."""
        logits = self._logits(hidden)
        return logits if self.tp is None else self.tp.gather_vocab(logits)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head.run(hidden, fp32_out=True)
        if self.model.embed_quant is not None:
            return ops.quant_linear(hidden, self.model.embed_quant, None, fp32_out=True)
        w = self.model.embed_tokens.weight
        return ops.linear(hidden, w, None, self.packed_head, fp32_out=True)

    packed_head: cpu_ops.PackedWeight | None = None  # the tied head, packed

    def prepack_weights(self, fixed_order: bool = False) -> tuple[int, int]:
        """Give every linear (and a tied head) a packed copy of its weight for batches
        above the GEMV's few rows (`kernels.cpu_ops.pack_linear_weight`; `fixed_order`:
        one GEMM for every row count, `--deterministic`). A linear whose packed layout
        serves every row count (`PackedWeight.serves_all_rows`) gives up its plain
        weight. Returns (bytes added, bytes released). Call after the weights are
        final: the copies do not follow."""
        added = released = 0
        for mod in self.modules():
            if isinstance(mod, Linear) and not mod.quant and mod.weight.numel():
                head = mod is self.lm_head  # its logits stay fp32 sums
                mod.packed = cpu_ops.pack_linear_weight(mod.weight, head, fixed_order)
                added += mod.packed.data.nbytes
                if mod.packed.serves_all_rows:
                    released += mod.weight.nbytes
                    mod.weight = nn.Parameter(mod.weight.new_empty(0), requires_grad=False)
        if self.lm_head is None and self.model.embed_quant is None:
            # the embedding's rows are still looked up
            self.packed_head = cpu_ops.pack_linear_weight(
                self.model.embed_tokens.weight, True, fixed_order
            )
            added += self.packed_head.data.nbytes
        return added, released

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantTensor]]) -> None:
        """Copy checkpoint tensors (HF names) into the parameters, fusing as needed. A
        `QuantTensor` stays quantized: a linear's (fused) weight becomes its parts
        (`Linear.set_quant`), the embedding's its quantized rows (and the tied head)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        quant: dict[str, dict[int, QuantTensor]] = {}
        for name, tensor in weights:
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            name = checkpoint_name(name)
            expert = expert_target(name)
            if expert is not None:
                loaded.add(load_expert(self, name, tensor, expert))
                continue
            target, shard = name, None
            for frag, (fused, idx) in _FUSED.items():
                # (MLA's q_proj is a linear of its own, not a part of a fused qkv)
                if frag in name and name.replace(frag, fused) in params:
                    target, shard = name.replace(frag, fused), idx
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            if isinstance(tensor, QuantTensor):
                dst = param if shard is None else self._shard(target, param, shard)
                if tensor.shape != tuple(dst.shape):
                    raise ValueError(f"{name}: checkpoint shape {tensor.shape} != model "
                                     f"{tuple(dst.shape)}")  # fmt: skip
                quant.setdefault(target, {})[shard or 0] = tensor
            elif shard is None:
                _copy(param, tensor, name)
            else:
                _copy(self._shard(target, param, shard), tensor, name)
            loaded.add(target if shard is None else f"{target}#{shard}")
        self._check_complete(params, loaded)
        for target, parts in quant.items():
            shards = 3 if ".qkv_proj." in target else 2 if ".gate_up_proj." in target else 1
            if len(parts) == shards:
                self._keep_quantized(target, [parts[i] for i in sorted(parts)])
                continue
            # some shards of this fused weight were stored in a type we do not keep
            # (a Q5_1 v_proj beside a Q4_K q_proj): the whole weight stays dense
            param = params[target]
            for idx, q in parts.items():
                dst = param if shards == 1 else self._shard(target, param, idx)
                _copy(dst, q.dequantize(dst.dtype).to(dst.device), target)
        for m in self.modules():  # once every weight is in place
            if isinstance(m, SparseMoE):
                m.keep_fp8()
            elif isinstance(m, MlaAttention):
                m.absorb()

    def _keep_quantized(self, target: str, parts: list[QuantTensor]) -> None:
        module = self.get_submodule(target.rsplit(".", 1)[0])
        device = self.model.norm.weight.device
        parts = [p.to(device) for p in parts]
        if isinstance(module, Linear) and target.endswith(".weight"):
            module.set_quant(parts)
        elif target == "model.embed_tokens.weight":
            emb = self.model.embed_tokens
            if parts[0].shape != tuple(emb.weight.shape):
                raise ValueError(f"{target}: quantized shape {parts[0].shape} != model "
                                 f"{tuple(emb.weight.shape)}")  # fmt: skip
            self.model.embed_quant = parts[0]
            emb.weight = nn.Parameter(emb.weight.new_empty(0), requires_grad=False)
        else:
            raise ValueError(f"{target} cannot be kept quantized")

    def _shard(self, target: str, param: torch.Tensor, idx: int) -> torch.Tensor:
        cfg = self.config
        if ".qkv_proj." in target:
            sizes = [cfg.q_size, cfg.kv_size, cfg.kv_size]
        else:  # gate and up halves (of the dense MLP, or of a MoE's shared experts)
            sizes = [param.shape[0] // 2, param.shape[0] // 2]
        start = sum(sizes[:idx])
        return param.narrow(0, start, sizes[idx])

    def _check_complete(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        missing = []
        for name in params:
            if ".qkv_proj." in name:
                need = [f"{name}#{i}" for i in range(3)]
            elif ".gate_up_proj." in name:
                need = [f"{name}#{i}" for i in range(2)]
            elif name.endswith((".mlp.w13", ".mlp.w2")):
                experts = params[name].shape[0]
                halves = (0, 1) if name.endswith("w13") else (None,)
                need = [filled(name, e, h) for e in range(experts) for h in halves]
            else:
                need = [name]
            missing += [n for n in need if n not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != model {tuple(dst.shape)}")
    dst.copy_(src)


# `decode_layers`' per-step arguments: block table, lengths, slots, GEMV rows, row_seq
# (the batch-invariant attention's) and the attention code (0 the decode kernel, 1 the
# batch-invariant kernel, 2 that on AMX tiles)
_StackStep = tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, "torch.Tensor | None", int]


@dataclass
class DecodeStack:
    """The flat argument lists of `diptych_cpu::decode_layers` for one model."""

    weights: list[torch.Tensor | None]
    dims: list[int]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    scale: float
    window: int
    max_rows: int  # the most rows a step may have for every linear's kernel to match
    # `--deterministic`: the linears on their fixed-order packed weights and attention
    # on the batch-invariant kernel, for steps of one token a sequence (`RowsMetadata`)
    deterministic: bool = False
    steps: int = field(default=0, compare=False)  # steps it ran (tests, metrics)

    def run(
        self, x: torch.Tensor, kv_caches: list[torch.Tensor], meta: object, cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
        """(hidden, residual) after the last layer, or None when this step is not one
        the op takes (the caller runs the layer loop)."""
        if self.deterministic:
            step = self._rows_step(x, kv_caches, meta)
        else:
            step = self._decode_step(x, meta)
        if step is None:
            return None
        table, lens, slots, gemv_rows, row_seq, attention = step
        h, residual = torch.ops.diptych_cpu.decode_layers.default(
            x, self.weights, self.dims, kv_caches, table, lens, slots,
            cos, sin, self.num_heads, self.num_kv_heads, self.head_dim, self.eps, self.scale,
            self.window, gemv_rows, row_seq, attention,
        )  # fmt: skip
        self.steps += 1
        return h, residual

    def _decode_step(self, x: torch.Tensor, meta: object) -> _StackStep | None:
        """The op's step arguments for a step of decode rows (the decode kernel)."""
        if not isinstance(meta, TorchAttentionMetadata) or meta.decodes is None:
            return None
        if meta.prefills or meta.prompt_rows is not None:
            return None
        t = x.shape[0]
        invariant = ops.row_invariant_rows()  # every dense linear then takes the GEMV
        if meta.num_decodes != t or t > max(self.max_rows, invariant):
            return None
        if meta.slots.dtype != torch.int64:
            return None
        return meta.decodes.block_table, meta.decodes.seq_lens, meta.slots, invariant, None, 0

    def _rows_step(
        self, x: torch.Tensor, kv_caches: list[torch.Tensor], meta: object
    ) -> _StackStep | None:
        """The op's step arguments in a deterministic step: one whose every sequence has
        one token (a decode, or a one-token prompt), each its own row of the
        batch-invariant attention. Any row count: every kernel the op calls then is
        row-invariant."""
        if not isinstance(meta, RowsMetadata) or meta.row_seq is None:
            return None
        rows = meta.rows
        if rows.block_table.shape[0] != x.shape[0] or meta.slots.dtype != torch.int64:
            return None
        amx = cpu_ops.det_attention_on_amx(x.dtype, kv_caches[0].dtype, self.head_dim)
        return rows.block_table, rows.seq_lens, meta.slots, 0, meta.row_seq, 2 if amx else 1


# `decode_layers`' group code of each fixed-order packed layout (csrc/decode_stack_cpu.cpp)
_PACKED_GROUP = {"vnni": -1, "amx": -2, "f32acc": -3}
_ANY_ROWS = 1 << 30


def _linear(
    lin: Linear, weights: list[torch.Tensor | None], dims: list[int], deterministic: bool
) -> int:
    """Append `lin`'s entries; return the most rows it takes (0: it cannot run)."""
    if lin.quant:
        dims.append(len(lin.quant))
        for q in lin.quant:
            weights += [q.codes, q.scales, q.mins]
            dims += [q.group, q.shape[0]]
        # a deterministic step runs the integer dot kernel at every row count
        return _ANY_ROWS if deterministic else ops.QUANT_DOT_MAX_ROWS
    p = lin.packed
    if p is not None and (p.fixed_order or p.serves_all_rows):
        # as ops.linear runs a packed copy that needs no plain weight: at every row count
        if p.kind not in _PACKED_GROUP or p.fixed_order != deterministic:
            return 0
        weights += [p.data, None, None]
        dims += [1, _PACKED_GROUP[p.kind], p.out_features]
        return _ANY_ROWS
    if deterministic:
        return 0
    # dense, as ops.linear runs it: the small-M GEMV up to its rows, then a VNNI copy up
    # to the rows it is worth, else torch's linear (oneDNN's copy is not reproduced here)
    w = lin.weight
    if w.dim() != 2 or not w.is_contiguous() or lin.in_features % 16:
        return 0
    if p is None:
        weights += [w.data, None, None]
        dims += [1, 0, cpu_ops.SMALL_M_BEST]
        return ops.QUANT_DOT_MAX_ROWS
    weights += [w.data, p.data if p.kind == "vnni" else None, None]
    dims += [1, 0, p.gemv_rows]
    return (p.max_rows or _ANY_ROWS) if p.kind == "vnni" else p.gemv_rows


def build_decode_stack(
    layers: Sequence[LlamaDecoderLayer], backend: object, device: torch.device
) -> DecodeStack | None:
    """The stack for these decoder layers, or None where the op cannot run them."""
    if os.environ.get("DIPTYCH_DECODE_STACK", "1") == "0" or device.type != "cpu":
        return None
    if not isinstance(backend, TorchAttention) or backend.kernels.selection.backend != "auto":
        return None
    if not cpu_ops.cpu_ops_available() or backend.head_dim % 16 or not len(layers):
        return None
    weights: list[torch.Tensor | None] = []
    dims: list[int] = []
    det = backend.deterministic
    eps = float(layers[0].input_layernorm.eps)
    rows: list[int] = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(attn, LlamaAttention) or attn.qk_norm or not isinstance(mlp, LlamaMLP):
            return None  # the op has no router, no latent attention
        if layer.input_layernorm.eps != eps or layer.post_attention_layernorm.eps != eps:
            return None
        weights.append(layer.input_layernorm.weight.data)
        weights.append(None if attn.qkv_proj.bias is None else attn.qkv_proj.bias.data)
        rows.append(_linear(attn.qkv_proj, weights, dims, det))
        rows.append(_linear(attn.o_proj, weights, dims, det))
        weights.append(layer.post_attention_layernorm.weight.data)
        rows.append(_linear(mlp.gate_up_proj, weights, dims, det))
        rows.append(_linear(mlp.down_proj, weights, dims, det))
    if min(rows) < 1:  # a linear the op cannot run (0), or a packed copy without a GEMV
        return None
    return DecodeStack(
        weights, dims, backend.num_heads, backend.num_kv_heads, backend.head_dim, eps,
        float(backend.scale), int(backend.sliding_window or 0), min(rows), det,
    )  # fmt: skip
