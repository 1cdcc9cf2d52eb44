"""HF safetensors directories: exactly the saved tensors, and the right ModelConfig."""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from engine.config import UnsupportedModelError
from engine.weights import SafetensorsCheckpoint, iter_weights, load_model_config


def save_tiny(
    directory: Path, arch: str, dtype: torch.dtype = torch.float32, **overrides: Any
) -> dict[str, torch.Tensor]:
    """Save a random tiny model with `save_pretrained`; return the tensors as saved."""
    kwargs: dict[str, Any] = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=0,
        eos_token_id=[1, 3],
    )
    max_shard = overrides.pop("max_shard_size", None)
    kwargs.update(overrides)
    config_cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "mixtral": transformers.MixtralConfig,
    }[arch]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_cls(**kwargs)).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    model.save_pretrained(directory, **({"max_shard_size": max_shard} if max_shard else {}))
    (directory / "params").write_text(str(sum(p.numel() for p in model.parameters())))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


def assert_loads_exactly(directory: Path, saved: dict[str, torch.Tensor]) -> None:
    ours = dict(SafetensorsCheckpoint(directory).iter_weights())
    assert set(ours) == set(saved)
    for name, t in ours.items():
        assert t.dtype == saved[name].dtype, name
        assert torch.equal(t, saved[name]), name


def test_llama(tmp_path: Path) -> None:
    saved = save_tiny(tmp_path, "llama", rope_theta=500000.0, tie_word_embeddings=False)
    assert "lm_head.weight" in saved
    assert_loads_exactly(tmp_path, saved)
    cfg = load_model_config(tmp_path)
    assert (cfg.architecture, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (
        "llama",
        128,
        64,
        96,
    )
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (2, 4, 2)
    assert cfg.head_dim == 16
    assert cfg.rope_theta == 500000.0
    assert cfg.max_position_embeddings == 1024
    assert not cfg.tie_word_embeddings and not cfg.qkv_bias and not cfg.qk_norm
    assert cfg.bos_token_id == 0 and cfg.eos_token_ids == (1, 3)
    assert cfg.name == tmp_path.name


def test_qwen2_tied_with_biases_in_bf16(tmp_path: Path) -> None:
    saved = save_tiny(tmp_path, "qwen2", torch.bfloat16, tie_word_embeddings=True)
    assert "lm_head.weight" not in saved
    assert "model.layers.1.self_attn.k_proj.bias" in saved
    assert_loads_exactly(tmp_path, saved)  # dtype kept: bf16
    cfg = load_model_config(tmp_path)
    assert cfg.architecture == "qwen2"
    assert cfg.tie_word_embeddings and cfg.qkv_bias and not cfg.qk_norm
    assert cfg.sliding_window is None


def test_qwen3_with_qk_norm_and_own_head_dim(tmp_path: Path) -> None:
    saved = save_tiny(tmp_path, "qwen3", head_dim=32, tie_word_embeddings=False)
    assert saved["model.layers.0.self_attn.q_norm.weight"].shape == (32,)
    assert_loads_exactly(tmp_path, saved)
    cfg = load_model_config(tmp_path)
    assert cfg.architecture == "qwen3"
    assert cfg.head_dim == 32 and cfg.q_size == 128 and cfg.kv_size == 64
    assert cfg.qk_norm and not cfg.qkv_bias


def test_sharded_checkpoint(tmp_path: Path) -> None:
    saved = save_tiny(tmp_path, "llama", max_shard_size="40KB", tie_word_embeddings=False)
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 2
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert not (tmp_path / "model.safetensors").exists()
    ckpt = SafetensorsCheckpoint(tmp_path)
    assert sorted(ckpt.files) == shards
    assert_loads_exactly(tmp_path, saved)


def test_weights_are_yielded_lazily(tmp_path: Path) -> None:
    save_tiny(tmp_path, "llama", max_shard_size="40KB")
    it = iter_weights(tmp_path)
    assert isinstance(it, types.GeneratorType)
    name, tensor = next(it)
    assert isinstance(name, str) and isinstance(tensor, torch.Tensor)


def test_rotary_buffers_are_skipped(tmp_path: Path) -> None:
    saved = save_tiny(tmp_path, "llama")
    extra = {**saved, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}
    save_file(extra, str(tmp_path / "model.safetensors"))
    assert_loads_exactly(tmp_path, saved)


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        SafetensorsCheckpoint(tmp_path)


def test_missing_weights(tmp_path: Path) -> None:
    save_tiny(tmp_path, "llama")
    (tmp_path / "model.safetensors").rename(tmp_path / "weights.bin")
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        SafetensorsCheckpoint(tmp_path)


def test_missing_shard_is_named(tmp_path: Path) -> None:
    save_tiny(tmp_path, "llama", max_shard_size="40KB")
    victim = sorted(tmp_path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=victim.name):
        SafetensorsCheckpoint(tmp_path)


def test_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GemmaForCausalLM"], "model_type": "gemma"})
    )
    save_file({"x": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match="GemmaForCausalLM"):
        load_model_config(tmp_path)


def test_qwen3_moe_config_sparse_and_dense_layers(tmp_path: Path) -> None:
    save_tiny(
        tmp_path, "qwen3_moe", num_hidden_layers=6, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=2,
        mlp_only_layers=[3], tie_word_embeddings=False,
    )  # fmt: skip
    cfg = load_model_config(tmp_path)
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok) == ("qwen3_moe", 8, 2)
    assert cfg.moe_intermediate_size == 32 and cfg.norm_topk_prob and cfg.qk_norm
    # every second layer is sparse (1, 3, 5), and 3 is asked to stay dense
    assert cfg.dense_layers == (0, 2, 3, 4)
    assert [cfg.sparse_layer(n) for n in range(6)] == [False, True, False, False, False, True]
    assert cfg.num_params() == int((tmp_path / "params").read_text())


def test_mixtral_config(tmp_path: Path) -> None:
    save_tiny(tmp_path, "mixtral", num_local_experts=4, num_experts_per_tok=2)
    cfg = load_model_config(tmp_path)
    assert (cfg.architecture, cfg.num_experts, cfg.num_experts_per_tok) == ("mixtral", 4, 2)
    # Mixtral's experts are intermediate_size wide; it always renormalizes the top k
    assert cfg.moe_intermediate_size == 96 and cfg.norm_topk_prob and cfg.dense_layers == ()
    assert cfg.num_params() == int((tmp_path / "params").read_text())


def test_a_moe_model_refuses_what_does_not_fit_its_experts(tmp_path: Path) -> None:
    import dataclasses

    from engine import EngineConfig, EngineCore
    from engine.parallel.shard import check_tp

    save_tiny(tmp_path, "mixtral", num_local_experts=4, num_experts_per_tok=2)
    cfg = load_model_config(tmp_path)
    check_tp(cfg, 4)  # every expert's 96 split four ways
    with pytest.raises(UnsupportedModelError, match="experts' intermediate size 30 does not"):
        check_tp(dataclasses.replace(cfg, moe_intermediate_size=30), 4)
    # weights quantized at load leave the experts dense (the grouped GEMM runs them)
    core = EngineCore(EngineConfig(model=str(tmp_path), dtype="float32", num_blocks=16,
                                   quantization="int8"))  # fmt: skip
    layer = core.runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj.quant[0].source == "int8"
    assert layer.mlp.w13.dtype == torch.float32 and layer.mlp.w13.numel() > 0


def test_expert_load_imbalance_is_measured_each_step(tmp_path: Path) -> None:
    """The routing imbalance a step exports (worker metrics): the busiest expert's
    tokens over an even share, per sparse layer, and the same over expert-parallel
    ranks' shares; a step's counts start from zero."""
    from engine import EngineConfig, EngineCore, NewRequest, SamplingParams
    from engine.models.moe import SparseMoE, expert_load

    save_tiny(tmp_path, "mixtral", num_local_experts=4, num_experts_per_tok=2)
    core = EngineCore(EngineConfig(model=str(tmp_path), dtype="float32", num_blocks=16))
    core.submit(NewRequest("a", list(range(2, 40)), SamplingParams(max_tokens=3, ignore_eos=True)))
    while core.has_unfinished_requests():
        core.step()
    stats = core.snapshot().expert_load
    assert stats is not None and stats.steps == 3  # a prefill and two decodes
    # a decode token picks 2 of 4 experts: the busiest has 1 token, an even share is 0.5
    assert stats.last == pytest.approx(2.0) and stats.last_rank == pytest.approx(1.0)
    model = core.runner.model
    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    for m in layers:
        m.step_load = torch.tensor([6, 2, 0, 0])  # 8 routed, 2 an expert if even
    assert expert_load(model, ranks=2) == pytest.approx((3.0, 8 / 4))
    assert all(m.step_load is None for m in layers) and expert_load(model) is None
