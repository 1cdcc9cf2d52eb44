"""`diptych serve`'s own settings: how many workers of each pool it starts, and how."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.declare import check_fields, spec


@dataclass(frozen=True)
class ServeOptions:
    prefill_workers: int = spec(1, lo=0, help="prefill workers; 0 runs aggregated")
    decode_workers: int = spec(1, lo=1, help="decode workers")
    prefill_tensor_parallel_size: int | None = spec(
        None, lo=1, hi=1024,
        help="tensor-parallel size of the prefill workers (default: --tensor-parallel-size, "
        "which the decode workers run at); the KV moves between the two splits",
    )  # fmt: skip
    startup_timeout: float = spec(
        300.0, lo=0.0, lo_open=True, help="seconds a process has to start"
    )
    startup_parallelism: int | None = spec(
        None, lo=1, help="workers started at once (default: 2 per CPU, at least 4)"
    )

    def __post_init__(self) -> None:
        check_fields(self)
