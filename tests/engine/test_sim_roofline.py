"""The roofline timing model of the simulated engine: shipped data, and the shape of
step time over batch, context, prompt length, cached prefix and tensor parallelism."""

from __future__ import annotations

import pytest

from engine.sim.roofline import Roofline, accelerators, models

ACC = accelerators()
MODELS = models()


def test_the_shipped_data() -> None:
    assert {"H100", "H200", "A100", "L40S"} <= set(ACC)
    published = {"Llama-3.1-8B": 8.03e9, "Llama-3.1-70B": 70.6e9,
                 "Qwen2.5-7B": 7.62e9, "Qwen2.5-72B": 72.7e9}  # fmt: skip
    for name, params in published.items():
        assert MODELS[name].num_params() == pytest.approx(params, rel=0.01), name
    assert ACC["H200"].hbm_bytes_per_s > ACC["H100"].hbm_bytes_per_s
    # mixtures of experts: the published total and activated parameters (the model cards)
    moe = {"Qwen3-30B-A3B": (30.5e9, 3.3e9), "Qwen3-235B-A22B": (235e9, 22e9),
           "Mixtral-8x7B": (46.7e9, 12.9e9)}  # fmt: skip
    for name, (total, active) in moe.items():
        assert MODELS[name].num_params() == pytest.approx(total, rel=0.01), name
        assert MODELS[name].active_params() == pytest.approx(active, rel=0.02), name


def test_a_mixture_of_experts_reads_the_experts_its_tokens_chose() -> None:
    """Decode of one sequence reads the shared weights and 8 of each layer's 128 experts;
    a large batch reads nearly all of them; compute is priced on the active parameters."""
    r = Roofline(ACC["H100"], MODELS["Qwen3-30B-A3B"], dtype="bfloat16")
    m = r.model
    shared = (m.num_params() - m.num_sparse_layers * 128 * m.expert_params) * 2
    chosen = m.num_sparse_layers * 8 * m.expert_params * 2
    assert r._weights_read(1) == pytest.approx(shared + chosen)
    assert r._weights_read(512) == pytest.approx(r.weight_bytes, rel=1e-3)
    assert r._weights_read(1) < 0.15 * r.weight_bytes
    # against a dense model of the same total size, one sequence decodes several times faster
    dense = Roofline(ACC["H100"], MODELS["Qwen2.5-72B"], tensor_parallel=2, dtype="bfloat16")
    assert r.decode_step_s(1, 1024) < 0.3 * dense.decode_step_s(1, 1024)
    assert r.matmul_params < m.active_params()


def test_deepseek_v3_is_priced_by_its_latent_cache() -> None:
    """DeepSeek-V3 (the model card: 671B total, 37B activated) caches 576 values a token
    and layer (MLA's latent and rotary key), not 128 heads of K and V: 1.4 % of the
    bytes; every GPU holds the latent whole, so TP 8 reads as much KV a token as TP 1."""
    m = MODELS["DeepSeek-V3"]
    assert m.num_params() == pytest.approx(671e9, rel=0.01)
    assert m.active_params() == pytest.approx(37e9, rel=0.02)
    assert m.mla and m.kv_cache_dim == 576 and m.dense_layers == (0, 1, 2)
    r = Roofline(ACC["H200"], m, tensor_parallel=8, dtype="float8")
    assert r.kv_bytes_per_token == 61 * 576
    uncompressed = 61 * 128 * (128 + 64 + 128)
    assert r.kv_bytes_per_token / uncompressed < 0.015
    # absorbed attention: 2 (576 + 512) flops a head and (query, key) pair, 16 heads a GPU
    assert r._attention_flops(1.0) == 2 * 61 * 16 * (576 + 512)
    assert r.decode_step_s(64, 64 * 4096) > r.decode_step_s(1, 4096)


def test_fewer_kv_heads_than_gpus_are_replicated() -> None:
    """Qwen3-30B-A3B's 4 KV heads at TP 8: each GPU holds one, as the engine replicates
    them, so a token's KV per GPU is that of TP 4, not zero."""
    model = MODELS["Qwen3-30B-A3B"]
    tp8 = Roofline(ACC["H100"], model, tensor_parallel=8)
    tp4 = Roofline(ACC["H100"], model, tensor_parallel=4)
    assert tp8.kv_bytes_per_token == tp4.kv_bytes_per_token > 0
    with pytest.raises(ValueError, match="must divide the 4 KV heads or be a multiple"):
        Roofline(ACC["H100"], model, tensor_parallel=6)


def _h200_70b(**kw: object) -> Roofline:
    return Roofline(ACC["H200"], MODELS["Llama-3.1-70B"], tensor_parallel=4, **kw)  # type: ignore[arg-type]


def test_decode_grows_with_batch_and_with_context() -> None:
    r = _h200_70b()
    by_batch = [r.decode_step_s(b, b * 2048) for b in (1, 8, 64, 256, 1024)]
    assert by_batch == sorted(by_batch) and len(set(by_batch)) == len(by_batch)
    by_context = [r.decode_step_s(32, c) for c in (32, 32 * 1024, 32 * 8192, 32 * 32768)]
    assert by_context == sorted(by_context) and len(set(by_context)) == len(by_context)


def test_small_batches_are_bound_by_memory_large_ones_by_compute() -> None:
    r = _h200_70b()
    bw = r.accelerator.hbm_bytes_per_s * r.bandwidth_efficiency
    one = r.decode_step_s(1, 1024) - r._all_reduce_s(1) - r.step_overhead_s
    assert one == pytest.approx((r.weight_bytes + 1025 * r.kv_bytes_per_token) / bw)
    # far past the ridge point, doubling the batch (at short context) doubles the time
    a, b = r.decode_step_s(8192, 8192 * 16), r.decode_step_s(16384, 16384 * 16)
    assert b / a == pytest.approx(2.0, rel=0.02)


def test_prefill_grows_with_the_prompt_and_a_cached_prefix_saves_time() -> None:
    r = _h200_70b()
    times = [r.prefill_s(n) for n in (128, 1024, 4096, 16384)]
    assert times == sorted(times)
    # attention is quadratic: 16k tokens cost more than 4x what 4k do
    assert r.prefill_s(16384) > 4 * r.prefill_s(4096)
    assert r.prefill_s(2048, cached_tokens=2048) < r.prefill_s(4096)
    assert r.prefill_s(2048, cached_tokens=2048) > r.prefill_s(2048)


def test_tensor_parallel_splits_a_memory_bound_step() -> None:
    tp2 = Roofline(ACC["H200"], MODELS["Llama-3.1-70B"], tensor_parallel=2, step_overhead_s=0)
    tp8 = Roofline(ACC["H200"], MODELS["Llama-3.1-70B"], tensor_parallel=8, step_overhead_s=0)
    ratio = tp2.decode_step_s(1, 1024) / tp8.decode_step_s(1, 1024)
    assert 2.5 < ratio < 4.0  # 4x less to read per GPU, less the all-reduces
    # the all-reduces at batch 1 are their latency: 160 of them, ~10 us each
    assert tp8._all_reduce_s(1) == pytest.approx(160 * 10e-6, rel=0.05)
    assert tp8._all_reduce_s(4096) > 4 * tp8._all_reduce_s(1)  # large ones: bandwidth


# vLLM (Sep 2024, 10 prompts at once, 10 steps per streamed chunk), Llama-3.1-70B FP8 on
# 1/2/4/8 H100 SXM: a step once one request is left (batch 1, ~750 tokens of context) is
# its last chunks' time over 10. LambdaLabsML/vllm-benchmark at a4f9f43,
# results/prompt_10/{1,2,4,8}xH100-80GB-SXM/Meta-Llama-3.1-70B-Instruct-FP8_tp{N}_len2048.json
LAMBDA_H100_FP8_BATCH1_MS = {1: 30.5, 2: 18.7, 4: 12.3, 8: 9.26}


def test_the_tp_scan_of_llama_70b_lands_on_published_steps() -> None:
    """The overhead is fitted at TP1; TP 2/4/8 are predictions, each within 15 %."""
    for tp, ms in LAMBDA_H100_FP8_BATCH1_MS.items():
        r = Roofline(ACC["H100"], MODELS["Llama-3.1-70B"], dtype="float8", tensor_parallel=tp)
        assert r.decode_step_s(1, 750) == pytest.approx(ms / 1e3, rel=0.15), tp


def test_what_cannot_run_is_refused() -> None:
    with pytest.raises(ValueError, match="raise tensor_parallel"):
        Roofline(ACC["H100"], MODELS["Llama-3.1-70B"])
    with pytest.raises(ValueError, match="no float8"):
        Roofline(ACC["A100"], MODELS["Llama-3.1-8B"], dtype="float8")
    with pytest.raises(ValueError, match="KV heads"):
        Roofline(ACC["H200"], MODELS["Qwen2.5-7B"], tensor_parallel=3)
    r = Roofline(ACC["L40S"], MODELS["Llama-3.1-8B"])
    with pytest.raises(ValueError):
        r.decode_step_s(4, 2)
    with pytest.raises(ValueError):
        r.prefill_s(0)


def test_llama_70b_on_one_h200_lands_on_published_measurements() -> None:
    """Llama-3.3-70B (Llama-3.1-70B's architecture), FP8 weights, one H200, TensorRT-LLM:
    51.14 tok/s at batch 1 (NVIDIA Technical Blog, "Boost Llama 3.3 70B Inference
    Throughput 3x with NVIDIA TensorRT-LLM Speculative Decoding", Dec 2024), i.e. a
    19.6 ms step; and 442 output tok/s at ISL/OSL 2048/128 under maximum load
    (TensorRT-LLM perf-overview, H200 TP1 FP8), 3.45 prompts/s, so a 2048-token
    prefill takes at most 290 ms and a 4096-token one at most ~580 ms."""
    r = Roofline(ACC["H200"], MODELS["Llama-3.1-70B"], dtype="float8")
    step = r.decode_step_s(1, 1024)
    assert 0.85 * 19.6e-3 < step < 1.16 * 19.6e-3  # vLLM's overhead, over TensorRT-LLM's
    assert r.prefill_s(2048) < 0.290
    assert 0.3 < r.prefill_s(4096) < 0.58
