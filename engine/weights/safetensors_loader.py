"""HF checkpoints: `config.json` plus `model.safetensors` or a sharded index.

Tensors are read lazily, one at a time, through `safetensors.safe_open`
(memory-mapped), under the names and dtypes they were saved with. Buffers that
HF models recompute at load time (rotary `inv_freq`) are skipped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.config import ModelConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Non-parameter tensors some exporters leave in the checkpoint.
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


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
        self.files = self._weight_files()

    def _weight_files(self) -> list[Path]:
        index = self.directory / INDEX_FILE
        if index.is_file():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"{index} has no weight_map")
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
            return [single]
        raise FileNotFoundError(f"{self.directory} has neither {SINGLE_FILE} nor {INDEX_FILE}")

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) file by file, with the dtype each tensor was saved in."""
        for path in self.files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if name.endswith(_SKIPPED_SUFFIXES):
                        continue
                    yield name, f.get_tensor(name)
