"""bf16 on CPU: linears above the GEMV's few rows read a copy of the weight packed once
at load: oneDNN's on AMX, our VNNI layout (AVX512-BF16; oneDNN's for shapes VNNI does not
take there), or our fp32-arithmetic layout (every other CPU)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.llama import Linear
from kernels import cpu_ops

if not cpu_ops.weight_prepack_available(torch.bfloat16):
    pytest.skip("no packed bf16 linear on this machine", allow_module_level=True)


def _pack(w: torch.Tensor, kind: str) -> cpu_ops.PackedWeight:
    if kind == "vnni" and not cpu_ops._vnni_available():
        pytest.skip("no AVX512-BF16 GEMM in this build")
    if kind == "amx" and not cpu_ops.amx_gemm_available():
        pytest.skip("no AMX tiles here (or the level is forced below amx)")
    if kind == "onednn" and not cpu_ops.onednn_bf16_available():
        pytest.skip("oneDNN has no bf16 instructions to use here")
    if kind != "onednn" and not cpu_ops.cpu_ops_available():
        pytest.skip("no C++ CPU ops")
    n = w.shape[0]
    if kind in ("vnni", "amx"):
        return cpu_ops.PackedWeight(torch.ops.diptych_cpu.pack_vnni(w), kind, n)
    if kind == "f32acc":
        return cpu_ops.PackedWeight(torch.ops.diptych_cpu.pack_f32acc(w), "f32acc", n)
    return cpu_ops.PackedWeight(torch.ops.mkldnn._reorder_linear_weight(w, 64), "onednn", n)


@pytest.mark.parametrize("rows", [1, 4, 13, 64, 256])
@pytest.mark.parametrize("kind", ["vnni", "amx", "onednn", "f32acc"])
def test_packed_linear_matches_the_plain_linear(rows: int, kind: str) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(960, 576, generator=g).bfloat16()
    bias = torch.randn(960, generator=g).bfloat16()
    wide = torch.randn(rows, 701, generator=g).bfloat16()
    x = wide[:, 51:627]  # a strided view at an odd offset, as slices of a fused output
    packed = _pack(w, kind)
    for b in (None, bias):
        got = cpu_ops.packed_linear(x, packed, b)
        want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
        assert got.shape == want.shape and got.dtype == torch.bfloat16
        # bf16 output: within a couple of ulps of the fp32 product
        assert ((got.float() - want).abs() <= 2**-7 * want.abs() + 1e-2).all()
    three_d = cpu_ops.packed_linear(
        x.reshape(2, rows // 2, 576) if rows % 2 == 0 else x[None], packed, None
    )
    assert (
        three_d.reshape(-1, 960)
        .float()
        .sub(cpu_ops.packed_linear(x, packed, None).float())
        .abs()
        .max()
        == 0
    )


@pytest.mark.parametrize("n,k", [(40, 64), (17, 33), (1000, 7)])
@pytest.mark.parametrize("rows", [1, 7, 50])
def test_f32acc_takes_any_shape(n: int, k: int, rows: int) -> None:
    """Columns past the last full block are zero-padded in the layout and never written."""
    g = torch.Generator().manual_seed(n + k + rows)
    w = torch.randn(n, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    packed = _pack(w, "f32acc")
    got = cpu_ops.packed_linear(x, packed, bias, fp32_out=True)
    want = torch.nn.functional.linear(x.float(), w.float(), bias.float())
    assert got.shape == (rows, n)
    assert (got - want).abs().max() <= 1e-4 * (1 + want.abs().max())
    assert torch.equal(cpu_ops.packed_linear(x, packed, bias), got.bfloat16())


@pytest.mark.parametrize("rows", [5, 40])
def test_fp32_out_is_the_unrounded_sum(rows: int) -> None:
    """The head asks for fp32 logits: rounding them to bf16 first creates ties."""
    g = torch.Generator().manual_seed(9)
    w = torch.randn(4096, 576, generator=g).bfloat16()
    x = torch.randn(rows, 576, generator=g).bfloat16()
    packed = cpu_ops.pack_linear_weight(w, fp32_sums=True)
    # the head's layout, also on AMX: our AMX GEMM there
    assert packed.kind == ("amx" if cpu_ops.amx_gemm_available() else packed.kind)
    assert packed.kind != "onednn"
    ref = torch.nn.functional.linear(x.float(), w.float())
    wide = cpu_ops.packed_linear(x, packed, None, fp32_out=True)
    assert wide.dtype == torch.float32
    assert (wide - ref).abs().max() <= 1e-3 * ref.abs().max()
    assert torch.equal(wide.bfloat16(), cpu_ops.packed_linear(x, packed, None))


def test_shapes_the_vnni_gemm_cannot_take_get_another_layout() -> None:
    w = torch.randn(40, 64).bfloat16()  # 40 columns: not a multiple of 32
    packed = cpu_ops.pack_linear_weight(w)
    assert packed.kind == ("onednn" if cpu_ops.onednn_bf16_available() else "f32acc")
    x = torch.randn(8, 64).bfloat16()
    want = torch.nn.functional.linear(x, w)
    assert (cpu_ops.packed_linear(x, packed, None).float() - want.float()).abs().max() <= 0.1


@pytest.mark.parametrize("kind", ["vnni", "amx", "f32acc"])
def test_the_gemm_refuses_a_mismatched_input(kind: str) -> None:
    packed = _pack(torch.randn(64, 96).bfloat16(), kind)
    with pytest.raises(RuntimeError, match="columns"):
        cpu_ops.packed_linear(torch.randn(4, 98).bfloat16(), packed, None)


def _prefill_logits(llm: LLM) -> torch.Tensor:
    """Logits of the first token of 4 x 8 prompts, each 8 prefilled together (about
    160 rows, so every linear takes the packed path; the head runs on 8 rows). One
    group's error can be several times another's (a near-chaotic prompt), so a
    comparison of two paths' errors needs several."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, output_logits=True)
    logits = []
    for g in range(4):
        prompts = [[1 + (7 * i + 3 * j + 11 * g) % 4000 for j in range(5 + 3 * i)]
                   for i in range(8)]  # fmt: skip
        logits += [o.logits[0] for o in llm.generate(prompts, params)]
    return torch.stack(logits)


def test_engine_prepacks_and_computes_the_same_logits(make_llm: Callable[..., LLM]) -> None:
    on = make_llm(dtype="bfloat16")
    off = make_llm(dtype="bfloat16", cpu_weight_prepack=False)
    on_model, off_model = on.engine.runner.model, off.engine.runner.model
    linears = [m for m in on_model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None for m in linears)
    for m in linears:  # a layout that serves every row count replaces the plain weight
        assert (m.weight.numel() == 0) == m.packed.serves_all_rows
        assert m.packed.serves_all_rows == (m.packed.kind == "f32acc")
    assert on_model.packed_head is not None  # SmolLM2 ties its head to the embedding
    assert all(m.packed is None for m in off_model.modules() if isinstance(m, Linear))
    ref = _prefill_logits(make_llm(dtype="float32"))
    packed, plain = _prefill_logits(on), _prefill_logits(off)
    # The two bf16 paths sum in different orders, so they differ by bf16 rounding
    # (greedy picks can flip on near-ties); the packed one is no further from fp32.
    assert (packed - plain).abs().max() <= 0.1 * ref.abs().max()
    assert (packed - ref).abs().mean() <= 1.25 * (plain - ref).abs().mean()
