"""The decode step's layers in one C++ call (`engine/models/llama.py`): every
logit equals the Python layer loop's, bit for bit, across the model shapes, weight
formats (quantized, dense, a mix) and cache formats it takes, and the models it
cannot take keep the loop."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine import EngineConfig, SamplingParams
from engine.engine_core import EngineCore, NewRequest
from engine.models.llama import DecodeStack, build_decode_stack
from engine.weights import default_model_path
from kernels import cpu_ops, ops
from tests.engine.test_quantized_model import _encode
from tests.engine.test_weights_gguf import tiny_model, write_gguf

pytestmark = pytest.mark.skipif(
    not cpu_ops.cpu_ops_available(), reason="the C++ CPU ops did not build"
)


def _run(core: EngineCore, prompts: list[list[int]], n: int, **extra: Any) -> dict[str, Any]:
    params = SamplingParams(
        temperature=0, max_tokens=n, ignore_eos=True, output_logits=True, **extra
    )
    for i, p in enumerate(prompts):
        core.submit(NewRequest(str(i), p, params))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    logits: dict[str, list[torch.Tensor]] = {str(i): [] for i in range(len(prompts))}
    while core.has_unfinished_requests():
        for o in core.step():
            tokens[o.request_id] += o.new_token_ids
            logits[o.request_id] += o.new_logits or []
    assert core.is_idle() and not core.check_invariants()
    return {"tokens": tokens, "logits": {k: torch.stack(v) for k, v in logits.items()}}


def _stack(core: EngineCore) -> DecodeStack | None:
    stack: DecodeStack | None = core.runner.model.model.decode_stack
    return stack


def _with_and_without(core: EngineCore, prompts: list[list[int]], n: int, **extra: Any) -> None:
    stack = _stack(core)
    assert stack is not None
    fused = _run(core, prompts, n, **extra)
    assert stack.steps > 0
    core.runner.model.model.decode_stack = None
    try:
        loop = _run(core, prompts, n, **extra)
    finally:
        core.runner.model.model.decode_stack = stack
    assert fused["tokens"] == loop["tokens"]
    for k, v in loop["logits"].items():
        assert torch.equal(fused["logits"][k], v), k


def _config(model: Path, dtype: str, **extra: Any) -> EngineConfig:
    # no prefix cache: the second run of the prompts must compute them as the first did
    # (a chunk over a cached prefix attends through other kernels than a whole prompt)
    extra.setdefault("num_blocks", 64)
    extra.setdefault("quantization", "gguf")
    return EngineConfig(model=str(model), dtype=dtype, enable_prefix_caching=False, **extra)


@pytest.fixture(scope="module")
def gguf_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny GGUFs of mixed block types (q/k/v in two layouts: a linear of two parts)."""
    out = tmp_path_factory.mktemp("stack")
    shapes = dict(hidden_size=256, intermediate_size=512, vocab_size=264)
    return {
        "llama": write_gguf(out / "llama.gguf", tiny_model("llama", **shapes), "llama", _encode),
        # q/k/v bias
        "qwen2": write_gguf(out / "qwen2.gguf", tiny_model("qwen2", **shapes), "qwen2", _encode),
        # a sliding window shorter than the sequences
        "mistral": write_gguf(
            out / "mistral.gguf", tiny_model("mistral", sliding_window=8, **shapes), "mistral",
            _encode, extra=lambda w: w.add_sliding_window(8),
        ),
    }  # fmt: skip


PROMPTS = [[5, 9, 17, 33, 2 + i, 40, 41] * (1 + i) for i in range(3)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stack_equals_the_layer_loop(gguf_models: dict[str, Path], arch: str, dtype: str) -> None:
    core = EngineCore(_config(gguf_models[arch], dtype))
    _with_and_without(core, PROMPTS, 12)


@pytest.mark.parametrize(
    ("arch", "quantization", "kv"),
    [("llama", None, "auto"), ("llama", "gguf", "auto"), ("mistral", None, "auto"),
     ("mistral", "gguf", "auto"), ("llama", None, "int8"), ("llama", None, "fp8")],
)  # fmt: skip
def test_deterministic_stack_equals_the_layer_loop(
    gguf_models: dict[str, Path], arch: str, quantization: str | None, kv: str
) -> None:
    """--deterministic: the fixed-order packed linears (or the integer dot kernel) and
    the batch-invariant attention (over a bf16, int8 or fp8 cache), at any row count; a
    one-token prompt's step too."""
    core = EngineCore(_config(gguf_models[arch], "bfloat16", quantization=quantization,
                              deterministic=True, kv_cache_dtype=kv))  # fmt: skip
    stack = _stack(core)
    assert stack is not None and stack.deterministic and stack.max_rows > 64
    _with_and_without(core, [*PROMPTS, [3, 4, 5, 6], [11]], 8)


# Q5_1 and Q5_K are dequantized at load: a mixed model's dense linears run the GEMV
DENSE_PARTS = {"v_proj": Q.Q5_1, "down_proj": Q.Q5_K, "q_proj": Q.Q4_0, "k_proj": Q.Q4_0,
               "o_proj": Q.Q4_1, "gate_proj": Q.Q8_0, "up_proj": Q.Q8_0,
               "embed_tokens": Q.Q8_0, "lm_head": Q.Q8_0}  # fmt: skip


@pytest.mark.parametrize("quantization", [None, "gguf"])
def test_dense_and_mixed_linears(tmp_path: Path, quantization: str | None) -> None:
    model = tiny_model("qwen2", hidden_size=256, intermediate_size=512, vocab_size=264)
    path = write_gguf(tmp_path / "mixed.gguf", model, "qwen2",
                      lambda n, w: _encode(n, w, DENSE_PARTS))  # fmt: skip
    core = EngineCore(_config(path, "float32", quantization=quantization))
    layer = core.runner.model.model.layers[0]
    dense = [lin.quant == () for lin in (layer.self_attn.qkv_proj, layer.mlp.down_proj,
                                          layer.self_attn.o_proj)]  # fmt: skip
    assert dense == [True, True, quantization is None]
    stack = _stack(core)
    assert stack is not None and stack.max_rows == ops.QUANT_DOT_MAX_ROWS
    # four decodes at once: dense linears past the GEMV's rows run torch's linear
    _with_and_without(core, [*PROMPTS, [3, 4, 5, 6]], 8)


def test_a_packed_dense_weight_runs_its_gemm_in_the_stack(tmp_path: Path) -> None:
    """bf16 dense weights with their packed copies (the default): the GEMV up to its
    rows, then our GEMM on the packed copy, as `ops.linear` runs them; oneDNN's copy
    (AMX) is not in the op, so there the stack stops at the GEMV's rows."""
    path = write_gguf(tmp_path / "dense.gguf", tiny_model("llama", hidden_size=256,
                      intermediate_size=512, vocab_size=264), "llama")  # fmt: skip
    core = EngineCore(_config(path, "bfloat16", quantization=None))
    if not core.runner.prepacked:
        pytest.skip("no packed bf16 weights on this CPU")
    stack = _stack(core)
    packed = core.runner.model.model.layers[0].self_attn.qkv_proj.packed
    assert packed is not None and stack is not None
    if packed.kind == "onednn":
        assert 1 <= stack.max_rows == packed.gemv_rows
    else:  # the VNNI GEMM up to its rows; the fp32-sum one (no plain weight) at any
        assert stack.max_rows == (packed.max_rows or 1 << 30) > 8
    _with_and_without(core, PROMPTS[:1], 8)  # batch 1: the GEMV (VNNI) or the GEMM
    steps = stack.steps
    many = [*PROMPTS, [3, 4, 5, 6], [8, 9], [10, 11, 12]]  # 6 rows: past the GEMV's
    if packed.kind == "onednn":
        _run(core, many, 4)
        assert stack.steps == steps
    else:
        _with_and_without(core, many, 6)


@pytest.mark.parametrize("kv", ["auto", "int8", "fp8"])
def test_stack_with_drafts_and_quantized_cache(gguf_models: dict[str, Path], kv: str) -> None:
    # a repeating prompt: prompt lookup drafts, and the verify rows are decode rows
    core = EngineCore(_config(gguf_models["llama"], "float32", kv_cache_dtype=kv))
    prompts = [[7, 8, 9, 10, 11, 12] * 4, [20, 21, 22, 23] * 5]
    _with_and_without(core, prompts, 16, num_speculative_tokens=3)


def test_default_model_greedy_is_unchanged() -> None:
    core = EngineCore(_config(default_model_path(), "bfloat16", num_blocks=128))
    _with_and_without(core, [[1, 504, 3458, 282, 4649, 314, 216], [1, 2683, 5]], 10)


def test_models_the_op_cannot_take_keep_the_loop(
    gguf_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    quant = EngineCore(_config(gguf_models["llama"], "float32"))
    runner = quant.runner
    assert _stack(quant) is not None
    layers = runner.model.model.layers
    monkeypatch.setenv("DIPTYCH_DECODE_STACK", "0")
    assert build_decode_stack(layers, runner.attn_backend, runner.device) is None
    monkeypatch.delenv("DIPTYCH_DECODE_STACK")
    assert build_decode_stack(layers, runner.attn_backend, torch.device("meta")) is None
    layers[1].self_attn.qk_norm = True
    assert build_decode_stack(layers, runner.attn_backend, runner.device) is None
