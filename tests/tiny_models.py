"""Tiny checkpoints of random weights, made at test time with transformers from a
config (no downloads): norms near 1, every other weight N(0, 0.15), saved as
safetensors where the engine loads them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def random_model(cls_name: str, config: dict[str, Any], seed: int, **from_config: Any) -> Any:
    """transformers' `cls_name` config (LlamaConfig, Qwen3MoeConfig, ...) of `config`,
    as a model (`from_config`: AutoModelForCausalLM.from_config's options) of random
    weights drawn after `torch.manual_seed(seed)`."""
    import transformers

    torch.manual_seed(seed)
    cfg = getattr(transformers, cls_name)(**config)
    model = transformers.AutoModelForCausalLM.from_config(cfg, **from_config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0, 0.15)
    return model.eval()


def random_checkpoint(
    path: Path, cls_name: str, config: dict[str, Any], seed: int
) -> tuple[Any, Path]:
    """`random_model`, saved under `path`: (the model, `path`)."""
    model = random_model(cls_name, config, seed)
    model.save_pretrained(path)
    return model, path
