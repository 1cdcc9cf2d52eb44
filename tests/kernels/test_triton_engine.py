"""The engine end to end on the Triton kernels (attention_backend="triton" and every
kernel forced to Triton; through the interpreter on CPU) gives the torch path's greedy
tokens, across chunked prefill, prefix-cache hits, GQA, a sliding window and Qwen3's
q/k norm, on tiny random checkpoints written by transformers. Each side runs in its own
process (`engine_child`), since a process's kernel selection is fixed at import."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import REPORT
from tests.kernels.conftest import DEVICE, needs_triton
from tests.tiny_models import random_checkpoint

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [needs_triton, pytest.mark.slow]

TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa": ("LlamaConfig", {}),
    "mistral-window": ("MistralConfig", {"sliding_window": 24}),
    "qwen3-qknorm": ("Qwen3Config", {"head_dim": 32}),
}


def _checkpoint(tmp: Path, name: str) -> Path:
    cls_name, extra = MODELS[name]
    return random_checkpoint(tmp / name, cls_name, {**TINY, **extra}, seed=len(name))[1]


def _generate(
    path: Path, attention: str, kernels: str, tmp: Path
) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
    """Tokens and logits of `engine_child` with attention backend `attention` and every
    kernel on backend `kernels` (the Triton kernels interpreted on CPU)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "DIPTYCH_KERNELS")}
    env["DIPTYCH_KERNELS"] = kernels
    if kernels == "triton" and DEVICE.type != "cuda":
        env["TRITON_INTERPRET"] = "1"
    out = tmp / f"{attention}-{kernels}.pt"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.kernels.engine_child", str(path), attention,
         str(DEVICE), str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = torch.load(out)
    assert res["kernels"] == kernels
    return res["tokens"], res["logits"]


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_tokens_match_the_torch_path(name: str, tmp_path: Path) -> None:
    path = _checkpoint(tmp_path, name)
    want_tokens, want_logits = _generate(path, "torch", "auto", tmp_path)
    tokens, logits = _generate(path, "triton", "triton", tmp_path)
    assert tokens == want_tokens
    worst = max(float((logits[k] - want_logits[k]).abs().max()) for k in logits)
    REPORT[f"max |logits triton - torch| fp32, tiny {name}"] = f"{worst:.1e}"
    assert worst < 1e-4, worst
