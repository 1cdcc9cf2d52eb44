"""Multi-head latent attention (DeepSeek-V2/V3), over a cache of latents.

Each token's K and V come from one latent c (`kv_lora_rank` values, after
`kv_a_layernorm`) and one rotary key k_r (`head_dim` = qk_rope_head_dim values) that
every head shares:

    k_h = [W_UK_h c, k_r]        v_h = W_UV_h c        (W_UK_h, W_UV_h: kv_b_proj's rows)

The cache keeps only [c, k_r] a token (one row of `kv_cache_dim` values, one plane),
and attention runs on it with the projections absorbed into the query and the output:

    q_h . k_h = (W_UK_h^T q_nope_h) . c + q_rope_h . k_r = [W_UK_h^T q_nope_h, q_rope_h] . [c, k_r]
    o_h = sum_j p_j W_UV_h c_j = W_UV_h (sum_j p_j c_j)

so it is multi-query attention of `num_heads` heads over one KV head of
`kv_cache_dim` values whose V is the cached row itself (its last `head_dim` values
come out and are dropped): the attention backends run it as they run any MQA, their
K and V views both the latent plane. The rotary dimensions of DeepSeek checkpoints
pair up as (0, 1), (2, 3), ... (`rope_interleave`): q_rope and k_r are
de-interleaved first, which rotates the same pairs with the half-split kernel (a dot
product does not change under the same permutation of both sides).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.config import ModelConfig
from kernels import ops

if TYPE_CHECKING:
    from engine.attention import AttentionBackend
    from engine.models.llama import StepInputs
    from engine.parallel.group import TpGroup


def mla_scale(cfg: ModelConfig) -> float:
    """The softmax scale: 1 / sqrt of a head's query-key width (nope and rotary), times
    YaRN's temperature squared where the rope is YaRN-scaled with `mscale_all_dim`
    (DeepSeek-V3's 128K context)."""
    from engine.models.llama import rope_kind, yarn_mscale

    scale = float((cfg.qk_nope_head_dim + cfg.head_dim) ** -0.5)
    rope = cfg.rope_scaling or {}
    if rope_kind(rope) == "yarn" and rope.get("mscale_all_dim"):
        m = yarn_mscale(float(rope.get("factor", 1.0)), float(rope["mscale_all_dim"]))
        scale *= m * m
    return scale


class MlaAttention(nn.Module):
    def __init__(
        self, cfg: ModelConfig, backend: AttentionBackend, tp: TpGroup | None = None
    ) -> None:
        """With `tp`, `cfg` is the rank's shape: its heads (the query, kv_b_proj and
        o_proj split by heads, the latent projection whole); the group sums o_proj's
        partial products."""
        from engine.models.llama import Linear, RMSNorm

        super().__init__()
        self.tp = tp
        h, heads = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads, self.rank, self.rope = heads, cfg.kv_lora_rank, cfg.head_dim
        self.nope, self.v_dim = cfg.qk_nope_head_dim, cfg.v_head_dim
        self.interleave = cfg.rope_interleave
        q_out = heads * (self.nope + self.rope)
        self.q_lora = cfg.q_lora_rank > 0
        if self.q_lora:
            self.q_a_proj = Linear(h, cfg.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = Linear(cfg.q_lora_rank, q_out, bias=False)
        else:
            self.q_proj = Linear(h, q_out, bias=False)
        self.kv_a_proj_with_mqa = Linear(h, self.rank + self.rope, bias=cfg.qkv_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, cfg.rms_norm_eps)
        self.kv_b_proj = Linear(self.rank, heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = Linear(heads * self.v_dim, h, bias=cfg.qkv_bias)
        self.attn = backend
        self._absorbed: tuple[torch.Tensor, torch.Tensor] | None = None

    def absorb(self) -> None:
        """Split kv_b_proj into W_UK^T [heads, rank, nope] and W_UV [heads, v, rank]
        (each head's weight of a linear, [out, in]: what the forward uses; dequantized
        where the weight was kept quantized) and drop it, so it is held once and never
        packed. Call after loading the weights."""
        p = self.kv_b_proj
        parts = [q.dequantize(p.weight.dtype) for q in p.quant]
        w = torch.cat(parts) if parts else p.weight.data
        w = w.view(self.num_heads, self.nope + self.v_dim, self.rank)
        w_uk_t = w[:, : self.nope].transpose(1, 2).contiguous()
        self._absorbed = (w_uk_t, w[:, self.nope :].contiguous())
        p.weight = nn.Parameter(p.weight.new_empty(0), requires_grad=False)
        p.quant = ()

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK^T, W_UV) as `absorb` made them."""
        if self._absorbed is None:
            raise RuntimeError("MlaAttention.absorb() runs once the weights are loaded")
        return self._absorbed

    def _rotary(self, x: torch.Tensor, step: StepInputs) -> torch.Tensor:
        if self.interleave:
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        else:
            x = x.contiguous()
        ops.rotary_(x, step.cos, step.sin)
        return x

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, step: StepInputs) -> torch.Tensor:
        t = x.shape[0]
        if self.q_lora:
            q = self.q_b_proj.forward(self.q_a_layernorm.norm(self.q_a_proj.forward(x)))
        else:
            q = self.q_proj.forward(x)
        q = q.view(t, self.num_heads, self.nope + self.rope)
        latent = self.kv_a_proj_with_mqa.forward(x)
        c = self.kv_a_layernorm.norm(latent[:, : self.rank])
        k_rope = self._rotary(latent[:, None, self.rank :], step)
        w_uk_t, w_uv = self.absorbed()
        q_latent = ops.head_linear(q[..., : self.nope], w_uk_t)
        query = torch.cat([q_latent, self._rotary(q[..., self.nope :], step)], dim=-1)
        row = torch.cat([c[:, None, :], k_rope], dim=-1)  # [t, 1, kv_cache_dim]
        plane = kv_cache[:, 0]
        meta = step.attn_meta
        self.attn.kernels.store_kv(row, row, plane, plane, meta.slots)
        layer = self.attn.paged(plane, plane)
        o = self.attn.attend_step(query.contiguous(), row, row, layer, meta)
        o_latent = o.view(t, self.num_heads, -1)[..., : self.rank]
        out = ops.head_linear(o_latent, w_uv).reshape(t, -1)
        result: torch.Tensor = self.o_proj.forward(out)
        return result if self.tp is None else self.tp.all_reduce(result)
