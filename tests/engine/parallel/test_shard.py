"""Tensor parallelism's split (engine/parallel/shard.py): the ranks' slices, computed as each
rank would and combined as the all-reduce and the gather would, give the whole
layer's output; the KV heads a rank holds are the ones its query heads read."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.config import ModelConfig, UnsupportedModelError
from engine.parallel.shard import TpShard, check_tp

HIDDEN, D, INTER, VOCAB = 64, 8, 96, 101  # a vocabulary no TP size divides


def config(heads: int = 8, kv: int = 4) -> ModelConfig:
    return ModelConfig(
        architecture="llama", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
        num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv, head_dim=D,
        rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=128,
        tie_word_embeddings=False,
    )  # fmt: skip


def weights(mc: ModelConfig) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    p = "model.layers.0."

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    return {
        p + "self_attn.q_proj.weight": w(mc.q_size, HIDDEN),
        p + "self_attn.k_proj.weight": w(mc.kv_size, HIDDEN),
        p + "self_attn.v_proj.weight": w(mc.kv_size, HIDDEN),
        p + "self_attn.o_proj.weight": w(HIDDEN, mc.q_size),
        p + "mlp.gate_proj.weight": w(INTER, HIDDEN),
        p + "mlp.up_proj.weight": w(INTER, HIDDEN),
        p + "mlp.down_proj.weight": w(HIDDEN, INTER),
        p + "input_layernorm.weight": w(HIDDEN),
        "model.embed_tokens.weight": w(VOCAB, HIDDEN),
        "lm_head.weight": w(VOCAB, HIDDEN),
    }


def attention(ws: dict[str, torch.Tensor], x: torch.Tensor, heads: int, kv: int) -> torch.Tensor:
    """Causal GQA self-attention of x [T, HIDDEN] and its o_proj: one rank's part
    (its heads, its o_proj columns) or the whole layer's."""
    p = "model.layers.0.self_attn."
    t = x.shape[0]
    q = (x @ ws[p + "q_proj.weight"].T).view(t, heads, D).transpose(0, 1)
    k = (x @ ws[p + "k_proj.weight"].T).view(t, kv, D).transpose(0, 1)
    v = (x @ ws[p + "v_proj.weight"].T).view(t, kv, D).transpose(0, 1)
    o = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True,
                                       enable_gqa=heads != kv)  # fmt: skip
    return o[0].transpose(0, 1).reshape(t, heads * D) @ ws[p + "o_proj.weight"].T


def mlp(ws: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    p = "model.layers.0.mlp."
    h = F.silu(x @ ws[p + "gate_proj.weight"].T) * (x @ ws[p + "up_proj.weight"].T)
    return h @ ws[p + "down_proj.weight"].T


@pytest.mark.parametrize(
    ("heads", "kv", "size"),
    [(8, 4, 1), (8, 4, 2), (8, 4, 4), (8, 2, 4), (8, 1, 8), (9, 3, 3), (8, 2, 8)],
)
def test_the_ranks_parts_sum_to_the_whole_layer(heads: int, kv: int, size: int) -> None:
    mc = config(heads, kv)
    ws = weights(mc)
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(1))
    attn = mlp_out = torch.zeros(5, HIDDEN)
    logits = []
    for rank in range(size):
        tp = TpShard(mc, rank, size)
        local = tp.local_config()
        mine = {n: tp.shard(n, t) for n, t in ws.items()}
        assert mine["model.layers.0.input_layernorm.weight"] is ws[
            "model.layers.0.input_layernorm.weight"]  # fmt: skip
        attn = attn + attention(mine, x, local.num_attention_heads, local.num_key_value_heads)
        mlp_out = mlp_out + mlp(mine, x)
        assert mine["lm_head.weight"].shape == (tp.vocab_rows, HIDDEN)
        logits.append(x @ mine["lm_head.weight"].T)
    torch.testing.assert_close(attn, attention(ws, x, heads, kv), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mlp_out, mlp(ws, x), rtol=1e-5, atol=1e-5)
    gathered = torch.cat(logits, dim=-1)
    assert gathered.shape[-1] >= VOCAB
    # the same dot products (a GEMM of other width may block them otherwise: low bits)
    whole = x @ ws["lm_head.weight"].T
    torch.testing.assert_close(gathered[:, :VOCAB], whole, rtol=1e-6, atol=1e-6)


def test_kv_heads_split_or_replicate() -> None:
    assert [TpShard(config(8, 4), r, 2).kv_heads for r in range(2)] == [(0, 1), (2, 3)]
    # two KV heads on four ranks: each held by two neighbours, as their query heads need
    assert [TpShard(config(8, 2), r, 4).kv_heads for r in range(4)] == [(0,), (0,), (1,), (1,)]
    assert TpShard(config(8, 4), 0, 1).kv_heads == (0, 1, 2, 3)


def test_the_vocabulary_padding_is_zero_rows() -> None:
    mc = config()
    last = TpShard(mc, 3, 4)
    emb = torch.ones(VOCAB, HIDDEN)
    rows = last.shard("model.embed_tokens.weight", emb)
    real = VOCAB - last.vocab_start
    assert rows.shape[0] == last.vocab_rows and bool(rows[:real].eq(1).all())
    assert bool(rows[real:].eq(0).all())


@pytest.mark.parametrize(
    ("heads", "kv", "inter", "size", "says"),
    [
        (8, 4, INTER, 3, "8 attention heads do not split evenly over 3 ranks"),
        (12, 4, INTER, 6, "4 KV heads neither split evenly over 6 ranks"),
        (8, 4, 100, 8, "intermediate size 100 does not split evenly over 8 ranks"),
    ],
)
def test_a_split_that_does_not_fit_is_refused_naming_why(
    heads: int, kv: int, inter: int, size: int, says: str
) -> None:
    mc = config(heads, kv)
    mc = ModelConfig(**{**mc.__dict__, "intermediate_size": inter})
    with pytest.raises(UnsupportedModelError, match=says):
        check_tp(mc, size)
    with pytest.raises(ValueError, match="rank 2 is not in"):
        TpShard(config(), 2, 2)
