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
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine.attention import AttentionBackend
from engine.config import ModelConfig
from engine.models.layers import Linear, RMSNorm, RotaryEmbedding
from kernels import cpu_ops, ops
from kernels.quant import QuantTensor

if TYPE_CHECKING:
    from engine.models.decode_stack import DecodeStack


@dataclass
class StepInputs:
    """Per-step inputs shared by every layer."""

    attn_meta: Any
    cos: torch.Tensor
    sin: torch.Tensor


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
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
        return self.o_proj.forward(o)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(ops.silu_and_mul(self.gate_up_proj.forward(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, backend)
        self.mlp = LlamaMLP(cfg)
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
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        # its weight given, not drawn: a random init on the meta device runs torch's
        # Python decompositions, whose import (torch._dynamo) cost 3 s of every start
        shape = (cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, backend) for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    # the embedding kept quantized (a tied head's weight): rows dequantized per lookup
    embed_quant: QuantTensor | None = None
    # the layer loop of a decode step in one C++ call, where the model can take it
    # (engine/models/decode_stack.py; set by the model runner after loading)
    decode_stack: DecodeStack | None = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_quant is None:
            out: torch.Tensor = self.embed_tokens(input_ids)
            return out
        return self.embed_quant.dequantize_rows(input_ids, self.norm.weight.dtype)

    def forward(
        self, input_ids: torch.Tensor, kv_caches: list[torch.Tensor], step: StepInputs
    ) -> torch.Tensor:
        x = self.embed(input_ids)
        stack = self.decode_stack
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
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, backend)
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
            self.lm_head = Linear(
                cfg.hidden_size, cfg.vocab_size, bias=False, device=device, dtype=dtype
            )

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
        tie by token id, which can turn a near-tie the wrong way."""
        if self.lm_head is not None:
            return self.lm_head.run(hidden, fp32_out=True)
        if self.model.embed_quant is not None:
            return ops.quant_linear(hidden, self.model.embed_quant, None, fp32_out=True)
        w = self.model.embed_tokens.weight
        return ops.linear(hidden, w, None, self.packed_head, fp32_out=True)

    packed_head: cpu_ops.PackedWeight | None = None  # the tied head, packed

    def prepack_weights(self) -> tuple[int, int]:
        """Give every linear (and a tied head) a packed copy of its weight for batches
        above the GEMV's few rows (`kernels.cpu_ops.pack_linear_weight`). A linear whose
        packed layout serves every row count (`PackedWeight.serves_all_rows`) gives up
        its plain weight. Returns (bytes added, bytes released). Call after the
        weights are final: the copies do not follow."""
        added = released = 0
        for mod in self.modules():
            if isinstance(mod, Linear) and not mod.quant:
                head = mod is self.lm_head  # its logits stay fp32 sums
                mod.packed = cpu_ops.pack_linear_weight(mod.weight, fp32_sums=head)
                added += mod.packed.data.nbytes
                if mod.packed.serves_all_rows:
                    released += mod.weight.nbytes
                    mod.weight = nn.Parameter(mod.weight.new_empty(0), requires_grad=False)
        if self.lm_head is None and self.model.embed_quant is None:
            # the embedding's rows are still looked up
            self.packed_head = cpu_ops.pack_linear_weight(
                self.model.embed_tokens.weight, fp32_sums=True
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
            target, shard = name, None
            for frag, (fused, idx) in _FUSED.items():
                if frag in name:
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
        else:
            sizes = [cfg.intermediate_size, cfg.intermediate_size]
        start = sum(sizes[:idx])
        return param.narrow(0, start, sizes[idx])

    def _check_complete(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        missing = []
        for name in params:
            if ".qkv_proj." in name:
                need = [f"{name}#{i}" for i in range(3)]
            elif ".gate_up_proj." in name:
                need = [f"{name}#{i}" for i in range(2)]
            else:
                need = [name]
            missing += [n for n in need if n not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != model {tuple(dst.shape)}")
    dst.copy_(src)
