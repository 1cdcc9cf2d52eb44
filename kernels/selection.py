"""Which implementation every kernel runs: the one place that decides it.

    backend   CUDA tensors              CPU tensors
    auto      Triton (kernels.triton)   C++ ops (kernels.cpu_ops) when they build
    torch     torch references          torch references
    triton    Triton                    Triton through its interpreter (tests)

A `KernelSelection` is an immutable value: `from_env()` reads `DIPTYCH_KERNELS` (the
process default, `kernels.ops.DEFAULT`, is computed from it once, at import); a test
or an engine that wants another backend builds its own and hands it, wrapped in a
`kernels.ops.Kernels`, to what runs the kernels. It decides per call from the
tensor's device (`path`), and once per engine which attention kernels a step runs
(`attention`), so the attention backend and the ops it calls always agree.

Auto on CUDA without the triton package falls back to the references, with a
warning. Forcing "triton" onto CPU tensors needs TRITON_INTERPRET=1 set before the
kernels are first imported (see `kernels.triton`); otherwise it raises.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType

import torch

from kernels import cpu_ops

log = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "triton")
ATTENTION_BACKENDS = ("auto", "torch", "triton")

# kernels.triton is imported (which defines its kernels) on first use, once per
# process: a fact about this process, like the C++ build, not a setting.
_triton_lock = threading.Lock()
_triton: dict[str, ModuleType | None] = {}


def triton_module() -> ModuleType | None:
    """kernels.triton, imported (and its kernels defined) on first use; None without triton."""
    if "mod" not in _triton:
        with _triton_lock:
            if "mod" not in _triton:
                try:
                    import kernels.triton as kt

                    _triton["mod"] = kt
                except ImportError as e:
                    log.warning("Triton kernels unavailable (%s); CUDA uses the torch path", e)
                    _triton["mod"] = None
    return _triton["mod"]


def triton_available() -> bool:
    """Whether the Triton kernels import (this defines them: see kernels.triton)."""
    return triton_module() is not None


def triton_runs_on(device: torch.device) -> bool:
    """Whether the Triton kernels can take tensors on `device`: CUDA, or any device
    once they were defined for the interpreter."""
    kt = triton_module()
    return kt is not None and (device.type == "cuda" or bool(kt.INTERPRETED))


@dataclass(frozen=True)
class KernelSelection:
    """The kernel backend: "auto" (by device), "torch" (the references everywhere) or
    "triton" (the Triton kernels on every device)."""

    backend: str = "auto"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(
                f"kernel backend must be one of {', '.join(BACKENDS)} "
                f"(DIPTYCH_KERNELS or KernelSelection), got {self.backend!r}"
            )

    @classmethod
    def parse(cls, name: str | None) -> KernelSelection:
        """From a user's spelling: case and spaces do not matter, None means "auto"."""
        return cls((name or "auto").strip().lower())

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> KernelSelection:
        return cls.parse(environ.get("DIPTYCH_KERNELS"))

    def path(self, t: torch.Tensor, arithmetic: bool = True) -> str:
        """Which implementation an op on tensors like `t` runs: "triton", "cpu" (the C++
        ops) or "torch" (the references). `arithmetic`: the op computes on the values
        (the interpreter gets bf16 arithmetic wrong; copies move bits and are exact)."""
        if self.backend == "torch":
            return "torch"
        if self.backend == "triton":
            _require_triton(t, arithmetic)
            return "triton"
        if t.is_cuda:
            return "triton" if triton_available() else "torch"
        if t.device.type == "cpu" and cpu_ops.cpu_ops_available():
            return "cpu"
        return "torch"

    def cpu_only(self, t: torch.Tensor) -> bool:
        """Whether an op with a C++ kernel and no Triton one (argmax, linear) runs it."""
        return self.backend == "auto" and t.device.type == "cpu" and cpu_ops.cpu_ops_available()

    def attention(self, requested: str, device: torch.device) -> str:
        """The attention kernels a step runs for `EngineConfig.attention_backend`
        `requested`: "triton" (the unified paged-attention kernel, one launch per layer)
        or "torch" (the portable ops: decode kernel, SDPA for prompts). "auto" takes
        Triton on CUDA when the kernels import and the backend is not "torch".

        "triton" off CUDA runs only with the kernels forced to Triton (`DIPTYCH_KERNELS
        =triton`) and Triton's interpreter (TRITON_INTERPRET=1): a test configuration,
        slow but exact."""
        if requested == "torch":
            return "torch"
        if requested == "auto":
            if device.type == "cuda" and self.backend != "torch" and triton_available():
                return "triton"
            return "torch"
        if requested == "triton":
            if not triton_available():
                raise ValueError("attention_backend='triton' needs the triton package")
            forced = self.backend == "triton" and triton_runs_on(device)
            if device.type != "cuda" and not forced:
                raise ValueError(
                    f"attention_backend='triton' needs a CUDA device (got {device}); on CPU "
                    "it runs only for tests, with DIPTYCH_KERNELS=triton and TRITON_INTERPRET=1"
                )
            return "triton"
        raise ValueError(
            f"unknown attention backend {requested!r}; available: {', '.join(ATTENTION_BACKENDS)}"
        )


def _require_triton(t: torch.Tensor, arithmetic: bool) -> None:
    kt = triton_module()
    if kt is None:
        raise RuntimeError("the Triton kernel backend needs the triton package")
    if t.device.type != "cuda" and not kt.INTERPRETED:
        raise RuntimeError(
            f"Triton kernels got {t.device.type} tensors: off CUDA they run only in Triton's "
            "interpreter; set TRITON_INTERPRET=1 before kernels.triton is first imported"
        )
    if arithmetic and kt.INTERPRETED and t.dtype == torch.bfloat16:
        raise RuntimeError(
            "Triton's interpreter computes bfloat16 wrongly; use float32 or float16 there"
        )
