"""LoRA adapters made by `peft` on the spot, for SmolLM2-135M (the default model), for
the tests and the multi-LoRA benchmark:
random non-zero A and B (peft initialises B to zero, which would change nothing), ranks
8 and 16, different target modules, one with rsLoRA scaling. No download: the base is
the GGUF's model as transformers loads it.

    adapters = make_adapters(hf_model, tmp_dir)            # name -> directory
    refs = greedy_with_adapter(hf_model, path, prompts, n)  # transformers + peft tokens
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class Spec:
    name: str
    rank: int
    alpha: int
    targets: tuple[str, ...]
    rslora: bool = False


SPECS = (
    Spec("ad-qv8", 8, 16, ("q_proj", "v_proj")),
    Spec("ad-all16", 16, 32, (*ATTN, *MLP)),
    Spec("ad-mlp8", 8, 8, tuple(MLP), rslora=True),
    Spec("ad-o16", 16, 16, ("o_proj", "down_proj")),
    Spec("ad-k8", 8, 32, ("k_proj", "up_proj")),
    Spec("ad-attn16", 16, 16, tuple(ATTN)),
    Spec("ad-v8", 8, 16, ("v_proj", "down_proj")),
    Spec("ad-gate16", 16, 8, ("gate_proj", "q_proj"), rslora=True),
)


def shape_model() -> Any:
    """SmolLM2-135M's architecture (a transformers Llama of its config) on the meta
    device, no weights: an adapter's file depends only on the base's module names and
    shapes, so adapters made on it serve the real model, and it takes no time to build
    (transformers takes ~17 s to dequantize the GGUF's weights here). Use the real model
    where its outputs matter."""
    import transformers

    from engine.weights import default_model_path, load_model_config

    mc = load_model_config(default_model_path())
    config = transformers.LlamaConfig(
        vocab_size=mc.vocab_size, hidden_size=mc.hidden_size,
        intermediate_size=mc.intermediate_size, num_hidden_layers=mc.num_hidden_layers,
        num_attention_heads=mc.num_attention_heads, num_key_value_heads=mc.num_key_value_heads,
        head_dim=mc.head_dim, tie_word_embeddings=mc.tie_word_embeddings,
        rms_norm_eps=mc.rms_norm_eps, rope_theta=mc.rope_theta,
        max_position_embeddings=mc.max_position_embeddings,
    )  # fmt: skip
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config).eval()


def reference_model() -> Any:
    """SmolLM2-135M as a transformers Llama in fp32, holding the weights the engine's
    GGUF reader gives (about 4 s; transformers' own GGUF load takes ~17 s here, and
    tests/engine/test_parity_hf.py holds the engine to that one)."""
    from engine.weights import default_model_path, iter_weights

    model = shape_model().to_empty(device="cpu")
    weights = {name: t.float() for name, t in iter_weights(default_model_path())}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"weights do not fit: missing {missing}, unexpected {unexpected}")
    if model.config.tie_word_embeddings:
        model.tie_weights()
    model.model.rotary_emb.__init__(model.config)  # its buffers, built on the meta device
    return model.eval()


def make_adapter(base: Any, spec: Spec, out_dir: Path, seed: int) -> Any:
    """Save `spec`'s adapter of `base` (a transformers model) under `out_dir`; returns
    the peft model (base with the adapter in place: `.unload()` gives the base back)."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(
        r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.targets),
        lora_dropout=0.0, use_rslora=spec.rslora, bias="none",
    )  # fmt: skip
    model = get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, mod in model.named_modules():
            kind = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
            if kind not in ("lora_A", "lora_B") or not isinstance(mod, torch.nn.Linear):
                continue
            shape = mod.weight.shape  # (set anew: a base on the meta device has no data)
            w = torch.randn(shape, generator=g)
            # A: rank values of order 1 for a normalized input; B: a visible change
            w = w / shape[1] ** 0.5 if kind == "lora_A" else w * 0.08
            mod.weight = torch.nn.Parameter(w.to(torch.float32), requires_grad=False)
    model.eval()
    model.save_pretrained(str(out_dir))
    return model


# the benchmark's hardest case: eight adapters of rank 16 on all seven linears
UNIFORM = tuple(Spec(f"all16-{i}", 16, 32, (*ATTN, *MLP)) for i in range(8))


def make_adapters(base: Any, root: Path, specs: tuple[Spec, ...] = SPECS) -> dict[str, Path]:
    """Every spec's adapter saved under `root/<name>`; `base` is left as it was."""
    out = {}
    for i, spec in enumerate(specs):
        path = root / spec.name
        model = make_adapter(base, spec, path, seed=1000 + i)
        base = model.unload()
        out[spec.name] = path
    return out


def greedy(model: Any, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Greedy continuations (EOS ignored) of a transformers (or peft) model, fp32."""
    fwd = model.get_base_model().forward if hasattr(model, "get_base_model") else model.forward
    new_api = "cache" in inspect.signature(fwd).parameters
    result = []
    with torch.inference_mode():
        for ids in prompts:
            out = model(input_ids=torch.tensor([ids]), use_cache=True)
            tokens: list[int] = []
            for _ in range(max_new):
                tok = int(out.logits[0, -1].float().argmax())
                tokens.append(tok)
                kv = {"cache": out.cache} if new_api else {"past_key_values": out.past_key_values}
                out = model(input_ids=torch.tensor([[tok]]), use_cache=True, **kv)
            result.append(tokens)
    return result


def greedy_with_adapter(
    base: Any, path: Path, prompts: list[list[int]], max_new: int
) -> list[list[int]]:
    """transformers + peft greedy tokens with the adapter at `path`; `base` restored."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(base, str(path))
    model.eval()
    try:
        return greedy(model, prompts, max_new)
    finally:
        model.unload()
