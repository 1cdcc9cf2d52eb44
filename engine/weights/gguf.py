"""GGUF checkpoints: metadata to `ModelConfig`, tensors to HF names and layout.

The file is memory-mapped (`engine/weights/gguf_file.py`: its metadata in
milliseconds); tensors are decoded one at a time as `iter_weights` is consumed. Names
and layouts follow the HF checkpoint of the same model, so the model code has one
loading path:

    token_embd.weight        -> model.embed_tokens.weight
    blk.{i}.attn_q.weight    -> model.layers.{i}.self_attn.q_proj.weight   ([out, in])
    ...                         (see `_LAYER_NAMES`)
    output.weight            -> lm_head.weight   (absent when tied to the embedding)

A mixture of experts (Qwen3-MoE as `qwen3moe`, Mixtral as `llama` with an
`expert_count`) stores each layer's router as `ffn_gate_inp` and its experts stacked,
`ffn_{gate,up,down}_exps` [E, rows, columns]; they come out as the HF checkpoint's
per-expert tensors (`mlp.experts.{e}.gate_proj.weight`, ...), dequantized.

llama.cpp's converter permutes the rows of Q and K of llama-arch models so that
each head's rotary pairs are adjacent (interleaved rope); per head the HF rows
[x0 .. x(d/2-1), y0 .. y(d/2-1)] become [x0, y0, x1, y1, ...]. We undo it here
(with n_head rows groups for Q, n_kv_head for K). Qwen2/Qwen3 are stored unpermuted.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType

from engine.config import ModelConfig, UnsupportedModelError
from engine.weights.dequant import check_supported, dequantize
from engine.weights.gguf_file import GGUFFile, GGUFTensor
from engine.weights.gguf_quant import KEPT_TYPES, from_gguf
from engine.weights.rope_freqs import llama3_scaling_from_divisors
from kernels.quant import QuantTensor

GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen3moe")
# Architectures whose Q/K rows llama.cpp permuted for interleaved rotary.
_PERMUTED_ARCHS = ("llama", "mistral")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
}
# a mixture of experts' stacked experts -> each expert's projection
_EXPERT_NAMES = {
    "ffn_gate_exps.weight": "gate_proj",
    "ffn_up_exps.weight": "up_proj",
    "ffn_down_exps.weight": "down_proj",
}
# Not parameters: rope_freqs is folded into `ModelConfig.rope_scaling`.
_CONFIG_ONLY = ("rope_freqs.weight",)
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


class GGUFCheckpoint:
    """An open GGUF file: its `ModelConfig` and a lazy iterator over its weights."""

    def __init__(self, path: str | Path, name: str = "") -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file {self.path} does not exist")
        try:
            self._reader = GGUFFile(self.path)
        except (ValueError, OSError, struct.error) as e:
            raise UnsupportedModelError(f"{self.path} is not a readable GGUF file: {e}") from e
        self._tensors = {t.name: t for t in self._reader.tensors}
        self.architecture = str(self._required("general.architecture"))
        self._check_architecture()
        self.config = self._build_config(name or self.path.stem)
        self._plan = self._build_plan()

    # -- metadata ---------------------------------------------------------------

    def metadata(self, key: str, default: Any = None) -> Any:
        """The value of metadata `key` ("{arch}." expanded), or `default`."""
        if "{arch}" in key:
            key = key.replace("{arch}", self.architecture)
        return self._reader.field(key, default)

    def _required(self, key: str) -> Any:
        value = self.metadata(key)
        if value is None:
            raise UnsupportedModelError(f"{self.path} lacks the metadata key {key!r}")
        return value

    def _check_architecture(self) -> None:
        splits = self.metadata("split.count") or 1
        if splits > 1:
            raise UnsupportedModelError(
                f"{self.path} is one of {splits} split GGUF files; merge them first "
                "(llama-gguf-split --merge)"
            )
        arch = self.architecture
        if arch not in GGUF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"GGUF architecture {arch!r} is not supported; "
                f"supported: {', '.join(GGUF_ARCHITECTURES)}"
            )
        experts = self.metadata("{arch}.expert_count") or 0
        if experts and not any(n.endswith("_exps.weight") for n in self._tensors):
            raise UnsupportedModelError(
                f"{self.path} is a mixture-of-experts {arch} model with its experts in "
                "separate tensors (an old conversion); convert it again with llama.cpp"
            )

    def _uniform(self, key: str) -> int:
        """An integer that some converters store per layer; ours must be the same everywhere."""
        value = self._required(key)
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise UnsupportedModelError(f"{key} varies across layers ({value}); unsupported")
            value = value[0]
        return int(value)

    def _optional_int(self, key: str) -> int | None:
        value = self.metadata(key)
        return None if value is None else int(value)

    def _tensor(self, name: str) -> GGUFTensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise UnsupportedModelError(f"{self.path} has no tensor {name!r}") from None

    def _build_config(self, name: str) -> ModelConfig:
        n_head = self._uniform("{arch}.attention.head_count")
        n_kv_head = (
            self._uniform("{arch}.attention.head_count_kv")
            if self.metadata("{arch}.attention.head_count_kv") is not None
            else n_head
        )
        hidden = int(self._required("{arch}.embedding_length"))
        head_dim = int(
            self.metadata("{arch}.attention.key_length")
            or self.metadata("{arch}.rope.dimension_count")
            or hidden // n_head
        )
        value_dim = self.metadata("{arch}.attention.value_length")
        if value_dim is not None and value_dim != head_dim:
            raise UnsupportedModelError(f"key length {head_dim} != value length {value_dim}")
        q_rows = int(self._tensor("blk.0.attn_q.weight").shape[1])
        if q_rows != n_head * head_dim:
            raise UnsupportedModelError(
                f"attn_q has {q_rows} rows but metadata says {n_head} heads x {head_dim}"
            )
        theta = float(self.metadata("{arch}.rope.freq_base", 10000.0))
        eos = [self.metadata(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        layers = int(self._required("{arch}.block_count"))
        experts = int(self.metadata("{arch}.expert_count") or 0)
        ffn = self._uniform("{arch}.feed_forward_length")
        moe: dict[str, Any] = {}
        if experts:
            moe = dict(
                num_experts=experts,
                num_experts_per_tok=int(self._required("{arch}.expert_used_count")),
                moe_intermediate_size=int(
                    self.metadata("{arch}.expert_feed_forward_length") or ffn
                ),
                # Mixtral and Qwen3-MoE's published models renormalize the top k
                norm_topk_prob=bool(self.metadata("{arch}.expert_weights_norm", True)),
                dense_layers=tuple(
                    n for n in range(layers)
                    if f"blk.{n}.ffn_gate_inp.weight" not in self._tensors
                ),
            )
        arch = {"qwen3moe": "qwen3_moe"}.get(self.architecture, self.architecture)
        if arch == "llama" and experts:
            arch = "mixtral"
        return ModelConfig(
            architecture=arch,
            vocab_size=int(self._tensor("token_embd.weight").shape[1]),
            hidden_size=hidden,
            intermediate_size=ffn,
            num_hidden_layers=layers,
            num_attention_heads=n_head,
            num_key_value_heads=n_kv_head,
            head_dim=head_dim,
            rms_norm_eps=float(self._required("{arch}.attention.layer_norm_rms_epsilon")),
            rope_theta=theta,
            max_position_embeddings=int(self._required("{arch}.context_length")),
            tie_word_embeddings="output.weight" not in self._tensors,
            qkv_bias="blk.0.attn_q.bias" in self._tensors,
            qk_norm="blk.0.attn_q_norm.weight" in self._tensors,
            rope_scaling=self._rope_scaling(head_dim, theta),
            sliding_window=self._optional_int("{arch}.attention.sliding_window"),
            bos_token_id=self._optional_int("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
            name=name,
            **moe,
        )

    def _rope_scaling(self, head_dim: int, theta: float) -> dict[str, Any] | None:
        kind = self.metadata("{arch}.rope.scaling.type")
        factor = self.metadata("{arch}.rope.scaling.factor")
        if kind is None and self.metadata("{arch}.rope.scale_linear") is not None:
            kind, factor = "linear", self.metadata("{arch}.rope.scale_linear")  # older files
        if kind not in (None, "none") and factor not in (None, 1.0):
            if kind != "linear":
                raise UnsupportedModelError(f"unsupported rope scaling type {kind!r}")
            return {"rope_type": "linear", "factor": float(factor)}
        freqs = self._tensors.get("rope_freqs.weight")
        if freqs is None:
            return None
        check_supported(freqs.tensor_type, "tensor rope_freqs.weight")
        return llama3_scaling_from_divisors(
            dequantize(freqs.data, freqs.tensor_type),
            head_dim,
            theta,
            self.metadata("{arch}.rope.scaling.original_context_length"),
        )

    # -- tensors ----------------------------------------------------------------

    def _build_plan(self) -> list[tuple[GGUFTensor, str, int]]:
        """(tensor, HF name, head groups to un-permute or 0) for every tensor we load; a
        stack of experts' HF name has `{e}` for the expert (groups -1)."""
        cfg = self.config
        plan = []
        for t in self._reader.tensors:
            if t.name in _CONFIG_ONLY:
                continue
            hf_name = _GLOBAL_NAMES.get(t.name)
            groups = 0
            m = _LAYER_RE.fullmatch(t.name)
            if m and m[2] in _EXPERT_NAMES and int(m[1]) < cfg.num_hidden_layers:
                hf_name = f"model.layers.{m[1]}.mlp.experts.{{e}}.{_EXPERT_NAMES[m[2]]}.weight"
                groups = -1
            elif m and m[2] in _LAYER_NAMES and int(m[1]) < cfg.num_hidden_layers:
                hf_name = f"model.layers.{m[1]}.{_LAYER_NAMES[m[2]]}"
                if self.architecture in _PERMUTED_ARCHS and m[2].startswith("attn_q."):
                    groups = cfg.num_attention_heads
                elif self.architecture in _PERMUTED_ARCHS and m[2].startswith("attn_k."):
                    groups = cfg.num_key_value_heads
            if hf_name is None:
                raise UnsupportedModelError(
                    f"GGUF tensor {t.name!r} has no place in a {self.architecture} model"
                )
            check_supported(t.tensor_type, f"tensor {t.name}")
            plan.append((t, hf_name, groups))
        return plan

    def tensor_types(self) -> dict[str, str]:
        """GGUF type name of every loaded tensor, by HF name (a stack of experts once,
        `{e}` for the expert)."""
        return {hf: t.tensor_type.name for t, hf, _ in self._plan}

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, tensor) in file order, decoding each on demand (a stack of
        experts one expert at a time).

        Quantized tensors come as float32; F32/F16/BF16 tensors keep their dtype.
        """
        for t, hf_name, groups in self._plan:
            if groups < 0:
                yield from _experts(t, hf_name)
            else:
                yield hf_name, self._dense(t, groups)

    def iter_weights_quantized(self) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
        """`iter_weights`, except that the linear and embedding weights of a type our
        kernels read (`gguf_quant.KEPT_TYPES`) come as a `QuantTensor`, exactly (the
        experts stay dense: the grouped GEMM runs them so)."""
        for t, hf_name, groups in self._plan:
            if groups < 0:
                yield from _experts(t, hf_name)
            elif t.tensor_type in KEPT_TYPES and is_matmul_weight(hf_name):
                order = _unpermuted_order(int(t.shape[1]), groups) if groups else None
                yield hf_name, from_gguf(t.data, t.tensor_type, order)
            else:
                yield hf_name, self._dense(t, groups)

    @staticmethod
    def _dense(t: GGUFTensor, groups: int) -> torch.Tensor:
        w = _to_torch(t)
        return _unpermute_rows(w, groups) if groups else w


def _experts(t: GGUFTensor, hf_name: str) -> Iterator[tuple[str, torch.Tensor]]:
    """A stack of experts [E, rows, columns] as each expert's tensor."""
    stacked = _to_torch(t)
    if stacked.dim() != 3:
        raise UnsupportedModelError(f"GGUF tensor {t.name!r} is not a stack of experts")
    for e in range(stacked.shape[0]):
        yield hf_name.format(e=e), stacked[e]


def _to_torch(t: GGUFTensor) -> torch.Tensor:
    if t.tensor_type == GGMLQuantizationType.F16:
        return torch.from_numpy(np.array(t.data, dtype=np.float16))
    if t.tensor_type == GGMLQuantizationType.BF16:
        # The reader exposes BF16 as bytes [rows, 2 * cols].
        return torch.from_numpy(np.array(t.data).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(dequantize(t.data, t.tensor_type))


def is_matmul_weight(hf_name: str) -> bool:
    """A linear layer's weight, or the embedding (the tied head)."""
    return hf_name.endswith(("_proj.weight", "_proj_with_mqa.weight")) or hf_name in (
        "lm_head.weight",
        "model.embed_tokens.weight",
    )


def _unpermuted_order(rows: int, groups: int) -> torch.Tensor:
    """The row order `_unpermute_rows` produces, as indices into the stored rows."""
    if rows % (2 * groups):
        raise UnsupportedModelError(f"cannot split {rows} rows into {groups} rotary heads")
    return torch.arange(rows).view(groups, rows // groups // 2, 2).transpose(1, 2).reshape(-1)


def _unpermute_rows(w: torch.Tensor, groups: int) -> torch.Tensor:
    """Inverse of llama.cpp's Q/K permutation: per head, rows [x0,y0,x1,y1,...] back to
    [x0,x1,...,y0,y1,...]."""
    rows = w.shape[0]
    if rows % (2 * groups):
        raise UnsupportedModelError(f"cannot split {rows} rows into {groups} rotary heads")
    return (
        w.reshape(groups, rows // groups // 2, 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
        .contiguous()
    )
