"""`--deterministic` at tensor parallel sizes 1, 2 and 4 (ranks in their own processes,
gloo on the loopback), on a dense Llama, a Qwen3 mixture of experts and a DeepSeek-V3
(latent attention and experts): a request's bf16 logits are the same bits alone, beside
other requests over its own cached prefix, and in 16-token chunks beside others. The
ranks sum their partial products in rank order element by element, through shared
memory or, without it, gathered (`TpGroup(fixed_order=True)`), whatever the step's
size; each expert's rows run a row-invariant kernel however many the expert gets, and a
token's experts add up in its top-k order; latent attention's absorbed projections run
a head's rows alike. The engine says which build, dtype and TP size its bits belong to
(`numerics`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine import EngineConfig, EngineCore, NewRequest, SamplingParams
from tests.kernels.test_kv_quant import needs_cpu_ops
from tests.tiny_models import random_checkpoint

pytestmark = needs_cpu_ops

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, output_logits=True)
# heads the batch-invariant attention takes (head dim 16)
TINY = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
            rms_norm_eps=1e-6, tie_word_embeddings=False)  # fmt: skip
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    # 8 experts of 32 (top 2, renormalized), layer 1 dense
    "qwen3-moe": ("Qwen3MoeConfig", {"num_experts": 8, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32, "norm_topk_prob": True,
                                     "mlp_only_layers": [1], "head_dim": 16}),
    # latent attention (latent 32 + rotary 16 cached; nope 16, v 16), a dense layer,
    # then 8 experts behind DeepSeek's grouped sigmoid router beside a shared expert
    "deepseek-v3-mla": ("DeepseekV3Config", {
        "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1,
        "moe_intermediate_size": 32, "first_k_dense_replace": 1}),
}  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("det")
    return {name: random_checkpoint(root / name, cls_name, {**TINY, **extra}, seed=11)[1]
            for name, (cls_name, extra) in MODELS.items()}  # fmt: skip


def _run(core: EngineCore, prompts: list[list[int]], at: int, tag: str) -> torch.Tensor:
    """Prompt `at`'s logits, the others in the same steps."""
    logits: list[torch.Tensor] = []
    for i, p in enumerate(prompts):
        core.submit(NewRequest(f"{tag}{i}", p, GREEDY))
    while core.has_unfinished_requests():
        for o in core.step():
            if o.request_id == f"{tag}{at}":
                logits.extend(o.new_logits or [])
    assert core.is_idle() and not core.check_invariants()
    return torch.stack(logits)


@pytest.mark.parametrize(
    "name,tp,shm",
    [("llama", 2, True), ("llama", 4, False), ("qwen3-moe", 1, True), ("qwen3-moe", 2, True),
     ("deepseek-v3-mla", 1, True), ("deepseek-v3-mla", 2, True)],
)
def test_logits_are_the_same_alone_batched_and_chunked(
    checkpoints: dict[str, Path], name: str, tp: int, shm: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not shm:  # the gathered, rank-ordered sum instead of shared memory's
        monkeypatch.setenv("DIPTYCH_TP_SHM", "0")
    g = torch.Generator().manual_seed(tp)
    target = torch.randint(0, 256, (45,), generator=g).tolist()
    others = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (7, 60, 23)]
    base: dict[str, Any] = dict(model=str(checkpoints[name]), dtype="bfloat16",
                                deterministic=True, tensor_parallel_size=tp, num_blocks=64,
                                threads=1)  # fmt: skip
    results = {}
    core = EngineCore(EngineConfig(**base))
    try:
        assert core.numerics is not None and core.numerics.endswith(f"/bfloat16/tp{tp}")
        results["alone"] = _run(core, [target], 0, "a")
        results["batched, cached"] = _run(core, [others[0], target, others[1], others[2]], 1, "b")
    finally:
        core.close()
    if tp <= 2:  # (chunks are the ranks' business alike: one more start of 4 is time)
        core = EngineCore(
            EngineConfig(**base, max_num_batched_tokens=16, enable_prefix_caching=False)
        )
        try:
            results["chunked, batched"] = _run(core, [others[1], target, others[2]], 1, "c")
        finally:
            core.close()
    alone = results.pop("alone")
    for case, logits in results.items():
        assert torch.equal(logits, alone), case
