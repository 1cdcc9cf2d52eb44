"""GGUF loading: HF-named tensors and ModelConfig, checked three ways.

- the default SmolLM2-135M Q4_1 file against transformers' own GGUF loader;
- tiny GGUF files we write from random HF models (the way llama.cpp's converter
  does: Q/K rows permuted for llama) against transformers' loader of the same
  file, bit for bit, and against the HF model they came from, within the
  quantization error;
- metadata edge cases (rope scaling, sliding window, tied head) and errors.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType
from transformers import AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.config import ModelConfig, UnsupportedModelError
from engine.weights import iter_weights, load_model_config, resolve_model
from engine.weights.gguf import GGUFCheckpoint
from engine.weights.rope_freqs import llama3_scaling_from_divisors
from tests.kernels.test_quant_linear import random_blocks

Q = GGMLQuantizationType

# -- writing GGUF files the way llama.cpp's converter does ----------------------

_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    **{f"self_attn.{p}_proj.{k}": f"attn_{p}.{k}" for p in "qkv" for k in ("weight", "bias")},
}

# Fractions of a tensor's largest magnitude that bound the quantization error.
_TOLERANCE = {
    Q.F32: 0.0,
    Q.F16: 1e-3,
    Q.BF16: 1e-2,
    Q.Q8_0: 1e-2,
    Q.Q5_0: 7e-2,
    Q.Q5_1: 7e-2,
    Q.Q4_0: 0.15,
    Q.Q4_1: 0.15,
}


def _gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row order: per head, the two rotary halves interleaved."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


Encoder = Callable[[str, np.ndarray], tuple[np.ndarray, GGMLQuantizationType | None]]


def _encode(w: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, Any]:
    if qtype == Q.F32:
        return w, None
    if qtype == Q.F16:
        return w.astype(np.float16), None
    return gguf.quants.quantize(w, qtype), qtype


def tiny_model(arch: str, **overrides: Any) -> transformers.PreTrainedModel:
    """A random HF model with every parameter random (norms too, so a swap shows)."""
    kwargs: dict[str, Any] = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch == "qwen3":
        # transformers' GGUF reader ignores attention.key_length for qwen3 and uses
        # Qwen3Config's default head_dim (128), so only that head_dim round-trips.
        kwargs["head_dim"] = 128
    kwargs.update(overrides)
    config_cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[arch]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_cls(**kwargs))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model.eval()


def write_gguf(
    path: Path,
    model: transformers.PreTrainedModel,
    arch: str,
    encode: GGMLQuantizationType | Encoder = Q.F32,
    permute: bool = True,
    theta: float = 10000.0,
    extra: Callable[[gguf.GGUFWriter], None] | None = None,
) -> Path:
    """Write `model` as llama.cpp would: norms and biases F32, matrices through `encode`
    (a type for all of them, or a function of the HF name and the array)."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(path.stem)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(theta)
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    if extra is not None:
        extra(w)
    if isinstance(encode, GGMLQuantizationType):
        qtype = encode
        encoder: Encoder = lambda _name, arr: _encode(arr, qtype)  # noqa: E731
    else:
        encoder = encode

    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        g = _gguf_name(name)
        arr = t.float().numpy().copy()
        if permute and g.split(".")[-2] == "attn_q":
            arr = _permute(arr, cfg.num_attention_heads)
        elif permute and g.split(".")[-2] == "attn_k":
            arr = _permute(arr, cfg.num_key_value_heads)
        if arr.ndim == 1:
            w.add_tensor(g, arr)
        else:
            data, raw = encoder(name, arr)
            w.add_tensor(g, data, raw_dtype=raw)
    return finish_gguf(w, path)


def finish_gguf(w: gguf.GGUFWriter, path: Path) -> Path:
    """Write out what `w` was given (header, metadata, tensors) and close it."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def transformers_state_dict(path: Path) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    return model.state_dict()


def assert_same_tensors(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    """`ours` equals `theirs` bit for bit (theirs may carry a tied lm_head in addition)."""
    expected = set(theirs) - ({"lm_head.weight"} - set(ours))
    assert set(ours) == expected
    for name, t in ours.items():
        assert t.shape == theirs[name].shape, name
        assert torch.equal(t.float(), theirs[name]), name


# -- the default model against transformers -------------------------------------


@pytest.fixture(scope="module")
def default_ckpt() -> GGUFCheckpoint:
    source = resolve_model(None)
    return GGUFCheckpoint(source.path, source.name)


@pytest.fixture(scope="module")
def default_hf(
    request: pytest.FixtureRequest, default_ckpt: GGUFCheckpoint
) -> transformers.PreTrainedModel:
    """transformers' fp32 load of the same file; the suite's shared `hf_model` when the
    conftest provides it (it is the same load, and it takes ~15 s)."""
    try:
        model: transformers.PreTrainedModel = request.getfixturevalue("hf_model")
        return model
    except pytest.FixtureLookupError:
        path = default_ckpt.path
        return AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )


def test_default_gguf_tensors_equal_transformers(
    default_ckpt: GGUFCheckpoint, default_hf: transformers.PreTrainedModel
) -> None:
    ours = dict(default_ckpt.iter_weights())
    assert "lm_head.weight" not in ours  # tied to the embedding
    assert_same_tensors(ours, default_hf.state_dict())
    assert all(t.dtype == torch.float32 for t in ours.values())
    assert ours["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert ours["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert ours["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert set(default_ckpt.tensor_types().values()) == {"F32", "Q8_0", "Q4_1"}


def test_default_gguf_config_matches_transformers(
    default_ckpt: GGUFCheckpoint, default_hf: transformers.PreTrainedModel
) -> None:
    cfg, hf = default_ckpt.config, default_hf.config
    rope = getattr(hf, "rope_parameters", None) or {"rope_theta": hf.rope_theta}
    assert cfg.name == "SmolLM2-135M-Instruct"
    assert cfg.architecture == hf.model_type == "llama"
    assert cfg.vocab_size == hf.vocab_size == 49152
    assert cfg.hidden_size == hf.hidden_size
    assert cfg.intermediate_size == hf.intermediate_size
    assert cfg.num_hidden_layers == hf.num_hidden_layers
    assert cfg.num_attention_heads == hf.num_attention_heads
    assert cfg.num_key_value_heads == hf.num_key_value_heads
    assert cfg.head_dim == hf.head_dim == 64
    assert cfg.rms_norm_eps == pytest.approx(hf.rms_norm_eps, rel=1e-6)
    assert cfg.rms_norm_eps == 1e-5  # float32 metadata read back as the decimal written
    assert cfg.rope_theta == rope["rope_theta"] == 100000.0
    assert cfg.max_position_embeddings == hf.max_position_embeddings
    assert cfg.tie_word_embeddings is hf.tie_word_embeddings is True
    assert cfg.bos_token_id == hf.bos_token_id
    assert cfg.eos_token_ids == (hf.eos_token_id,)
    assert (cfg.qkv_bias, cfg.qk_norm, cfg.rope_scaling, cfg.sliding_window) == (
        False,
        False,
        None,
        None,
    )


# -- tiny files we write ----------------------------------------------------------

_CASES = [
    ("llama", Q.F32),
    ("llama", Q.F16),
    ("llama", Q.BF16),
    ("llama", Q.Q8_0),
    ("llama", Q.Q4_0),
    ("llama", Q.Q4_1),
    ("llama", Q.Q5_0),
    ("llama", Q.Q5_1),
    ("qwen2", Q.F32),
    ("qwen2", Q.Q8_0),
    ("qwen2", Q.Q4_1),
    ("qwen3", Q.F16),
    ("qwen3", Q.Q4_0),
    ("qwen3", Q.Q8_0),
]


# F16/BF16 tensors keep their dtype; quantized ones come as float32.
_STORED_DTYPE = {Q.F16: torch.float16, Q.BF16: torch.bfloat16}


def _expected_config(model: transformers.PreTrainedModel, name: str) -> ModelConfig:
    return ModelConfig.from_hf_dict(model.config.to_dict(), name=name)


@pytest.mark.parametrize(("arch", "qtype"), _CASES, ids=[f"{a}-{q.name}" for a, q in _CASES])
def test_tiny_gguf_equals_transformers_and_source(
    tmp_path: Path, arch: str, qtype: GGMLQuantizationType
) -> None:
    # llama: untied head; qwen2: tied head and q/k/v biases; qwen3: q/k norms.
    model = tiny_model(arch, tie_word_embeddings=arch == "qwen2")
    path = write_gguf(tmp_path / f"tiny-{arch}.gguf", model, arch, qtype, permute=arch == "llama")
    ckpt = GGUFCheckpoint(path)
    ours = dict(ckpt.iter_weights())

    assert ckpt.config == _expected_config(model, "tiny-" + arch)
    assert_same_tensors(ours, transformers_state_dict(path))

    source = model.state_dict()
    for name, t in ours.items():
        src = source[name]
        assert t.dtype == (
            _STORED_DTYPE.get(qtype, torch.float32) if t.ndim == 2 else torch.float32
        )
        tol = _TOLERANCE[qtype] * src.abs().max().item() if t.ndim == 2 else 0.0
        torch.testing.assert_close(t.float(), src, rtol=0, atol=tol, msg=name)


def test_llama_q_k_rows_in_the_file_are_permuted_and_we_undo_it(tmp_path: Path) -> None:
    model = tiny_model("llama")
    path = write_gguf(tmp_path / "p.gguf", model, "llama")
    stored = {t.name: np.array(t.data) for t in gguf.GGUFReader(path).tensors}
    ours = dict(GGUFCheckpoint(path).iter_weights())
    for hf_name, gguf_name, n_head in [
        ("model.layers.1.self_attn.q_proj.weight", "blk.1.attn_q.weight", 4),
        ("model.layers.1.self_attn.k_proj.weight", "blk.1.attn_k.weight", 2),
    ]:
        w = ours[hf_name].numpy()
        assert not np.array_equal(stored[gguf_name], w)  # the test above is not vacuous
        np.testing.assert_array_equal(stored[gguf_name], _permute(w, n_head))
        np.testing.assert_array_equal(w, model.state_dict()[hf_name].numpy())


def test_k_quants_in_a_file_equal_transformers(tmp_path: Path) -> None:
    # gguf-py cannot quantize K types: matrices get random valid K blocks, in turn.
    model = tiny_model("llama", hidden_size=256, intermediate_size=512)
    k_types = itertools.cycle([Q.Q4_K, Q.Q5_K, Q.Q6_K])
    seeds = itertools.count()

    def encode(name: str, w: np.ndarray) -> tuple[np.ndarray, Any]:
        qtype = next(k_types)
        return random_blocks(w.shape[0], w.shape[1], qtype, next(seeds)), qtype

    path = write_gguf(tmp_path / "k.gguf", model, "llama", encode)
    ckpt = GGUFCheckpoint(path)
    assert {"Q4_K", "Q5_K", "Q6_K"} <= set(ckpt.tensor_types().values())
    assert_same_tensors(dict(ckpt.iter_weights()), transformers_state_dict(path))


def test_mistral_arch_is_unpermuted_like_llama(tmp_path: Path) -> None:
    # transformers cannot load a "mistral" GGUF (gguf-py has no such arch), so compare
    # with the source weights: F32 makes that exact.
    model = tiny_model("mistral", sliding_window=32)
    path = write_gguf(
        tmp_path / "m.gguf", model, "mistral", extra=lambda w: w.add_sliding_window(32)
    )
    ckpt = GGUFCheckpoint(path)
    assert ckpt.config.architecture == "mistral"
    assert ckpt.config.sliding_window == 32
    assert ckpt.config == _expected_config(model, "m")
    source = model.state_dict()
    ours = dict(ckpt.iter_weights())
    assert set(ours) == set(source)
    for name, t in ours.items():
        assert torch.equal(t, source[name]), name


def test_eot_and_eom_are_end_tokens_too(tmp_path: Path) -> None:
    def extra(w: gguf.GGUFWriter) -> None:
        w.add_eot_token_id(7)
        w.add_eom_token_id(2)  # same as eos: listed once

    path = write_gguf(tmp_path / "e.gguf", tiny_model("llama"), "llama", extra=extra)
    assert GGUFCheckpoint(path).config.eos_token_ids == (2, 7)


# -- rope scaling ------------------------------------------------------------------


def _hf_inv_freq(rope: dict[str, Any], head_dim: int, theta: float) -> torch.Tensor:
    cfg = transformers.LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=131072,
        rope_parameters={**rope, "rope_theta": theta},
    )
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    return inv_freq


def _plain_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)


LLAMA31 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def test_llama3_rope_freqs_tensor_becomes_hf_rope_scaling(tmp_path: Path) -> None:
    # llama.cpp stores Llama 3.1 scaling as rope_freqs = plain / scaled inverse freqs.
    head_dim, theta = 64, 500000.0
    divisors = _plain_inv_freq(head_dim, theta) / _hf_inv_freq(LLAMA31, head_dim, theta)
    model = tiny_model("llama", hidden_size=256, head_dim=head_dim, max_position_embeddings=131072)
    path = write_gguf(
        tmp_path / "l31.gguf",
        model,
        "llama",
        theta=theta,
        extra=lambda w: w.add_tensor("rope_freqs.weight", divisors.numpy()),
    )
    ckpt = GGUFCheckpoint(path)
    assert ckpt.config.rope_scaling == LLAMA31
    assert ckpt.config.rope_theta == theta
    assert ckpt.config.max_position_embeddings == 131072
    assert "rope_freqs.weight" not in dict(ckpt.iter_weights())


def test_llama3_rope_with_unusual_parameters_keeps_the_frequencies() -> None:
    head_dim, theta = 64, 500000.0
    rope = dict(
        LLAMA31,
        factor=16.0,
        low_freq_factor=2.0,
        high_freq_factor=6.0,
        original_max_position_embeddings=4096,
    )
    target = _hf_inv_freq(rope, head_dim, theta)
    divisors = (_plain_inv_freq(head_dim, theta) / target).numpy()
    # Without the original context the parameters are not unique, the frequencies are.
    guessed = llama3_scaling_from_divisors(divisors, head_dim, theta)
    assert guessed is not None and guessed["factor"] == 16.0
    torch.testing.assert_close(_hf_inv_freq(guessed, head_dim, theta), target, rtol=1e-6, atol=0)
    assert llama3_scaling_from_divisors(divisors, head_dim, theta, 4096) == rope
    assert llama3_scaling_from_divisors(np.ones(32), head_dim, theta) is None


def test_rope_freqs_that_are_not_llama3_are_refused() -> None:
    with pytest.raises(UnsupportedModelError, match="Llama 3"):
        llama3_scaling_from_divisors(np.linspace(1, 4, 32), 64, 500000.0)


def test_linear_rope_scaling_metadata(tmp_path: Path) -> None:
    def extra(w: gguf.GGUFWriter) -> None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(4.0)

    path = write_gguf(tmp_path / "lin.gguf", tiny_model("llama"), "llama", extra=extra)
    assert GGUFCheckpoint(path).config.rope_scaling == {"rope_type": "linear", "factor": 4.0}


def test_yarn_rope_scaling_is_refused(tmp_path: Path) -> None:
    def extra(w: gguf.GGUFWriter) -> None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)

    path = write_gguf(tmp_path / "yarn.gguf", tiny_model("qwen2"), "qwen2", extra=extra)
    with pytest.raises(UnsupportedModelError, match="yarn"):
        GGUFCheckpoint(path)


# -- errors ------------------------------------------------------------------------


def _minimal_gguf(
    path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, Any]], meta: dict[str, int]
) -> Path:
    """A GGUF with just the given uint32 metadata ("{arch}" expanded) and tensors."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in meta.items():
        w.add_uint32(key.format(arch=arch), value)
    for name, (data, raw) in tensors.items():
        w.add_tensor(name, data, raw_dtype=raw)
    return finish_gguf(w, path)


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    tensors = {"x": (np.zeros(4, np.float32), None)}
    path = _minimal_gguf(tmp_path / "g.gguf", "gemma2", tensors, {})
    with pytest.raises(UnsupportedModelError, match="'gemma2'"):
        load_model_config(path)


def test_split_gguf_is_refused(tmp_path: Path) -> None:
    tensors = {"token_embd.weight": (np.zeros((8, 4), np.float32), None)}
    path = _minimal_gguf(tmp_path / "s.gguf", "llama", tensors, {"split.count": 3})
    with pytest.raises(UnsupportedModelError, match="one of 3 split GGUF files"):
        load_model_config(path)


def test_experts_in_separate_tensors_are_refused(tmp_path: Path) -> None:
    """An expert_count without stacked `_exps` tensors: an old conversion (stacked
    experts read: tests/engine/test_weights_gguf_moe.py)."""
    path = write_gguf(
        tmp_path / "moe.gguf",
        tiny_model("llama"),
        "llama",
        extra=lambda w: w.add_expert_count(8),
    )
    with pytest.raises(UnsupportedModelError, match="mixture-of-experts llama model with its"):
        GGUFCheckpoint(path)


def test_unsupported_tensor_type_names_type_and_tensor(tmp_path: Path) -> None:
    def encode(name: str, w: np.ndarray) -> tuple[np.ndarray, Any]:
        if name == "model.layers.1.mlp.gate_proj.weight":
            return random_blocks(w.shape[0], w.shape[1], Q.Q2_K, 0), Q.Q2_K
        return w, None

    model = tiny_model("llama", hidden_size=256)
    path = write_gguf(tmp_path / "q2k.gguf", model, "llama", encode)
    with pytest.raises(UnsupportedModelError, match=r"blk\.1\.ffn_gate\.weight.*Q2_K"):
        iter_weights(path)


def test_unknown_tensor_is_refused(tmp_path: Path) -> None:
    path = write_gguf(
        tmp_path / "x.gguf",
        tiny_model("llama"),
        "llama",
        extra=lambda w: w.add_tensor("blk.0.attn_sinks.weight", np.zeros(4, np.float32)),
    )
    with pytest.raises(UnsupportedModelError, match="attn_sinks"):
        GGUFCheckpoint(path)


def test_missing_and_corrupt_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        GGUFCheckpoint(tmp_path / "absent.gguf")
    with pytest.raises(FileNotFoundError, match=r"absent\.gguf"):
        load_model_config(tmp_path / "absent.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(UnsupportedModelError, match="not a readable GGUF"):
        load_model_config(bad)


def test_missing_metadata_is_named(tmp_path: Path) -> None:
    tensors = {
        "token_embd.weight": (np.zeros((8, 4), np.float32), None),
        "blk.0.attn_q.weight": (np.zeros((4, 4), np.float32), None),
    }
    path = _minimal_gguf(
        tmp_path / "meta.gguf",
        "llama",
        tensors,
        {"{arch}.embedding_length": 4, "{arch}.block_count": 1, "{arch}.attention.head_count": 1},
    )
    with pytest.raises(UnsupportedModelError, match="feed_forward_length"):
        load_model_config(path)
