"""The `engine.weights` package API: one way in for both checkpoint formats.

Format details are tested in test_weights_dequant.py, test_weights_gguf.py and
test_weights_safetensors.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

import engine.weights as weights
from engine.weights import (
    GGUFCheckpoint,
    ModelSource,
    SafetensorsCheckpoint,
    iter_weights,
    load_model_config,
    open_checkpoint,
    resolve_model,
)


def test_public_names() -> None:
    for name in (
        "ModelSource",
        "resolve_model",
        "default_model_path",
        "load_model_config",
        "iter_weights",
    ):
        assert name in weights.__all__
        assert getattr(weights, name) is not None


def test_default_model_config_and_a_first_weight() -> None:
    source = resolve_model(None)
    assert source.kind == "gguf" and source.path == weights.default_model_path()
    ckpt = open_checkpoint(source)
    assert isinstance(ckpt, GGUFCheckpoint)
    assert ckpt.config.name == "SmolLM2-135M-Instruct"
    assert ckpt.config.num_params() == pytest.approx(134.5e6, rel=0.01)
    name, tensor = next(ckpt.iter_weights())
    assert name == "model.embed_tokens.weight"
    assert tensor.shape == (ckpt.config.vocab_size, ckpt.config.hidden_size)


def test_hf_directory_by_path_string(tmp_path: Path) -> None:
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(tmp_path)
    source = resolve_model(str(tmp_path))
    assert source == ModelSource("hf", tmp_path, tmp_path.name)
    assert isinstance(open_checkpoint(source), SafetensorsCheckpoint)
    assert load_model_config(str(tmp_path)).num_params() == sum(
        p.numel() for p in model.parameters()
    )
    loaded = dict(iter_weights(source))
    assert set(loaded) == set(model.state_dict())
    for name, t in loaded.items():
        assert torch.equal(t, model.state_dict()[name])


def test_missing_model_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not found"):
        load_model_config(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="not found"):
        iter_weights(str(tmp_path / "nope.gguf"))


def test_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"neither config\.json"):
        load_model_config(tmp_path)
