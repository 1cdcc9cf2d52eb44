"""The timing models the simulated engine runs on, and how a spec string names one.

A timing model answers one question: how long does a step over these chunks take,
each chunk being (tokens computed now, tokens already cached before them)? A decode
is (1, its context); a prefill chunk is (its new tokens, its cached prefix). It also
says what is simulated (`model`: context window, KV geometry), how many KV bytes one
token costs there and how many tokens the device's KV memory holds.

    "H200:Llama-3.1-70B:tp8"       a roofline (`roofline.py`) of shipped data;
                                   an optional fourth part names the dtype (float8)
    "path/to/profile.json"         a profile `diptych profile` measured on real hardware
    "instant"                      steps take no time (to find the rest's ceiling)
    "fixed:20ms"                   every step takes 20 ms, whatever is in it (a paced
                                   worker: one token per running request per step)

A measured profile holds prefill seconds over (new tokens, cached tokens), decode-step
seconds over (batch, context per sequence) and, since it is measured too, what a
prefill chunk adds to a decode step it joins, over (new tokens, batch). A step between
grid points is interpolated (linear in each axis; straight lines carry on past the
edges). A mixed step costs its decode part plus, for each prefill chunk, its measured
addition at that batch (and what its cached prefix adds to a lone prefill of that
size); a profile without that grid prices a chunk at its cost above the smallest
measured prompt (one forward pass pays the fixed cost, and a served profile's
per-request overhead, once).
"""

from __future__ import annotations

import bisect
import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from engine.config import ModelConfig
from engine.sim.roofline import Roofline, accelerators, models

PROFILE_KIND = "diptych-profile"
PROFILE_VERSION = 1


class TimingModel(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def model(self) -> ModelConfig: ...

    @property
    def kv_bytes_per_token(self) -> float: ...

    @property
    def jitter_sigma(self) -> float:
        """A step's log-normal spread around `step_s` (0: every step exactly that)."""
        ...

    def kv_capacity_tokens(self) -> int: ...

    def step_s(self, chunks: Sequence[tuple[int, int]]) -> float: ...


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys), extended along the end segments."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
    x0, x1 = xs[i], xs[i + 1]
    return ys[i] + (ys[i + 1] - ys[i]) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class Grid:
    """seconds[i][j] measured at (xs[i], ys[j]); both axes strictly increasing."""

    xs: tuple[float, ...]
    ys: tuple[float, ...]
    seconds: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        for axis in (self.xs, self.ys):
            if not axis or any(b <= a for a, b in itertools.pairwise(axis)):
                raise ValueError(f"a profile grid axis must be non-empty, increasing: {axis}")
        if len(self.seconds) != len(self.xs) or any(len(r) != len(self.ys) for r in self.seconds):
            raise ValueError("a profile grid's seconds must be len(xs) rows of len(ys)")

    def at(self, x: float, y: float) -> float:
        column = [_interp(self.ys, row, y) for row in self.seconds]
        return max(_interp(self.xs, column, x), 0.0)

    @classmethod
    def from_dict(cls, d: dict[str, Any], x: str, y: str, values: str = "seconds") -> Grid:
        return cls(tuple(d[x]), tuple(d[y]), tuple(tuple(r) for r in d[values]))


@dataclass(frozen=True)
class ProfileTiming:
    """Step times measured by `diptych profile` (see the module docstring)."""

    name: str
    model: ModelConfig
    kv_bytes_per_token: float
    capacity_tokens: int
    prefill: Grid  # (new tokens, cached tokens) -> seconds
    decode: Grid  # (batch, context per sequence) -> seconds
    meta: dict[str, Any]
    mixed: Grid | None = None  # (new tokens, batch) -> seconds added to a decode step
    jitter_sigma: float = 0.0  # a profile's grid holds medians; no spread is recorded

    def kv_capacity_tokens(self) -> int:
        return self.capacity_tokens

    def step_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        if not chunks or any(new < 1 or ctx < 0 for new, ctx in chunks):
            raise ValueError("a step needs at least one chunk, each with new >= 1, context >= 0")
        decodes = [ctx for new, ctx in chunks if new == 1]
        if decodes and self.mixed is not None:
            batch = len(decodes)
            base = self.decode.at(batch, sum(decodes) / batch)
            for new, ctx in chunks:
                if new > 1:
                    cached = self.prefill.at(new, ctx) - self.prefill.at(new, 0)
                    base += max(self.mixed.at(new, batch) + cached, 0.0)
            return base
        prefills = [self.prefill.at(new, ctx) for new, ctx in chunks if new > 1]
        # one pass pays the fixed cost once: every prefill chunk after the first part
        # adds only its cost above the smallest measured prompt's
        fixed = self.prefill.at(self.prefill.xs[0], self.prefill.ys[0])
        if decodes:
            base = self.decode.at(len(decodes), sum(decodes) / len(decodes))
        else:
            base, prefills = prefills[0], prefills[1:]
        return base + sum(max(p - fixed, 0.0) for p in prefills)

    @classmethod
    def load(cls, path: str | Path) -> ProfileTiming:
        doc = json.loads(Path(path).read_text())
        if doc.get("kind") != PROFILE_KIND or doc.get("version") != PROFILE_VERSION:
            raise ValueError(f"{path} is not a version-{PROFILE_VERSION} diptych profile")
        m = dict(doc["model"])
        m["eos_token_ids"] = tuple(m.get("eos_token_ids", ()))
        m["dense_layers"] = tuple(m.get("dense_layers", ()))
        return cls(
            name=doc.get("name", Path(path).stem),
            model=ModelConfig(**m),
            kv_bytes_per_token=float(doc["kv_bytes_per_token"]),
            capacity_tokens=int(doc["kv_capacity_tokens"]),
            prefill=Grid.from_dict(doc["prefill"], "new_tokens", "cached_tokens"),
            decode=Grid.from_dict(doc["decode"], "batch", "context"),
            meta={k: doc[k] for k in ("machine", "engine", "measured_at") if k in doc},
            mixed=(
                Grid.from_dict(doc["mixed"], "new_tokens", "batch", "extra_seconds")
                if "mixed" in doc
                else None
            ),
        )


def parse_roofline(spec: str) -> Roofline:
    """ "ACCELERATOR:MODEL[:tpN[:DTYPE]]", e.g. "H200:Llama-3.1-70B:tp8"."""
    parts = spec.split(":")
    accs, mods = accelerators(), models()
    if len(parts) < 2 or parts[0] not in accs or parts[1] not in mods:
        raise ValueError(
            f"timing profile {spec!r}: give a profile JSON file or ACCELERATOR:MODEL[:tpN], "
            f"with an accelerator in {sorted(accs)} and a model in {sorted(mods)}"
        )
    tp, dtype = 1, "bfloat16"
    for extra in parts[2:]:
        if extra.startswith("tp") and extra[2:].isdigit():
            tp = int(extra[2:])
        else:
            dtype = extra
    return Roofline(accs[parts[0]], mods[parts[1]], dtype=dtype, tensor_parallel=tp)


@dataclass(frozen=True)
class InstantTiming:
    """`instant`: every step takes no time, so workers emit tokens as fast as the rest
    of the system asks for them (the frontend's ceiling); `fixed:MS`: every step takes
    that long. Llama-3.1-8B's geometry."""

    model: ModelConfig
    name: str = "instant"
    kv_bytes_per_token: float = 64.0
    capacity_tokens: int = 1 << 20
    step_seconds: float = 0.0
    jitter_sigma: float = 0.0

    def kv_capacity_tokens(self) -> int:
        return self.capacity_tokens

    def step_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        return self.step_seconds


def at_tensor_parallel(spec: str, tp: int) -> str:
    """`spec` for a worker of tensor-parallel size `tp`: a roofline that names no size
    gets ":tp<tp>"; one that names a size keeps it (the simulated engine models its size
    in the profile alone), as do measured profiles and the instant ones."""
    if spec == "instant" or spec.startswith("fixed:") or spec.endswith(".json"):
        return spec
    if Path(spec).is_file():
        return spec
    parts = spec.split(":")
    if any(p.startswith("tp") and p[2:].isdigit() for p in parts[2:]):
        return spec
    return ":".join([*parts[:2], f"tp{tp}", *parts[2:]])


def load_timing(spec: str) -> TimingModel:
    """The timing model a `--profile` spec names (see the module docstring)."""
    if spec == "instant":
        return InstantTiming(models()["Llama-3.1-8B"])
    if spec.startswith("fixed:"):
        text = spec.removeprefix("fixed:")
        try:
            ms = float(text.removesuffix("ms"))
        except ValueError:
            raise ValueError(f"--profile {spec!r}: expected fixed:<milliseconds>ms") from None
        if not text.endswith("ms") or not ms > 0:
            raise ValueError(f"--profile {spec!r}: expected fixed:<milliseconds>ms, above 0")
        return InstantTiming(models()["Llama-3.1-8B"], f"fixed:{ms:g}ms", step_seconds=ms / 1e3)
    if spec.endswith(".json") or Path(spec).is_file():
        return ProfileTiming.load(spec)
    return parse_roofline(spec)
