"""The engine end to end on the Triton kernels (attention_backend="triton" and every
kernel forced to Triton; through the interpreter on CPU) gives the torch path's greedy
tokens, across chunked prefill, prefix-cache hits, GQA, a sliding window and Qwen3's
q/k norm, on tiny random checkpoints written by transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine import EngineConfig, EngineCore, SamplingParams
from tests.conftest import REPORT
from tests.kernels.conftest import DEVICE, kernel_backend, needs_triton

pytestmark = needs_triton

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
    import transformers

    cls_name, extra = MODELS[name]
    cfg = getattr(transformers, cls_name)(**TINY, **extra)
    torch.manual_seed(len(name))
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(tmp / name)
    return tmp / name


def _generate(path: Path, backend: str) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
    """Two waves of greedy requests; the second shares the first's prompts' prefixes."""
    core = EngineCore(
        EngineConfig(
            model=str(path),
            dtype="float32",
            device=str(DEVICE),
            num_blocks=48,
            block_size=16,
            max_num_batched_tokens=24,  # 40- and 53-token prompts prefill in chunks
            attention_backend=backend,
        )
    )
    g = torch.Generator().manual_seed(3)
    first = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 13, 40)]
    second = [[*first[2][:35], 7, 8], first[2] + [9] * 13]  # two cached blocks each
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, output_logits=True)
    tokens: dict[str, list[int]] = {}
    logits: dict[str, list[torch.Tensor]] = {}
    cached: dict[str, int] = {}
    for wave, prompts in enumerate((first, second)):
        for i, p in enumerate(prompts):
            core.add_request(f"{wave}.{i}", p, params)
        while core.has_unfinished_requests():
            for o in core.step():
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                logits.setdefault(o.request_id, []).extend(o.new_logits or [])
                cached[o.request_id] = o.num_cached_tokens
    assert core.is_idle() and not core.check_invariants()
    assert cached["1.0"] == cached["1.1"] == 32  # the second wave attends over cached KV
    return tokens, {k: torch.stack(v) for k, v in logits.items()}


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_tokens_match_the_torch_path(name: str, tmp_path: Path) -> None:
    path = _checkpoint(tmp_path, name)
    with kernel_backend("auto"):
        want_tokens, want_logits = _generate(path, "torch")
    with kernel_backend("triton"):
        tokens, logits = _generate(path, "triton")
    assert tokens == want_tokens
    worst = max(float((logits[k] - want_logits[k]).abs().max()) for k in logits)
    REPORT[f"max |logits triton - torch| fp32, tiny {name}"] = f"{worst:.1e}"
    assert worst < 1e-4, worst
