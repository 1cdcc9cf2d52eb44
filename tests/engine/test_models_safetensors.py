"""Tiny random checkpoints written by transformers (Llama, Qwen2, Qwen3, Mistral; tied and
untied; sharded; llama3 rope scaling; the mixtures of experts Qwen3-MoE and Mixtral)
load through our safetensors path and match transformers' logits and greedy tokens in
fp32."""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import EngineConfig, EngineCore, NewRequest, SamplingParams
from tests.conftest import REPORT
from tests.tiny_models import random_model

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {"tie_word_embeddings": False}),
    "llama-tied-llama3-rope": (
        "LlamaConfig",
        {
            "tie_word_embeddings": True,
            "rope_theta": 10000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
    "qwen2-bias": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3-qknorm": ("Qwen3Config", {"tie_word_embeddings": False, "head_dim": 32}),
    "mistral-window": ("MistralConfig", {"sliding_window": 24, "tie_word_embeddings": False}),
    # 8 experts of 32, the top 2 renormalized; layer 1 keeps a dense MLP of 128
    "qwen3-moe": (
        "Qwen3MoeConfig",
        {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "norm_topk_prob": True, "mlp_only_layers": [1], "tie_word_embeddings": False},
    ),
    # the top 3 of 6 as the router gave them (not renormalized), every layer sparse
    "qwen3-moe-unnormalized": (
        "Qwen3MoeConfig",
        {"num_experts": 6, "num_experts_per_tok": 3, "moe_intermediate_size": 48,
         "norm_topk_prob": False, "tie_word_embeddings": True},
    ),
    # 4 experts of intermediate_size, the top 2 (Mixtral renormalizes), w1/w2/w3 names
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # multi-head latent attention (a latent of 32 and a rotary key of 16, cached; the
    # query through a rank-48 bottleneck; rotary pairs interleaved), layer 0 dense, then
    # 8 experts in 4 groups behind the sigmoid router (the best 2 groups, the top 2
    # experts, a choice bias, scaled 2.5) beside a shared expert
    "deepseek-v3": (
        "DeepseekV3Config",
        {"kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16,
         "v_head_dim": 24, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4,
         "topk_group": 2, "n_shared_experts": 1, "moe_intermediate_size": 32,
         "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "num_hidden_layers": 3,
         "num_key_value_heads": 4},
    ),
    # the query straight from the hidden state, rotary halves split (not interleaved),
    # YaRN rope (4x a 64-token context: prompts run past it; its temperature on cos/sin
    # and on the softmax scale), one expert group, no renormalization
    "deepseek-v3-plain-q": (
        "DeepseekV3Config",
        {"kv_lora_rank": 48, "q_lora_rank": None, "qk_rope_head_dim": 32, "qk_nope_head_dim": 32,
         "v_head_dim": 32, "rope_interleave": False,
         "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 64, "mscale": 1.0,
                             "mscale_all_dim": 0.8}, "n_routed_experts": 4,
         "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "norm_topk_prob": False,
         "n_shared_experts": 2, "moe_intermediate_size": 16, "first_k_dense_replace": 0,
         "num_key_value_heads": 4},
    ),
}


def _write(tmp: Path, name: str, sharded: bool) -> Any:
    cls_name, extra = CASES[name]
    seed = zlib.crc32(name.encode()) % 1000
    model = random_model(cls_name, {**TINY, **extra}, seed, attn_implementation="sdpa")
    with torch.no_grad():
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):  # DeepSeek's router choice bias
                b.normal_(0.0, 0.1)
    path = tmp / name
    model.save_pretrained(path, max_shard_size="60KB" if sharded else "1GB")
    if sharded:
        assert (path / "model.safetensors.index.json").exists()
    return model.eval(), path


def _hf_greedy(model: Any, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    tokens, rows = [], []
    seq = list(ids)
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor([seq])).logits[0, -1].float()
            rows.append(logits)
            tokens.append(int(logits.argmax()))
            seq.append(tokens[-1])
    return tokens, torch.stack(rows)


@pytest.mark.parametrize("name", list(CASES))
def test_tiny_checkpoint_matches_transformers(name: str, tmp_path: Path) -> None:
    hf, path = _write(tmp_path, name, sharded=name == "llama")
    core = EngineCore(
        EngineConfig(model=str(path), dtype="float32", num_blocks=64, max_num_batched_tokens=40)
    )
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 17, 60, 100)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_logits=True)
    for i, p in enumerate(prompts):
        core.submit(NewRequest(str(i), p, params))
    outs: dict[str, list] = {str(i): [[], []] for i in range(len(prompts))}
    while core.has_unfinished_requests():
        for o in core.step():
            outs[o.request_id][0] += o.new_token_ids
            outs[o.request_id][1] += o.new_logits or []
    worst = 0.0
    for i, p in enumerate(prompts):
        ref_tokens, ref_logits = _hf_greedy(hf, p, 12)
        tokens, logits = outs[str(i)]
        assert tokens == ref_tokens, f"{name}: prompt {i} ({len(p)} tokens)"
        worst = max(worst, float((torch.stack(logits) - ref_logits).abs().max()))
    REPORT[f"max |logits - HF| fp32, tiny {name}"] = f"{worst:.2e}"
    assert worst < 1e-4, worst
    assert core.is_idle() and not core.check_invariants()


def test_mla_latent_cache_takes_the_one_byte_kv_formats(tmp_path: Path) -> None:
    """The latent rows quantized like any KV row (int8 / fp8 codes and an fp16 scale:
    kv_cache_dim + 2 bytes a row): a prompt's first token comes from the fresh
    latents, identical; the first decode reads the quantized cache, on the same input
    token, within a few percent of the logits' range."""
    _, path = _write(tmp_path, "deepseek-v3", sharded=False)
    logits = {}
    for dtype in ("auto", "int8", "fp8"):
        core = EngineCore(EngineConfig(model=str(path), dtype="float32", num_blocks=32,
                                       kv_cache_dtype=dtype))  # fmt: skip
        width = core.model_config.kv_cache_dim
        assert core.runner.layout.row_width == (width if dtype == "auto" else width + 2)
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, output_logits=True)
        core.submit(NewRequest("a", list(range(3, 50)), params))
        rows: list[torch.Tensor] = []
        while core.has_unfinished_requests():
            rows += [x for o in core.step() for x in (o.new_logits or [])]
        logits[dtype] = torch.stack(rows)
        assert core.is_idle() and not core.check_invariants()
    scale = float(logits["auto"].abs().max())
    for dtype in ("int8", "fp8"):
        assert torch.equal(logits[dtype][0], logits["auto"][0])
        assert torch.isfinite(logits[dtype]).all()
    # measured here: int8 1.7 %, fp8 3.9 % of the range; a wrong scale or row is ~100 %
    assert float((logits["int8"][1] - logits["auto"][1]).abs().max()) < 0.05 * scale
    assert float((logits["fp8"][1] - logits["auto"][1]).abs().max()) < 0.15 * scale


def test_mla_in_bf16_with_packed_weights(tmp_path: Path) -> None:
    """The serving default on a CPU with a bf16 path: every linear gets a packed copy
    (and may give up its plain weight); kv_b_proj is split for the absorbed attention
    at load and never packed, and generation runs."""
    _, path = _write(tmp_path, "deepseek-v3", sharded=False)
    for dtype in ("float32", "bfloat16"):
        core = EngineCore(EngineConfig(model=str(path), dtype=dtype, num_blocks=32))
        attn = core.runner.model.model.layers[0].self_attn
        assert attn.kv_b_proj.weight.numel() == 0 and attn.kv_b_proj.packed is None
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        core.submit(NewRequest("a", list(range(3, 40)), params))
        out: list[int] = []
        while core.has_unfinished_requests():
            out += [t for o in core.step() for t in o.new_token_ids]
        assert len(out) == 4 and core.is_idle() and not core.check_invariants()
