"""kernels.moe: the router's top-k and the grouped expert GEMMs (our C++ grouped linear,
torch's grouped GEMM, the padded batched GEMMs where torch has none, the Triton grouped GEMM of
kernels/triton/fused_moe.py, run by the interpreter here) against a loop over tokens
and their experts, written out one product at a time."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import moe, ops
from tests.kernels.conftest import DEVICE, KT, kernels_for


def _loop(x, w13, w2, weights, ids):  # type: ignore[no-untyped-def]
    i = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e].double() @ x[t].double()
            act = F.silu(h[:i]) * h[i:]
            out[t] += float(weights[t, j]) * (w2[e].double() @ act)
    return out


def _case(t: int, e: int, k: int, skew: bool, dtype: torch.dtype, seed: int):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    h, i = 32, 48  # widths the C++ GEMV takes (multiples of 16)
    x = torch.randn(t, h, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * 0.2).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) * 0.2).to(dtype)
    logits = torch.randn(t, e, generator=g)
    if skew:  # most tokens to expert 0: one group far larger than the others
        logits[:, 0] += 4.0
    weights, ids = moe.route(logits, k, renormalize=True)
    return x, w13, w2, weights, ids


@pytest.fixture(params=["cpp", "grouped_mm", "padded", "triton"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    from kernels import cpu_ops

    if request.param == "cpp" and not cpu_ops.cpu_ops_available():
        pytest.skip("no C++ toolchain to build the CPU ops")
    if request.param != "cpp":
        monkeypatch.setattr(moe, "_cpp_grouped_runs", lambda *a: False)
    if request.param == "padded":
        monkeypatch.setattr(moe, "_grouped_mm_runs", lambda x: False)
    elif request.param == "triton":
        if KT is None:
            pytest.skip("triton is not installed")
        triton_moe = kernels_for("triton").fused_moe

        def on_device(*args: torch.Tensor | int) -> torch.Tensor:  # GPU, or the interpreter
            moved = [a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args]
            return triton_moe(*moved).cpu()  # type: ignore[arg-type]

        monkeypatch.setattr(ops, "fused_moe", on_device)
    else:
        assert moe._grouped_mm_runs(torch.zeros(1)), "torch's grouped GEMM runs on CPU"
    return str(request.param)


@pytest.mark.parametrize("t,e,k,skew", [(1, 8, 2, False), (7, 8, 2, True), (33, 6, 3, False),
                                         (64, 16, 1, True), (5, 4, 4, False)])  # fmt: skip
def test_grouped_experts_equal_the_loop_in_fp32(
    t: int, e: int, k: int, skew: bool, path: str
) -> None:
    args = _case(t, e, k, skew, torch.float32, seed=t * 100 + e)
    got = ops.fused_moe(*args)
    assert got.dtype == torch.float32 and got.shape == args[0].shape
    assert torch.allclose(got.double(), _loop(*args), atol=1e-5, rtol=1e-5)


def test_expert_parallel_ranks_add_up_to_all_experts(path: str) -> None:
    """Each of 4 ranks holds 2 of 8 experts whole (`first`): their outputs, summed as the
    all-reduce sums them, are the whole layer's; a rank none of whose experts is chosen
    gives zeros."""
    x, w13, w2, weights, ids = _case(9, 8, 2, True, torch.float32, seed=5)
    whole = ops.fused_moe(x, w13, w2, weights, ids)
    parts = [ops.fused_moe(x, w13[r:r + 2], w2[r:r + 2], weights, ids, r) for r in (0, 2, 4, 6)]
    assert torch.allclose(sum(parts), whole, atol=1e-5)
    few = ids % 6  # experts 6 and 7 chosen by nobody: their rank adds nothing
    assert not ops.fused_moe(x, w13[6:], w2[6:], weights, few, 6).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_sums_in_fp32(path: str, dtype: torch.dtype) -> None:
    if path == "triton" and dtype == torch.bfloat16 and KT is not None and KT.INTERPRETED:
        pytest.skip("bf16 arithmetic is wrong in the Triton interpreter")
    args = _case(16, 8, 2, False, dtype, seed=3)
    got = ops.fused_moe(*args)
    assert got.dtype == dtype
    want = _loop(*args)
    assert float((got.double() - want).abs().max()) < 0.02 * float(want.abs().max())


def test_no_tokens(path: str) -> None:
    x, w13, w2, weights, ids = _case(3, 4, 2, False, torch.float32, seed=1)
    out = ops.fused_moe(x[:0], w13, w2, weights[:0], ids[:0])
    assert out.shape == (0, x.shape[1])


def test_route_takes_the_top_k_and_renormalizes_when_asked() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 2.9]])
    w, ids = moe.route(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[1, 2], [0, 3]]
    assert torch.allclose(w, probs.gather(1, ids))
    w, _ = moe.route(logits, 2, renormalize=True)
    assert torch.allclose(w.sum(-1), torch.ones(2))
    assert w.dtype == torch.float32  # the router's probabilities stay fp32


@pytest.mark.parametrize(("n_group", "topk_group", "renormalize"), [(4, 2, True), (1, 1, False)])
def test_grouped_sigmoid_route_is_deepseek_v3s(n_group: int, topk_group: int,
                                               renormalize: bool) -> None:  # fmt: skip
    """Against transformers' DeepseekV3TopkRouter on the same logits and bias: the
    experts chosen (as sets) and their weights."""
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = transformers.DeepseekV3Config(
        hidden_size=16, n_routed_experts=16, num_experts_per_tok=4, n_group=n_group,
        topk_group=topk_group, norm_topk_prob=renormalize, routed_scaling_factor=2.5,
    )  # fmt: skip
    router = DeepseekV3TopkRouter(cfg)
    gen = torch.Generator().manual_seed(n_group)
    with torch.no_grad():
        router.weight.normal_(generator=gen)
        router.e_score_correction_bias.normal_(0, 0.3, generator=gen)
    x = torch.randn(12, 16, generator=gen)
    logits, ref_w, ref_ids = router(x)
    w, ids = moe.route_grouped(logits, router.e_score_correction_bias, 4, n_group, topk_group,
                               renormalize, 2.5)  # fmt: skip
    order, ref_order = ids.argsort(-1), ref_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    assert torch.allclose(w.gather(1, order), ref_w.gather(1, ref_order).float(), atol=1e-6)
    if n_group > 1:  # every choice from the kept groups: 2 of 4 groups of 4 experts
        assert all(len(set((ids[t] // 4).tolist())) <= 2 for t in range(12))


@pytest.mark.parametrize("cpp", [True, False])
@pytest.mark.parametrize("t", [1, 9, 40])
def test_fp8_experts_equal_the_loop_on_their_values(
    t: int, cpp: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Experts kept FP8 (`Fp8Experts`, one e4m3 byte a weight): the C++ grouped kernel
    and the per-expert fallback against the loop over the dequantized weights."""
    from kernels import cpu_ops
    from kernels.quant import cat_rows, quantize_fp8

    if cpp and not cpu_ops.cpu_ops_available():
        pytest.skip("no C++ toolchain to build the CPU ops")
    if not cpp:
        monkeypatch.setattr(cpu_ops, "cpu_ops_available", lambda: False)
    x, w13, w2, weights, ids = _case(t, 8, 2, True, torch.float32, seed=t)
    i = w2.shape[2]
    halves = [cat_rows([quantize_fp8(w[:i]), quantize_fp8(w[i:])]) for w in w13]
    q13, q2 = moe.Fp8Experts.stack(halves), moe.Fp8Experts.stack([quantize_fp8(w) for w in w2])
    # a byte a weight and an fp32 scale a row (of 32 values here)
    assert q13.nbytes == w13.numel() * (1 + 4 / 32) and q13.shape == (2 * i, 32)
    d13 = torch.stack([q13.expert(e).dequantize() for e in range(8)])
    d2 = torch.stack([q2.expert(e).dequantize() for e in range(8)])
    got = moe.grouped_experts(x, q13, q2, weights, ids)
    assert torch.allclose(got.double(), _loop(x, d13, d2, weights, ids), atol=1e-5, rtol=1e-5)
    with pytest.raises(TypeError, match="both stacks"):
        moe.grouped_experts(x, q13, w2, weights, ids)
