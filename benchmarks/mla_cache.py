#!/usr/bin/env python
"""Multi-head latent attention: KV cache bytes per token against the same model's
uncompressed K/V.

    python benchmarks/mla_cache.py [--docs]

Two models: DeepSeek-V3 (its published config, engine/sim/data/models.json) and a tiny
random DeepSeek-V3 built here with transformers. For each, the latent cache's bytes a
token (every layer's kv_lora_rank + qk_rope_head_dim values, one plane) against what
the model's K and V would take uncompressed (every head's qk_nope + qk_rope key and
v_head_dim value, as a model without latent caching, or an engine that expands the
latent before caching, would hold), and how many tokens a 1 GiB cache then holds. For
the tiny model the latent bytes are measured: the engine's own KV pool (`KvLayout`)
divided by the tokens it holds. bf16 for DeepSeek-V3, fp32 for the tiny model (the
dtype the tests run it in).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.docs_section import write_subsection  # noqa: E402
from engine.config import GiB, ModelConfig  # noqa: E402
from engine.sim.roofline import models  # noqa: E402

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48,
    qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24, n_routed_experts=8,
    num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
    moe_intermediate_size=32, first_k_dense_replace=1, max_position_embeddings=512,
)  # fmt: skip


def uncompressed_bytes(m: ModelConfig, element: int) -> int:
    """K and V of one token, every head and layer, expanded from the latent."""
    per_head = m.qk_nope_head_dim + m.head_dim + m.v_head_dim
    return m.num_hidden_layers * m.num_attention_heads * per_head * element


def row(name: str, m: ModelConfig, latent: float, element: int, dtype: str) -> dict[str, Any]:
    full = uncompressed_bytes(m, element)
    return {
        "model": name, "dtype": dtype, "latent": latent, "full": full, "ratio": latent / full,
        "tokens_latent": int(GiB // latent), "tokens_full": int(GiB // full),
        "layers": m.num_hidden_layers, "row": m.kv_cache_dim,
    }  # fmt: skip


def tiny_measured() -> dict[str, Any]:
    import torch
    import transformers

    from engine import EngineConfig, EngineCore

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(transformers.DeepseekV3Config(**TINY))
        model.save_pretrained(tmp)
        core = EngineCore(EngineConfig(model=tmp, dtype="float32", num_blocks=32))
        layout = core.runner.layout
        per_token = layout.total_bytes / (layout.num_blocks * layout.block_size)
        return row("tiny DeepSeek-V3 (measured pool)", core.model_config, per_token, 4, "fp32")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--docs", action="store_true", help="write docs/benchmarks.md's section")
    args = ap.parse_args()
    v3 = models()["DeepSeek-V3"]
    rows = [row("DeepSeek-V3", v3, v3.kv_bytes_per_token(2), 2, "bf16"), tiny_measured()]
    lines = [
        "| model | dtype | layers | latent row (values) | latent cache bytes / token | "
        "uncompressed K/V bytes / token | latent / uncompressed | tokens in 1 GiB, latent | "
        "tokens in 1 GiB, uncompressed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['dtype']} | {r['layers']} | {r['row']} | {r['latent']:,.0f} | "
            f"{r['full']:,} | {r['ratio'] * 100:.1f} % | {r['tokens_latent']:,} | "
            f"{r['tokens_full']:,} |"
        )
    gqa = models()["Llama-3.1-70B"]
    lines += [
        "",
        f"For scale, a GQA model: Llama-3.1-70B ({gqa.num_key_value_heads} KV heads of "
        f"{gqa.head_dim}, {gqa.num_hidden_layers} layers) caches "
        f"{gqa.kv_bytes_per_token(2):,.0f} bytes a token in bf16; DeepSeek-V3's latent "
        f"takes {rows[0]['latent'] / gqa.kv_bytes_per_token(2):.2f}x that for a model "
        "ten times larger.",
        "",
        "Reproduce: `python benchmarks/mla_cache.py --docs`. Latent: every layer's "
        "kv_lora_rank + qk_rope_head_dim values a token, cached once (one plane: the "
        "attention reads it as both K and V, engine/models/mla.py); uncompressed: every "
        "head's key (qk_nope + qk_rope) and value (v_head_dim), what an engine that "
        "expands the latent before caching holds. The tiny row is the engine's own pool "
        "(`KvLayout.total_bytes` over the tokens it holds), and what a disaggregated "
        "handoff moves a token: tests/e2e/test_moe_serve.py checks the bytes the decode "
        "worker receives are whole blocks of that layout.",
    ]
    body = "\n".join(lines)
    print(body)
    if args.docs:
        write_subsection("### MLA latent KV cache", body, section="## Engine")


if __name__ == "__main__":
    main()
