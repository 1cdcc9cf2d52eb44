"""Run in a fresh process: one request's greedy tokens and logits through a tiny
checkpoint's engine, alone and in the steps `--deterministic` must not feel (beside
other requests, over its own cached prefix, chunked), on the kernels `DIPTYCH_KERNELS`
selects (the Triton path: interpreted on CPU, compiled on a GPU).

    python -m tests.kernels.det_engine_child CHECKPOINT DEVICE DETERMINISTIC(0|1) OUT.pt
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from engine import EngineConfig, EngineCore, NewRequest, SamplingParams
from kernels import ops

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, output_logits=True)


def _prompts() -> tuple[list[int], list[list[int]]]:
    g = torch.Generator().manual_seed(5)
    target = torch.randint(0, 256, (37,), generator=g).tolist()
    others = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 29, 18)]
    return target, others


def _run(core: EngineCore, prompts: list[list[int]], at: int) -> dict[str, Any]:
    """Prompt `at`'s tokens and logits with the others in the same steps."""
    tokens: dict[str, list[int]] = {}
    logits: dict[str, list[torch.Tensor]] = {}
    for i, p in enumerate(prompts):
        core.submit(NewRequest(str(i), p, GREEDY))
    while core.has_unfinished_requests():
        for o in core.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            logits.setdefault(o.request_id, []).extend(o.new_logits or [])
    assert core.is_idle() and not core.check_invariants()
    return {"tokens": tokens[str(at)], "logits": torch.stack(logits[str(at)])}


def generate(path: Path, device: str, deterministic: bool) -> dict[str, dict[str, Any]]:
    """The target: alone (cold), then beside three others (its prompt cached), then in
    a fresh engine of 16-token chunks without the cache, beside two others."""
    target, others = _prompts()
    base: dict[str, Any] = dict(model=str(path), dtype="float32", device=device,
                                attention_backend="triton", num_blocks=64, block_size=16,
                                deterministic=deterministic)  # fmt: skip
    core = EngineCore(EngineConfig(**base))
    res = {"alone": _run(core, [target], 0)}
    res["batched, cached prefix"] = _run(core, [others[0], others[1], target, others[2]], 2)
    core = EngineCore(EngineConfig(**base, max_num_batched_tokens=16, enable_prefix_caching=False))
    res["chunked, batched"] = _run(core, [others[1], target, others[2]], 1)
    return res


def main(argv: list[str]) -> None:
    path, device, det, out = argv
    if device == "cpu":  # the interpreter, given a GPU's row-alike dot
        from tests.kernels.mma_dot import install

        install()
    res = generate(Path(path), device, det == "1")
    torch.save({"kernels": ops.get_backend(), "results": res}, out)


if __name__ == "__main__":
    main(sys.argv[1:])
