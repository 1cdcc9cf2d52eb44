"""Give Triton's interpreter a `tl.dot` that sums every output element alike, as a
GPU's matrix-multiply instructions do.

The interpreter runs `tl.dot` as numpy's matmul, which calls BLAS: its micro-kernels
sum a row in an order that depends on where the row falls in the tile (rows 3-5 of a
64-row tile differ from rows 0-2 by an ulp here), which compiled kernels never do. The
batch-invariant kernels (`--deterministic`, kernels/triton/matmul.py) rest on the GPU's
property, so their tests on CPU give the interpreter this one: each element the products
over K in order, summed by numpy's reduction over that axis (a fixed order for a given
K), in the accumulator's dtype.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def _dot(self: Any, a: Any, b: Any, d: Any, precision: Any, imprecise: Any) -> Any:
    from triton.runtime.interpreter import TensorHandle

    acc = d.data.dtype
    prod = a.data.astype(acc)[:, :, None] * b.data.astype(acc)[None, :, :]
    return TensorHandle(prod.sum(axis=1, dtype=acc) + d.data, d.dtype.scalar)


@contextmanager
def mma_dot() -> Iterator[None]:
    """Within this block the interpreter's `tl.dot` (2-D, no 8-bit floats) is `_dot`."""
    from triton.runtime.interpreter import InterpreterBuilder

    saved = InterpreterBuilder.create_dot
    install()
    try:
        yield
    finally:
        InterpreterBuilder.create_dot = saved  # type: ignore[method-assign]


def install() -> None:
    """For good, in a process that runs only such kernels (tests/kernels/det_engine_child.py)."""
    from triton.runtime.interpreter import InterpreterBuilder

    InterpreterBuilder.create_dot = _dot  # type: ignore[method-assign]
