"""FP8 checkpoints in the layouts that ship (engine/weights/fp8.py), written by this
test from tiny random models: each loads exactly (its linears kept FP8, the rest as
stored) and generates, in fp32, the greedy tokens of HF transformers running the same
weights dequantized. `--quantization fp8` quantizes a dense checkpoint at load."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine import EngineConfig, EngineCore, NewRequest, SamplingParams
from engine.model_runner import quantized_formats, weight_bytes
from engine.models.moe import SparseMoE
from engine.weights import open_checkpoint, weights_for
from engine.weights.fp8 import fp8_scheme
from kernels.quant import FP8, FP8_MAX, QuantTensor, quantize_fp8
from tests.conftest import REPORT
from tests.engine.test_models_safetensors import _hf_greedy, _write

# layout -> (quantization_config, scale suffix, block or None: per tensor / "channel")
LAYOUTS: dict[str, tuple[dict[str, Any], str, Any]] = {
    "fp8-per-tensor": ({"quant_method": "fp8", "activation_scheme": "static"}, "_scale", None),
    "fp8-block-128": (
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
         "weight_block_size": [128, 128]}, "_scale_inv", (128, 128),
    ),
    "fp8-block-32x64": (
        {"quant_method": "fp8", "weight_block_size": [32, 64]}, "_scale_inv", (32, 64),
    ),
    "compressed-tensors-channel": (
        {"quant_method": "compressed-tensors", "format": "float-quantized",
         "config_groups": {"group_0": {
             "targets": ["Linear"],
             "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                         "symmetric": True, "dynamic": False},
             "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                   "dynamic": True}}},
         "ignore": ["lm_head"]}, "_scale", "channel",
    ),
}


def _quantize(w: torch.Tensor, block: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale) of one weight as a publisher writes them: amax / 448 per tensor,
    per row ("channel") or per block."""
    wf = w.float()
    if block is None:
        scale = wf.abs().amax() / FP8_MAX
        expanded = scale
    elif block == "channel":
        scale = wf.abs().amax(1, keepdim=True) / FP8_MAX
        expanded = scale
    else:
        bn, bk = block
        n, k = wf.shape
        padded = torch.nn.functional.pad(wf, (0, -k % bk, 0, -n % bn))
        tiles = padded.view(padded.shape[0] // bn, bn, -1, bk).abs().amax((1, 3))
        scale = tiles / FP8_MAX
        expanded = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    codes = (wf / expanded).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return codes, scale


def fp8_copy(src: Path, dst: Path, layout: str, shards: int = 1) -> dict[str, torch.Tensor]:
    """Write an FP8 copy of checkpoint `src` (every decoder linear, experts included)
    to `dst`, in `shards` files with an index where more than one (a weight and its
    scale may land in different files); return the dequantized weights."""
    qconfig, suffix, block = LAYOUTS[layout]
    state: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            state.update({k: h.get_tensor(k) for k in h.keys()})  # noqa: SIM118
    out: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        dequantized[name] = w
        linear = name.startswith("model.layers.") and name.endswith(
            ("_proj.weight", "_proj_with_mqa.weight")
        )
        if not (linear or ".experts." in name):
            out[name] = w
            continue
        codes, scale = _quantize(w, block)
        out[name], out[name + suffix] = codes, scale.contiguous()
        if block is None:  # static activation scales ride along; we do not need them
            out[name.replace(".weight", ".input_scale")] = torch.tensor(0.02)
        dequantized[name] = open_scheme(qconfig).dense(codes, scale)
    dst.mkdir(parents=True)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = qconfig
    (dst / "config.json").write_text(json.dumps(config))
    names = list(out)
    if shards == 1:
        save_file(out, str(dst / "model.safetensors"))
        return dequantized
    weight_map = {}
    for i in range(shards):  # round robin: scales away from their weights
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: out[n] for n in names[i::shards]}
        save_file(part, str(dst / file))
        weight_map.update(dict.fromkeys(part, file))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return dequantized


def open_scheme(qconfig: dict[str, Any]) -> Any:
    scheme = fp8_scheme({"quantization_config": qconfig})
    assert scheme is not None
    return scheme


def _engine_greedy(core: EngineCore, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.submit(NewRequest(str(i), p, params))
    outs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while core.has_unfinished_requests():
        for o in core.step():
            outs[o.request_id] += o.new_token_ids
    assert core.is_idle() and not core.check_invariants()
    return [outs[str(i)] for i in range(len(prompts))]


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 19, 70)]


def _matches_hf(dense: Path, weights: dict[str, torch.Tensor], path: Path,
                **engine: Any) -> EngineCore:  # fmt: skip
    """The engine on `path` gives the greedy tokens of HF transformers loading `weights`
    (saved beside the dense checkpoint `dense`'s config: HF lays a MoE's experts out its
    own way at load)."""
    import transformers

    reference = path.parent / f"{path.name}-reference"
    reference.mkdir()
    (reference / "config.json").write_bytes((dense / "config.json").read_bytes())
    save_file({n: w.contiguous() for n, w in weights.items()},
              str(reference / "model.safetensors"), metadata={"format": "pt"})  # fmt: skip
    hf = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    core = EngineCore(EngineConfig(model=str(path), dtype="float32", num_blocks=64,
                                   max_num_batched_tokens=48, **engine))  # fmt: skip
    prompts = _prompts()
    got = _engine_greedy(core, prompts, 10)
    for p, tokens in zip(prompts, got, strict=True):
        assert tokens == _hf_greedy(hf, p, 10)[0], f"prompt of {len(p)} tokens"
    return core


@pytest.mark.parametrize(("layout", "model"), [
    ("fp8-per-tensor", "llama"), ("fp8-block-128", "qwen3-qknorm"),
    ("fp8-block-32x64", "llama"), ("compressed-tensors-channel", "qwen2-bias"),
    ("fp8-block-32x64", "qwen3-moe"), ("fp8-block-32x64", "deepseek-v3"),
])  # fmt: skip
def test_fp8_checkpoint_matches_transformers_on_its_weights(layout: str, model: str,
                                                            tmp_path: Path) -> None:  # fmt: skip
    _, dense = _write(tmp_path, model, sharded=False)
    fp8 = tmp_path / "fp8"
    weights = fp8_copy(dense, fp8, layout, shards=2 if layout == "fp8-block-32x64" else 1)
    core = _matches_hf(dense, weights, fp8)
    runner = core.runner
    assert quantized_formats(runner.model).startswith("fp8")
    # every decoder linear kept FP8, a mixture's experts too (stacked for the grouped kernel)
    sparse = [m for m in runner.model.modules() if isinstance(m, SparseMoE)]
    assert all(m.fp8 is not None and m.w13.numel() == 0 for m in sparse)
    kept = [n for n, m in runner.model.named_modules() if getattr(m, "quant", ())]
    assert kept and all(m.quant[0].kind == "f8" for m in runner.model.modules()
                        if getattr(m, "quant", ()))  # fmt: skip
    fp8_linears = ("qkv_proj", "o_proj", "kv_b_proj", "kv_a_proj_with_mqa")
    assert all(m.weight.numel() == 0 for n, m in runner.model.named_modules()
               if n.endswith(fp8_linears))  # fmt: skip


def test_fp8_layouts_load_exactly(tmp_path: Path) -> None:
    _, dense = _write(tmp_path, "llama", sharded=False)
    for layout in LAYOUTS:
        weights = fp8_copy(dense, tmp_path / layout, layout)
        ckpt = open_checkpoint(tmp_path / layout)
        kept = dict(weights_for(ckpt, None))
        for name, t in kept.items():
            if isinstance(t, QuantTensor):
                assert t.kind == "f8" and torch.equal(t.dequantize(), weights[name]), name
            else:
                assert torch.equal(t, weights[name]), name
        assert sum(isinstance(t, QuantTensor) for t in kept.values()) == 14  # 7 a layer
        dense_view = dict(ckpt.iter_weights())  # what a tensor-parallel rank cuts
        assert all(torch.equal(dense_view[n], weights[n]) for n in kept)


def test_quantizing_a_dense_checkpoint_at_load(tmp_path: Path) -> None:
    _, dense = _write(tmp_path, "llama", sharded=False)
    state = dict(open_checkpoint(dense).iter_weights())
    weights = {n: quantize_fp8(w).dequantize() if n.startswith("model.layers.")
               and n.endswith("_proj.weight") else w for n, w in state.items()}  # fmt: skip
    core = _matches_hf(dense, weights, dense, quantization="fp8")
    assert quantized_formats(core.runner.model) == "fp8"
    plain = EngineCore(EngineConfig(model=str(dense), dtype="float32", num_blocks=16))
    linear = sum(w.numel() for n, w in state.items() if n.endswith("_proj.weight"))
    saved = weight_bytes(plain.runner.model) - weight_bytes(core.runner.model)
    # fp32 linears (4 bytes a weight) became one byte and a scale a row
    assert saved == pytest.approx(3 * linear, rel=0.02)
    REPORT["tiny llama --quantization fp8: linear bytes saved vs fp32"] = f"{saved}"


def test_what_is_not_an_fp8_checkpoint_is_refused(tmp_path: Path) -> None:
    assert fp8_scheme({}) is None
    with pytest.raises(ValueError, match="'awq' is not supported"):
        fp8_scheme({"quantization_config": {"quant_method": "awq"}})
    with pytest.raises(ValueError, match="e5m2"):
        fp8_scheme({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}})
    with pytest.raises(ValueError, match="pack-quantized"):
        fp8_scheme({"quantization_config": {"quant_method": "compressed-tensors",
                                            "format": "pack-quantized"}})  # fmt: skip
    with pytest.raises(ValueError, match="weight_block_size"):
        fp8_scheme({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}})
    _, dense = _write(tmp_path, "llama", sharded=False)
    fp8 = tmp_path / "fp8"
    fp8_copy(dense, fp8, "fp8-per-tensor")
    config = json.loads((fp8 / "config.json").read_text())
    del config["quantization_config"]
    (fp8 / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no quantization_config"):
        list(open_checkpoint(fp8).iter_weights())


def test_a_mixture_of_experts_quantized_at_load_keeps_its_experts_fp8(tmp_path: Path) -> None:
    """`--quantization fp8` on a Qwen3-MoE: the experts too, one byte a weight (and a
    scale a row), matching transformers on the same weights dequantized."""
    _, dense = _write(tmp_path, "qwen3-moe", sharded=False)
    state = dict(open_checkpoint(dense).iter_weights())
    linear = [n for n in state if n.startswith("model.layers.") and n.endswith("_proj.weight")]
    weights = {n: quantize_fp8(w).dequantize() if n in linear else w for n, w in state.items()}
    core = _matches_hf(dense, weights, dense, quantization="fp8")
    plain = EngineCore(EngineConfig(model=str(dense), dtype="float32", num_blocks=16))
    saved = weight_bytes(plain.runner.model) - weight_bytes(core.runner.model)
    experts = sum(state[n].numel() for n in linear if ".experts." in n)
    assert experts and saved > 3 * experts * 0.95  # fp32 experts: 4 bytes a weight to ~1


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_tensor_parallel_rank_cuts_fp8_codes_exactly(layout: str, tmp_path: Path) -> None:
    """Each rank's shard of an FP8 checkpoint at TP 2 is cut out of the published codes
    and scales, so it holds exactly the dequantized weights' shard, where the scales
    allow: always per tensor and per channel, and for blocks that fall whole on one
    side of the cut; a block shared by two ranks is quantized again per channel."""
    from engine.parallel.shard import TpShard
    from engine.weights.fp8 import Fp8Published

    _, dense = _write(tmp_path, "llama", sharded=False)
    weights = fp8_copy(dense, tmp_path / "fp8", layout)
    ckpt = open_checkpoint(tmp_path / "fp8")
    published = dict(ckpt.iter_weights_published())
    exact = recut = 0
    for rank in range(2):
        shard = TpShard(ckpt.config, rank, 2)
        for name, t in shard.weights(published.items()):
            want = shard.shard(name, weights[name])
            if not isinstance(published[name], Fp8Published):
                assert torch.equal(t, want), name
                continue
            assert isinstance(t, QuantTensor) and t.kind == "f8"
            got = t.dequantize()[:, : want.shape[1]]
            if torch.equal(got, want):
                exact += 1
            else:  # re-quantized: within e4m3's rounding of the row's largest value
                recut += 1
                assert (got - want).abs().max() <= want.abs().max() / 8, name
    REPORT[f"FP8 {layout} at TP 2: linear shards cut exactly / re-quantized"] = (
        f"{exact} / {recut}"
    )
    if layout in ("fp8-per-tensor", "compressed-tensors-channel"):
        assert recut == 0 and exact == 2 * 14
    elif layout == "fp8-block-32x64":  # 32-row blocks split with the heads, some 64-wide not
        assert exact > 0 and recut > 0
    else:  # 128x128 blocks: the tiny model's weights are one block, shared by both ranks
        assert exact == 0


def test_an_fp8_checkpoint_at_tp2_matches_transformers(tmp_path: Path) -> None:
    """Per-tensor scales cut exactly: two ranks hold the published weights between them,
    and generate HF transformers' greedy tokens on those weights dequantized."""
    _, dense = _write(tmp_path, "llama", sharded=False)
    fp8 = tmp_path / "fp8"
    weights = fp8_copy(dense, fp8, "fp8-per-tensor")
    core = _matches_hf(dense, weights, fp8, tensor_parallel_size=2, threads=1)
    try:
        assert quantized_formats(core.runner.model).startswith("fp8")
    finally:
        core.close()
