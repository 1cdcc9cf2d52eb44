"""Tensor parallelism end to end in the engine: ranks in their own processes (gloo on
the loopback), greedy tokens and logits equal to transformers' in fp32 at TP 1, 2 and 4,
with chunked prefill, prefix-cache hits, GQA replication (fewer KV heads than ranks),
QKV bias, a tied head, mixtures of experts and DeepSeek's latent attention; refusals at
start say which; a rank that dies stops the engine at its next step, and no process is
left behind."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import EngineConfig, EngineCore, NewRequest, SamplingParams
from engine.config import UnsupportedModelError
from engine.parallel.group import RankLostError
from tests.conftest import REPORT
from tests.tiny_models import random_checkpoint

pytestmark = pytest.mark.slow

NEW = 10
TINY = dict(vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=8, max_position_embeddings=512, rms_norm_eps=1e-6)  # fmt: skip
MODELS = {
    # 8 query heads over 4 KV heads: at TP 4 one KV head a rank; 250 rows split unevenly
    "llama-8h-4kv": ("LlamaConfig", {"num_key_value_heads": 4, "tie_word_embeddings": False}),
    # 2 KV heads at TP 4: each held by two ranks; biases on q/k/v; the head tied
    "qwen2-8h-2kv": ("Qwen2Config", {"num_key_value_heads": 2, "tie_word_embeddings": True}),
    # 8 experts of 32 (top 2, renormalized) and a dense layer: each rank a quarter of
    # every expert's width at TP 4, the router whole on every rank
    "qwen3-moe-8h-4kv": (
        "Qwen3MoeConfig",
        {"num_key_value_heads": 4, "num_experts": 8, "num_experts_per_tok": 2,
         "moe_intermediate_size": 32, "norm_topk_prob": True, "mlp_only_layers": [1],
         "tie_word_embeddings": False},
    ),
    # multi-head latent attention (8 heads split over the ranks, the latent of 32 and
    # rotary key of 16 cached whole on every rank), a dense layer, then 8 experts behind
    # DeepSeek's grouped sigmoid router beside two shared experts (split like an MLP)
    "deepseek-v3-mla": (
        "DeepseekV3Config",
        {"num_key_value_heads": 8, "kv_lora_rank": 32, "q_lora_rank": 48,
         "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
         "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
         "n_shared_experts": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
         "tie_word_embeddings": False},
    ),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Path]]:
    return {name: random_checkpoint(tmp_path_factory.mktemp("tp") / name, cls_name,
                                    {**TINY, **extra}, seed=len(name))
            for name, (cls_name, extra) in MODELS.items()}  # fmt: skip


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 250, (40,), generator=g).tolist()
    tails = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (1, 9, 30)]
    return [shared + t for t in tails] + [torch.randint(0, 250, (5,), generator=g).tolist()]


def _hf(model: Any, ids: list[int]) -> tuple[list[int], torch.Tensor]:
    tokens, rows, seq = [], [], list(ids)
    with torch.inference_mode():
        for _ in range(NEW):
            logits = model(torch.tensor([seq])).logits[0, -1].float()
            top2 = logits.topk(2).values
            assert float(top2[0] - top2[1]) > 1e-3, "a near-tie in the reference: pick another seed"
            rows.append(logits)
            tokens.append(int(logits.argmax()))
            seq.append(tokens[-1])
    return tokens, torch.stack(rows)


core_cached: dict[str, int] = {}  # prompt tokens each request found in the prefix cache


def _run(
    core: EngineCore, prompts: list[list[int]], tag: str, logits: bool = True
) -> dict[int, tuple[list, list]]:
    """Each prompt's greedy tokens and (with `logits`: a request that asks for them is
    not speculated on) their logits."""
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, output_logits=logits)
    for i, p in enumerate(prompts):
        core.submit(NewRequest(f"{tag}{i}", p, params))
    outs: dict[int, tuple[list, list]] = {i: ([], []) for i in range(len(prompts))}
    while core.has_unfinished_requests():
        for o in core.step():
            i = int(o.request_id.removeprefix(tag))
            core_cached[o.request_id] = o.num_cached_tokens
            outs[i][0].extend(o.new_token_ids)
            outs[i][1].extend(o.new_logits or [])
    return outs


def _engine(path: Path, tp: int, **kw: Any) -> EngineCore:
    kw = {"num_blocks": 64, "max_num_batched_tokens": 24, "threads": 1, **kw}
    return EngineCore(
        EngineConfig(model=str(path), dtype="float32", tensor_parallel_size=tp, **kw)
    )


@pytest.mark.parametrize(
    "name,tp,ep",
    [(name, tp, False) for name in MODELS for tp in (1, 2, 4)]
    # the experts whole, 4 a rank at TP 2 and 2 a rank at TP 4
    + [("qwen3-moe-8h-4kv", 2, True), ("qwen3-moe-8h-4kv", 4, True),
       ("deepseek-v3-mla", 2, True), ("qwen3-moe-8h-4kv", 2, "gloo")],
)
def test_greedy_tokens_and_logits_match_transformers(
    checkpoints: dict[str, tuple[Any, Path]], name: str, tp: int, ep: bool | str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Chunked prefill (a 24-token budget), then the same prompts again: their whole
    blocks come from the prefix cache, each rank's KV heads of those blocks. `ep`: the
    experts spread over the ranks, tokens sent to them by all-to-all (through shared
    memory, or "gloo"'s)."""
    if ep == "gloo":
        monkeypatch.setenv("DIPTYCH_TP_SHM", "0")
    hf, path = checkpoints[name]
    prompts = _prompts()
    refs = [_hf(hf, p) for p in prompts]
    core = _engine(path, tp, expert_parallel_size=tp if ep else 1)
    try:
        worst = 0.0
        for round_ in ("cold", "cached"):
            outs = _run(core, prompts, round_)
            for i, (tokens, ref_logits) in enumerate(refs):
                got, logits = outs[i]
                assert got == tokens, f"{name} TP {tp} {round_}: prompt {i}"
                worst = max(worst, float((torch.stack(logits) - ref_logits).abs().max()))
        cached = [core_cached[f"cached{i}"] for i in range(len(prompts))]
        assert cached == [(len(p) - 1) // 16 * 16 for p in prompts] and cached[0] == 32
        assert core.is_idle() and not core.check_invariants()
        load = core.snapshot().expert_load
        if ep:  # tokens went to their experts' ranks and back, counted a step
            assert load is not None and load.all_to_all_bytes > 0
            REPORT[f"expert-parallel all-to-all ({'gloo' if ep == 'gloo' else 'shm'}), "
                   f"tiny {name} at EP {tp}: bytes a step"] = (
                f"{load.all_to_all_bytes / load.steps:.0f} (last {load.all_to_all_bytes_last})"
            )
    finally:
        core.close()
    REPORT[f"max |logits - HF| fp32, tiny {name} at TP {tp}{' EP' if ep else ''}"] = (
        f"{worst:.2e}"
    )
    assert worst < 1e-4, worst


def test_quantized_kv_splits_by_head(checkpoints: dict[str, tuple[Any, Path]]) -> None:
    """An int8 KV cache: each rank quantizes its own heads' rows, as one rank would."""
    _, path = checkpoints["llama-8h-4kv"]
    prompts = _prompts()
    results = []
    for tp in (1, 2):
        core = _engine(path, tp, kv_cache_dtype="int8")
        try:
            results.append({i: t for i, (t, _) in _run(core, prompts, "q").items()})
        finally:
            core.close()
    assert results[0] == results[1]


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_weights_quantized_at_load_split_by_rank(
    checkpoints: dict[str, tuple[Any, Path]], quantization: str
) -> None:
    """Each rank quantizes its own shard at load. int4's groups of 32 inputs fall
    whole inside a rank's rows (o_proj's 64 inputs over 2 ranks: 32 each), so TP 2
    holds TP 1's exact weights and greedy tokens and logits agree. int8's
    per-output-channel scale is taken over each rank's part of a row-parallel row:
    the first token's logits then differ from TP 1's by less than int8 itself moves
    them from the dense weights' (later ones follow tokens that may part)."""
    _, path = checkpoints["llama-8h-4kv"]
    prompts = _prompts()
    outs = []
    for tp, q in ((1, None), (1, quantization), (2, quantization)):
        core = _engine(path, tp, **({"quantization": q} if q else {}))
        try:
            outs.append(_run(core, prompts, "w"))
        finally:
            core.close()
    dense, tp1, tp2 = outs

    def first(a: dict[int, tuple[list, list]], b: dict[int, tuple[list, list]]) -> float:
        return max(float((a[i][1][0] - b[i][1][0]).abs().max()) for i in range(len(prompts)))

    REPORT[f"first-token |logits TP 2 - TP 1|, {quantization} weights"] = f"{first(tp2, tp1):.2e}"
    if quantization == "int4":
        assert [tp2[i][0] for i in tp2] == [tp1[i][0] for i in tp1]
        worst = max(float((torch.stack(tp2[i][1]) - torch.stack(tp1[i][1])).abs().max())
                    for i in range(len(prompts)))  # fmt: skip
        assert worst < 1e-4
    else:
        assert first(tp2, tp1) < first(tp1, dense)


def test_speculation_at_tp2_gives_tp1s_tokens(checkpoints: dict[str, tuple[Any, Path]]) -> None:
    """Drafts verified by a TP 2 target, from a draft model run whole on rank 0: the
    target itself, so every draft is accepted and each step verifies several rows a
    request (prompt lookup goes through the same verification)."""
    _, path = checkpoints["llama-8h-4kv"]
    prompts = _prompts()
    plain = _engine(path, 1)
    try:
        want = {i: t for i, (t, _) in _run(plain, prompts, "p", logits=False).items()}
    finally:
        plain.close()
    core = _engine(path, 2, num_speculative_tokens=3, speculative_model=str(path))
    try:
        got = {i: t for i, (t, _) in _run(core, prompts, "s", logits=False).items()}
        snap = core.snapshot()
    finally:
        core.close()
    assert got == want
    assert snap.spec_accepted == snap.spec_drafted >= 3 * len(prompts)


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"quantization": "gguf"}, "--quantization gguf"),
        ({"tensor_parallel_size": 3}, "8 attention heads do not split evenly over 3"),
    ],
)
def test_what_does_not_split_is_refused_at_start(
    checkpoints: dict[str, tuple[Any, Path]], kw: dict[str, Any], says: str
) -> None:
    _, path = checkpoints["llama-8h-4kv"]
    kw = {"tensor_parallel_size": 2, **kw}
    with pytest.raises((ValueError, UnsupportedModelError), match=says):
        EngineCore(EngineConfig(model=str(path), dtype="float32", num_blocks=64, **kw))


def test_a_rank_that_dies_stops_the_engine(checkpoints: dict[str, tuple[Any, Path]]) -> None:
    _, path = checkpoints["llama-8h-4kv"]
    core = _engine(path, 2)
    assert core.ranks is not None
    follower = core.ranks.procs[0]
    try:
        _run(core, _prompts()[:1], "a")
        follower.kill()
        follower.wait()
        core.submit(NewRequest("b", [1, 2, 3], SamplingParams(max_tokens=2)))
        started = time.monotonic()
        with pytest.raises(RankLostError, match="a rank is gone"):
            core.step()
        REPORT["TP: a killed rank noticed by rank 0's next step in"] = (
            f"{time.monotonic() - started:.2f} s"
        )
    finally:
        core.close()
    assert follower.poll() is not None


def test_a_failed_step_on_rank_0_ends_every_rank(
    checkpoints: dict[str, tuple[Any, Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 fails inside a sparse layer while the other ranks wait in its all-to-all:
    the step raises, and close ends them at once (they cannot take the stop message:
    killed, not left to the group's ten-minute timeout nor waited on)."""
    from engine.parallel import dispatch

    _, path = checkpoints["qwen3-moe-8h-4kv"]
    core = _engine(path, 2, expert_parallel_size=2)
    assert core.ranks is not None
    procs = core.ranks.procs

    def fail(*args: Any) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(dispatch, "_unpack", fail)
    try:
        core.submit(NewRequest("x", [1, 2, 3], SamplingParams(max_tokens=2)))
        with pytest.raises(RuntimeError, match="injected"):
            core.step()
    finally:
        started = time.monotonic()
        core.close()
    REPORT["EP: close after rank 0 failed mid-step"] = f"{time.monotonic() - started:.1f} s"
    assert all(p.poll() is not None for p in procs)


def test_close_ends_every_rank(checkpoints: dict[str, tuple[Any, Path]]) -> None:
    _, path = checkpoints["qwen2-8h-2kv"]
    core = _engine(path, 4)
    assert core.ranks is not None
    procs, workdir = core.ranks.procs, core.ranks.workdir
    core.close()
    assert [p.poll() for p in procs] == [0, 0, 0]
    assert not os.path.exists(workdir)


def test_a_lost_rank_ends_the_async_engine(checkpoints: dict[str, tuple[Any, Path]]) -> None:
    """What a worker sees: the running request fails as EngineDeadError, `died()`
    raises it (the roles stop on it: the worker leaves discovery and exits 1), and the
    engine takes no more requests."""
    import asyncio

    from engine.async_engine import AsyncEngine, EngineDeadError

    _, path = checkpoints["llama-8h-4kv"]
    engine = AsyncEngine(_engine(path, 2))
    ranks = engine.core.ranks
    assert ranks is not None

    async def scenario() -> None:
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        stream = await engine.submit(NewRequest("long", list(range(1, 30)), params))
        seen = 0
        with pytest.raises(EngineDeadError, match="a rank is gone"):
            async for out in stream:
                seen += len(out.new_token_ids)
                if seen >= 3 and ranks.procs[0].poll() is None:
                    ranks.procs[0].kill()
        with pytest.raises(EngineDeadError, match="a rank is gone"):
            await asyncio.wait_for(engine.died(), 30)
        assert not engine.alive
        with pytest.raises(EngineDeadError):
            await engine.submit(NewRequest("after", [1, 2], params))

    try:
        asyncio.run(scenario())
    finally:
        engine.close()
    assert all(p.poll() is not None for p in ranks.procs)
