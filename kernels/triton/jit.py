"""`triton.jit` with types. Triton ships no type information, so to mypy its decorator
is untyped and every kernel an untyped function; these two say what each one is.

Inside a kernel every argument that is not a `tl.constexpr` is a `tl.tensor` (a
pointer or a scalar), and the kernels annotate them so. Triton reads annotations
too: `tl.constexpr` marks compile-time arguments, and a type name such as `int`
would pin an argument to i32 (Triton otherwise picks i32 or i64 from the value at
launch, which strides of pools past 2**31 elements need), so scalars are never
annotated `int` or `float`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar, cast

import triton

F = TypeVar("F", bound=Callable[..., Any])


class Kernel(Protocol):
    """A kernel the host launches: `kernel[grid](*args, **constexprs, num_warps=...)`."""

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., object]: ...


def kernel(fn: Callable[..., None]) -> Kernel:
    """Define a kernel (compiled for the GPU, or run by the interpreter: see
    `kernels.triton`)."""
    return cast(Kernel, triton.jit(fn))


def device_function(fn: F) -> F:
    """Define a function that kernels call (compiled into them); it keeps its Python
    signature for the type checker, but runs only inside a kernel."""
    return cast(F, triton.jit(fn))
