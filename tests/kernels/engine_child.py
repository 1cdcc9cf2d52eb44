"""Run in a fresh process: the greedy tokens and logits of a tiny checkpoint through
the engine, on the kernels `DIPTYCH_KERNELS` selects. The process's kernel selection
is fixed when `kernels.ops` is imported, so a test that wants the whole engine on
other kernels starts one of these.

    python -m tests.kernels.engine_child CHECKPOINT ATTENTION_BACKEND DEVICE OUT.pt
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from engine import EngineConfig, EngineCore, NewRequest, SamplingParams
from kernels import ops


def generate(
    path: Path, backend: str, device: str
) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
    """Two waves of greedy requests; the second shares the first's prompts' prefixes."""
    core = EngineCore(
        EngineConfig(
            model=str(path),
            dtype="float32",
            device=device,
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
            core.submit(NewRequest(f"{wave}.{i}", p, params))
        while core.has_unfinished_requests():
            for o in core.step():
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                logits.setdefault(o.request_id, []).extend(o.new_logits or [])
                cached[o.request_id] = o.num_cached_tokens
    assert core.is_idle() and not core.check_invariants()
    assert cached["1.0"] == cached["1.1"] == 32  # the second wave attends over cached KV
    return tokens, {k: torch.stack(v) for k, v in logits.items()}


def main(argv: list[str]) -> None:
    path, backend, device, out = argv
    tokens, logits = generate(Path(path), backend, device)
    torch.save({"kernels": ops.get_backend(), "tokens": tokens, "logits": logits}, out)


if __name__ == "__main__":
    main(sys.argv[1:])
