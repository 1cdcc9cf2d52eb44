"""Record the Triton launches a launcher makes, without running them: each kernel is
swapped for a recorder while the launcher runs on CPU tensors, so it does its host-side
checks and picks its tile shapes exactly as on a GPU. `engine.triton_warm` compiles
the recorded launches into Triton's cache (an image build); the compile check in the
tests lowers them for each GPU target."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Launch = tuple[Any, tuple[Any, ...], dict[str, Any]]  # (JITFunction, args, kwargs)

# (module, attribute) of every kernel the launchers launch
KERNELS = (
    ("attention", "unified_attention_kernel"),
    ("split_decode", "split_decode_kernel"),
    ("split_decode", "split_reduce_kernel"),
    ("kv_store", "store_kv_kernel"),
    ("block_copy", "copy_blocks_kernel"),
    ("norm", "rms_norm_kernel"),
    ("rotary", "rotary_kernel"),
    ("activation", "silu_and_mul_kernel"),
    ("quant_linear", "quant_linear_kernel"),
    ("fused_moe", "grouped_gemm_kernel"),
    ("lora", "lora_shrink_kernel"),
    ("lora", "lora_expand_kernel"),
    ("matmul", "batch_invariant_matmul_kernel"),
)


class Recorder:
    """Stands in for a JITFunction: `kernel[grid](*args, **kw)` records the call."""

    def __init__(self, fn: Any, calls: list[Launch]) -> None:
        self.fn, self.calls = fn, calls

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def record(*args: Any, **kwargs: Any) -> None:
            self.calls.append((self.fn, args, kwargs))

        return record


def record(launch: Callable[[], object]) -> list[Launch]:
    """The kernel launches `launch()` makes, none of them run."""
    import importlib

    mods = [importlib.import_module(f"kernels.triton.{m}") for m, _ in KERNELS]
    real = [getattr(mod, name) for mod, (_, name) in zip(mods, KERNELS, strict=True)]
    calls: list[Launch] = []
    for mod, (_, name), fn in zip(mods, KERNELS, real, strict=True):
        setattr(mod, name, Recorder(fn, calls))
    try:
        launch()
    finally:
        for mod, (_, name), fn in zip(mods, KERNELS, real, strict=True):
            setattr(mod, name, fn)
    return calls
