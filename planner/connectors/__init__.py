"""EXECUTE: connectors that set a pool's replicas somewhere real.

Every connector has the same three calls. `current` says how many workers a pool has
now (running or starting), so the planner starts from what runs rather than from its
minimum. `scale` is level-triggered: the service
calls it every tick with the target, whatever it called before, so a lost call, a
restarted planner or a hand edit is corrected on the next tick (or, for connectors
that respect hand edits, adopted).
"""

from __future__ import annotations

from typing import Protocol


class Connector(Protocol):
    name: str

    async def current(self, pool: str) -> int | None:
        """The workers `pool` has now, running or starting; None when unknown."""
        ...

    async def scale(self, pool: str, replicas: int) -> None:
        """Make `pool` have `replicas` workers (start or gracefully stop some)."""
        ...

    async def close(self) -> None: ...


class RecordingConnector:
    """Remembers the last target of each pool and every call; scales nothing. The
    test seam, and what dry runs print through."""

    name = "recording"

    def __init__(self) -> None:
        self.targets: dict[str, int] = {}
        self.calls: list[tuple[str, int]] = []

    async def current(self, pool: str) -> int | None:
        return self.targets.get(pool)

    async def scale(self, pool: str, replicas: int) -> None:
        self.calls.append((pool, replicas))
        self.targets[pool] = replicas

    async def close(self) -> None:
        return None


__all__ = ["Connector", "RecordingConnector"]
