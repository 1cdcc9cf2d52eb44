"""HF checkpoints: `config.json` plus `model.safetensors` or a sharded index.

Tensors are read lazily, one at a time, through `safetensors.safe_open`
(memory-mapped), under the names and dtypes they were saved with. Buffers that
HF models recompute at load time (rotary `inv_freq`) are skipped. An FP8
checkpoint's weights (`engine/weights/fp8.py`) come with their scales: kept FP8
(`iter_weights_quantized`) or dequantized to fp32 (`iter_weights`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.weights.fp8 import Fp8Published, check_codes, fp8_scheme
from kernels.quant import QuantTensor

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Non-parameter tensors some exporters leave in the checkpoint.
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


def _read_json(path: Path) -> Any:
    try:
        with path.open(encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


class SafetensorsCheckpoint:
    """An HF model directory: its `ModelConfig` and a lazy iterator over its weights."""

    def __init__(self, directory: str | Path, name: str = "") -> None:
        self.directory = Path(directory)
        config_path = self.directory / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{self.directory} has no config.json")
        self.hf_config: dict[str, Any] = _read_json(config_path)
        self.config = ModelConfig.from_hf_dict(self.hf_config, name or self.directory.name)
        self.fp8 = fp8_scheme(self.hf_config)
        self.files = self._weight_files()

    def _weight_files(self) -> list[Path]:
        index = self.directory / INDEX_FILE
        if index.is_file():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"{index} has no weight_map")
            self._weight_map = {k: self.directory / v for k, v in weight_map.items()}
            files = [self.directory / f for f in dict.fromkeys(weight_map.values())]
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise FileNotFoundError(
                    f"{self.directory} is missing shards listed in {INDEX_FILE}: "
                    + ", ".join(missing)
                )
            return files
        single = self.directory / SINGLE_FILE
        if single.is_file():
            self._weight_map = {}
            return [single]
        raise FileNotFoundError(f"{self.directory} has neither {SINGLE_FILE} nor {INDEX_FILE}")

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) file by file, with the dtype each tensor was saved in;
        an FP8 weight dequantized to fp32."""
        for name, t, scale in self._tensors():
            yield name, t if scale is None or self.fp8 is None else self.fp8.dense(t, scale)

    def iter_weights_quantized(self) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
        """As `iter_weights`, but an FP8 weight stays FP8 (a `QuantTensor`, exactly)."""
        for name, t in self.iter_weights_published():
            yield name, t.quantized() if isinstance(t, Fp8Published) else t

    def iter_weights_published(self) -> Iterator[tuple[str, torch.Tensor | Fp8Published]]:
        """As `iter_weights`, but an FP8 weight as published: its codes and scale (what
        a tensor-parallel rank cuts its shard from, `TpShard.weights`)."""
        for name, t, scale in self._tensors():
            yield name, t if scale is None or self.fp8 is None else Fp8Published(
                t, scale, self.fp8
            )  # fmt: skip

    def _tensors(self) -> Iterator[tuple[str, torch.Tensor, torch.Tensor | None]]:
        """(name, tensor, its FP8 scale or None); scale tensors are not yielded."""
        with ExitStack() as stack:
            handles: dict[Path, Any] = {}

            def opened(path: Path) -> Any:
                if path not in handles:
                    handles[path] = stack.enter_context(safe_open(str(path), framework="pt"))
                return handles[path]

            for path in self.files:
                f = opened(path)
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if name.endswith(_SKIPPED_SUFFIXES) or (self.fp8 and self.fp8.is_scale(name)):
                        continue
                    t = f.get_tensor(name)
                    if t.dtype not in _FLOAT8:
                        yield name, t, None
                        continue
                    check_codes(name, t, self.fp8)
                    assert self.fp8 is not None
                    scale = self.fp8.scale_name(name)
                    where = self._weight_map.get(scale, path)
                    if scale not in opened(where).keys():  # noqa: SIM118
                        raise ValueError(f"{self.directory}: FP8 weight {name} has no {scale}")
                    yield name, t, opened(where).get_tensor(scale)
