"""A LoRA adapter read from a PEFT directory: `adapter_config.json` and
`adapter_model.safetensors` (or `adapter_model.bin`), as `peft`'s `save_pretrained`
writes them.

Each targeted linear of a decoder layer holds A [r, in] and B [out, r]; its output
gains B(A x) * scale, where scale is lora_alpha / r (lora_alpha / sqrt(r) with
`use_rslora`), per module where `rank_pattern` / `alpha_pattern` say so. The targets
are the Llama family's seven linears: q/k/v/o_proj in attention, gate/up/down_proj in
the MLP. Anything an adapter carries beyond them (trained embeddings or head,
`modules_to_save`, DoRA magnitudes, LoRA biases) is refused with the reason: serving it
without would give other tokens than the adapter was trained to give.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from protocol.errors import InvalidInput

# a PEFT module name -> (the fused linear of the model, the slice it fills)
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_KEY = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)


@dataclass
class LoraAdapter:
    """One adapter in host memory. `weights[(layer, module)]` is (A [r, in], B scaled by
    the module's scale [out, r]) in fp32, `module` a PEFT name (`q_proj`, ...)."""

    name: str
    path: str
    rank: int  # the largest rank of any module
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    base_model: str = ""

    @property
    def modules(self) -> set[str]:
        return {m for _, m in self.weights}


def read_config(path: str | Path) -> dict[str, Any]:
    """The adapter's `adapter_config.json`, checked for what serving supports."""
    root = Path(path)
    try:
        raw = (root / CONFIG_FILE).read_text()
    except OSError as e:
        raise InvalidInput(f"LoRA adapter at {str(path)!r}: cannot read {CONFIG_FILE} "
                           f"({e.strerror or e})") from None  # fmt: skip
    try:
        cfg = json.loads(raw)
    except ValueError as e:
        raise InvalidInput(
            f"LoRA adapter at {str(path)!r}: {CONFIG_FILE} is not JSON ({e})"
        ) from None
    if not isinstance(cfg, dict):
        raise InvalidInput(f"LoRA adapter at {str(path)!r}: {CONFIG_FILE} is not an object")
    kind = str(cfg.get("peft_type", "LORA")).upper()
    if kind != "LORA":
        raise InvalidInput(f"LoRA adapter at {str(path)!r}: peft_type {kind} is not LoRA")
    refused = {
        "use_dora": "DoRA adapters", "modules_to_save": "trained copies of whole modules "
        "(modules_to_save)", "lora_bias": "LoRA biases",
    }  # fmt: skip
    for key, what in refused.items():
        if cfg.get(key):
            raise InvalidInput(f"LoRA adapter at {str(path)!r}: {what} are not supported")
    if cfg.get("bias", "none") not in ("none", None):
        raise InvalidInput(f"LoRA adapter at {str(path)!r}: bias {cfg['bias']!r} is not "
                           "supported (only 'none')")  # fmt: skip
    if cfg.get("fan_in_fan_out"):
        raise InvalidInput(f"LoRA adapter at {str(path)!r}: fan_in_fan_out (Conv1D bases) "
                           "is not supported")  # fmt: skip
    return cfg


def _pattern(patterns: object, key: str) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: a pattern matches a module's name
    when the name ends with it (as a regex)."""
    if not isinstance(patterns, dict):
        return None
    for pat, value in patterns.items():
        if re.match(rf"(.*\.)?({pat})$", key):
            return value
    return None


def load_adapter(name: str, path: str | Path, max_rank: int) -> LoraAdapter:
    """Read and check an adapter (see the module); raises InvalidInput with the reason."""
    cfg = read_config(path)
    root = Path(path)
    tensors = _read_weights(root)
    r_default, alpha_default = int(cfg.get("r", 8)), float(cfg.get("lora_alpha", 8))
    rslora = bool(cfg.get("use_rslora"))
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in TARGETS:
            raise InvalidInput(f"LoRA adapter {name!r}: weight {key!r} is not a LoRA A/B of a "
                               f"decoder layer's {'/'.join(TARGETS)}")  # fmt: skip
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = t
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    top = 0
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise InvalidInput(f"LoRA adapter {name!r}: layer {layer} {module} lacks its "
                               f"lora_{'B' if 'A' in ab else 'A'}")  # fmt: skip
        a, b = ab["A"].float(), ab["B"].float()
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise InvalidInput(f"LoRA adapter {name!r}: layer {layer} {module}: A "
                               f"{tuple(a.shape)} and B {tuple(b.shape)} do not chain")  # fmt: skip
        rank = int(a.shape[0])
        if rank > max_rank:
            raise InvalidInput(f"LoRA adapter {name!r} has rank {rank} ({module}); this server "
                               f"takes at most --max-lora-rank {max_rank}")  # fmt: skip
        qualified = f"model.layers.{layer}.{module}"
        alpha = _pattern(cfg.get("alpha_pattern"), qualified)
        alpha = alpha_default if alpha is None else float(alpha)
        declared = _pattern(cfg.get("rank_pattern"), qualified)
        if int(declared if declared is not None else r_default) != rank:
            raise InvalidInput(f"LoRA adapter {name!r}: layer {layer} {module} has rank {rank}, "
                               "its config says otherwise")  # fmt: skip
        scale = alpha / (math.sqrt(rank) if rslora else rank)
        weights[(layer, module)] = (a.contiguous(), (b * scale).contiguous())
        top = max(top, rank)
    if not weights:
        raise InvalidInput(f"LoRA adapter {name!r} at {str(path)!r} holds no LoRA weights")
    base = cfg.get("base_model_name_or_path") or ""
    return LoraAdapter(name, str(path), top, weights, str(base))


def _read_weights(root: Path) -> dict[str, torch.Tensor]:
    for fname in WEIGHT_FILES:
        f = root / fname
        if not f.exists():
            continue
        try:
            if fname.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(f), device="cpu")
            loaded = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # a truncated or foreign file
            raise InvalidInput(
                f"LoRA adapter at {str(root)!r}: cannot read {fname} ({e})"
            ) from None
        if not isinstance(loaded, dict):
            raise InvalidInput(f"LoRA adapter at {str(root)!r}: {fname} is not a state dict")
        return {str(k): v for k, v in loaded.items()}
    raise InvalidInput(f"LoRA adapter at {str(root)!r}: no {' or '.join(WEIGHT_FILES)}")
