"""Checkpoint loading: GGUF files and HF safetensors directories.

Both formats come out the same way: a `ModelConfig` and an iterator of
(HF parameter name, tensor) pairs in HF layout, so model code loads one way.

    source = resolve_model(None)             # the default SmolLM2-135M GGUF
    ckpt = open_checkpoint(source)           # reads the metadata once
    model = LlamaForCausalLM(ckpt.config, backend)
    model.load_weights(ckpt.iter_weights())  # decoded one tensor at a time

`load_model_config(source)` and `iter_weights(source)` do the same in two calls,
the first opening the file once per process (a GGUF's metadata takes about a
second to parse).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Protocol

import torch

from engine.config import QUANTIZATIONS, ModelConfig
from engine.weights.fp8 import Fp8Published
from engine.weights.gguf import GGUFCheckpoint, is_matmul_weight
from engine.weights.safetensors_loader import SafetensorsCheckpoint
from engine.weights.source import ModelSource, default_model_path, resolve_model
from kernels.quant import QuantTensor, quantize_fp8, quantize_int4, quantize_int8

__all__ = [
    "QUANTIZATIONS",
    "Checkpoint",
    "GGUFCheckpoint",
    "ModelSource",
    "SafetensorsCheckpoint",
    "default_model_path",
    "iter_weights",
    "load_model_config",
    "open_checkpoint",
    "resolve_model",
    "weights_for",
]


class Checkpoint(Protocol):
    config: ModelConfig

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]: ...


def _source(source: ModelSource | str | Path | None) -> ModelSource:
    return source if isinstance(source, ModelSource) else resolve_model(source)


def open_checkpoint(source: ModelSource | str | Path | None) -> Checkpoint:
    """Open a model's weights; `source` may also be anything `resolve_model` accepts."""
    src = _source(source)
    if src.kind == "gguf":
        return GGUFCheckpoint(src.path, src.name)
    return SafetensorsCheckpoint(src.path, src.name)


def load_model_config(source: ModelSource | str | Path | None) -> ModelConfig:
    """The checkpoint's config, parsed once per process for each unchanged file."""
    src = _source(source)
    return _config_of(src, src.path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _config_of(src: ModelSource, mtime_ns: int) -> ModelConfig:
    return open_checkpoint(src).config


def iter_weights(source: ModelSource | str | Path | None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs, [out, in] for linears; the embedding's tied lm_head is
    not repeated. GGUF quantized tensors come as float32, everything else in its
    stored dtype."""
    return open_checkpoint(source).iter_weights()


# a tensor-parallel rank's shard of a checkpoint's tensors (`TpShard.weights`): dense
# ones, and FP8 ones as published (cut exactly, kept FP8)
Cut = Callable[
    [Iterable[tuple[str, torch.Tensor | Fp8Published]]],
    Iterator[tuple[str, torch.Tensor | QuantTensor]],
]


def weights_for(
    checkpoint: Checkpoint, quantization: str | None, cut: Cut | None = None
) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
    """The checkpoint's weights as `quantization` (one of `QUANTIZATIONS`, or None:
    dense) holds them. `cut`, applied to the dense tensors before they are quantized:
    a tensor-parallel rank's shard of them (`TpShard.weights`); a GGUF's own blocks
    are not cut. An FP8 checkpoint stays FP8 (quantization None or "fp8") as stored;
    a tensor-parallel rank cuts its shard out of the codes and scales as published
    (`TpShard.shard_fp8`: exact where the scale blocks allow). A mixture of experts'
    experts stay FP8 (kept by the grouped FP8 kernel) and are not quantized at load as
    int8 / int4."""
    fp8 = isinstance(checkpoint, SafetensorsCheckpoint) and checkpoint.fp8 is not None
    if fp8 and quantization in (None, "fp8"):
        assert isinstance(checkpoint, SafetensorsCheckpoint)
        if cut is None:
            yield from checkpoint.iter_weights_quantized()
        else:
            yield from cut(checkpoint.iter_weights_published())
        return
    dense = checkpoint.iter_weights() if cut is None else cut(checkpoint.iter_weights())
    if quantization is None:
        yield from dense
        return
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; use one of {QUANTIZATIONS}")
    if quantization == "gguf":
        if not isinstance(checkpoint, GGUFCheckpoint):
            raise ValueError("quantization 'gguf' keeps a GGUF file's blocks; this checkpoint "
                             "is not a GGUF (use int8 or int4)")  # fmt: skip
        if cut is not None:
            raise ValueError("quantization 'gguf' keeps a GGUF file's blocks, which a "
                             "tensor-parallel shard does not cut (use int8 or int4)")  # fmt: skip
        yield from checkpoint.iter_weights_quantized()
        return
    for name, w in dense:
        if isinstance(w, QuantTensor) or not is_matmul_weight(name) or w.dim() != 2 or (
            ".experts." in name and quantization != "fp8"
        ):  # int8 / int4 experts: the grouped GEMM runs them dense
            yield name, w
        elif quantization == "fp8":  # the linears and experts; embedding and head as published
            linear = name.endswith(("_proj.weight", "_proj_with_mqa.weight"))
            yield name, quantize_fp8(w) if linear else w
        elif quantization == "int8" or not name.endswith("_proj.weight"):
            yield name, quantize_int8(w)
        else:
            yield name, quantize_int4(w)
