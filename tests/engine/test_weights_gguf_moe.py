"""GGUF mixtures of experts, written here as llama.cpp's converter lays them out: a
tiny Qwen3-MoE (`qwen3moe`, q/k norms, a dense layer) and a tiny Mixtral (`llama` with
`expert_count`, Q/K rows permuted), each layer's router as `ffn_gate_inp` and its
experts stacked as `ffn_{gate,up,down}_exps`. The file reads back as the HF
checkpoint's per-expert tensors (exactly in F32, as gguf-py's Q8_0 decodes them
otherwise), and the engine on the file generates the greedy tokens of the engine on
the HF checkpoint, which tests/engine/test_models_safetensors.py holds to
transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from safetensors import safe_open

from engine import EngineConfig, EngineCore, NewRequest, SamplingParams
from engine.config import ModelConfig
from engine.weights import GGUFCheckpoint, SafetensorsCheckpoint
from engine.weights.dequant import dequantize
from tests.engine.test_weights_gguf import _encode, _gguf_name, _permute, finish_gguf
from tests.tiny_models import random_checkpoint

Q = GGMLQuantizationType
TINY: dict[str, Any] = dict(
    vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # (GGUF architecture, transformers config, its fields beyond TINY)
    "qwen3-moe": ("qwen3moe", "Qwen3MoeConfig", {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "norm_topk_prob": True, "mlp_only_layers": [1], "head_dim": 16,
    }),
    "mixtral": ("llama", "MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
}  # fmt: skip
_PROJ = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down",
         "w2": "down"}  # fmt: skip


def _hf_checkpoint(tmp: Path, name: str) -> Path:
    _, cls, extra = MODELS[name]
    return random_checkpoint(tmp / name, cls, {**TINY, **extra}, seed=7)[1]


def write_moe_gguf(path: Path, hf_dir: Path, arch: str, expert_type: GGMLQuantizationType) -> Path:
    """The checkpoint in `hf_dir` as a GGUF of `arch`: experts stacked per layer and
    projection (encoded as `expert_type`), everything else F32."""
    cfg = ModelConfig.from_hf_dict(SafetensorsCheckpoint(hf_dir).hf_config)
    with safe_open(str(hf_dir / "model.safetensors"), framework="pt") as f:
        state = {k: f.get_tensor(k).float().numpy() for k in f.keys()}  # noqa: SIM118
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch == "qwen3moe":
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    stacks: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, arr in state.items():
        parts = name.split(".")
        if ".experts." in name:  # model.layers.L.<mlp>.experts.E.<proj>.weight
            stacks.setdefault((int(parts[2]), _PROJ[parts[-2]]), {})[int(parts[-3])] = arr
            continue
        if name.endswith(".gate.weight"):  # the router
            w.add_tensor(f"blk.{parts[2]}.ffn_gate_inp.weight", arr)
            continue
        g = _gguf_name(name)
        if arch == "llama" and g.endswith("attn_q.weight"):
            arr = _permute(arr, cfg.num_attention_heads)
        elif arch == "llama" and g.endswith("attn_k.weight"):
            arr = _permute(arr, cfg.num_key_value_heads)
        w.add_tensor(g, arr)
    for (layer, proj), experts in stacks.items():
        stacked = np.stack([experts[e] for e in range(len(experts))])
        data, raw = _encode(stacked, expert_type)
        w.add_tensor(f"blk.{layer}.ffn_{proj}_exps.weight", data, raw_dtype=raw)
    return finish_gguf(w, path)


def _qwen_names(name: str) -> str:
    """A Mixtral checkpoint name as Qwen3-MoE's (what the GGUF reader yields for both;
    the model loads either)."""
    for old, new in ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."),
                     (".w3.", ".up_proj."), (".w2.", ".down_proj.")):  # fmt: skip
        name = name.replace(old, new)
    return name


def _greedy(model: Path) -> list[list[int]]:
    core = EngineCore(EngineConfig(model=str(model), dtype="float32", num_blocks=32,
                                   max_num_batched_tokens=24), eos_token_ids=())  # fmt: skip
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (1, 11, 40)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.submit(NewRequest(str(i), p, params))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while core.has_unfinished_requests():
        for o in core.step():
            out[o.request_id] += o.new_token_ids
    return [out[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("name", list(MODELS))
def test_a_gguf_mixture_of_experts_reads_as_its_checkpoint(name: str, tmp_path: Path) -> None:
    arch = MODELS[name][0]
    hf_dir = _hf_checkpoint(tmp_path, name)
    path = write_moe_gguf(tmp_path / f"{name}.gguf", hf_dir, arch, Q.F32)
    ckpt = GGUFCheckpoint(path)
    source = SafetensorsCheckpoint(hf_dir)
    ours = dict(ckpt.iter_weights())
    theirs = {_qwen_names(n): t for n, t in source.iter_weights()}
    assert set(ours) == set(theirs) - ({"lm_head.weight"} - set(ours))
    for n, t in ours.items():
        assert torch.equal(t, theirs[n].float()), n
    cfg, ref = ckpt.config, source.config
    assert cfg.architecture == ref.architecture
    for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "norm_topk_prob", "dense_layers", "qk_norm", "head_dim"):  # fmt: skip
        assert getattr(cfg, field) == getattr(ref, field), field
    assert _greedy(path) == _greedy(hf_dir)


def test_quantized_experts_are_dequantized_at_load(tmp_path: Path) -> None:
    hf_dir = _hf_checkpoint(tmp_path, "qwen3-moe")
    path = write_moe_gguf(tmp_path / "q8.gguf", hf_dir, "qwen3moe", Q.Q8_0)
    ckpt = GGUFCheckpoint(path)
    stored = {t.name: t for t in gguf.GGUFReader(path).tensors}
    ours = dict(ckpt.iter_weights_quantized())  # the experts stay dense either way
    raw = stored["blk.0.ffn_down_exps.weight"]
    want = torch.from_numpy(dequantize(np.array(raw.data), raw.tensor_type))
    for e in range(4):
        got = ours[f"model.layers.0.mlp.experts.{e}.down_proj.weight"]
        assert isinstance(got, torch.Tensor) and torch.equal(got, want[e])
    assert ckpt.tensor_types()["model.layers.0.mlp.experts.{e}.down_proj.weight"] == "Q8_0"
    EngineCore(EngineConfig(model=str(path), dtype="float32", num_blocks=16))  # it loads
