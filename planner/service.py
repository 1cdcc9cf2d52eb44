"""The planner process's loop: scrape, observe, tick, execute, record, every interval.

One round of metrics is the baseline; from the second on, each tick compares the
round with the one before. A failed scrape or a failed scale call is logged and
counted (`diptych_planner_errors_total{kind}`) and the loop goes on: a scrape that
fails skips the tick (no decision on half a picture, so no flapping when a metrics
source disappears), a scale that fails is retried by the next tick, which asks for
the same target again (level-triggered).

Under a simulated fleet (`--time-scale s`) the planner's clock runs s times faster,
so its interval, cooldowns and idle timer are in the workers' simulated seconds.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from planner.connectors import Connector
from planner.core import Planner, TickResult
from planner.metrics import PlannerMetrics
from planner.observation import POOLS, Slo
from planner.scrape import observe
from planner.source import Round, RoundSource, pairs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Event:
    """One line of the decision log: a change of a pool's target, or an error."""

    seq: int
    wall: float  # Unix time
    kind: str  # "decision" or an error kind: "scrape", "scale", "tick"
    pool: str
    text: str


@dataclass(frozen=True)
class Tick:
    seq: int
    wall: float  # Unix time
    result: TickResult
    # accelerators x hours the ready workers held since the planner started: each
    # interval, the workers that answered at both its ends, times their accelerators
    accelerator_hours: float = 0.0


class PlannerService:
    def __init__(
        self,
        planner: Planner,
        source: RoundSource,
        connector: Connector | None,
        *,
        interval_s: float = 10.0,
        metrics: PlannerMetrics | None = None,
        history: int = 720,
        time_scale: float = 1.0,
        slo: Slo | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"the planner interval must be above 0 s, got {interval_s}")
        self.planner = planner
        self.source = source
        self.connector = connector
        self.interval_s = interval_s
        self.metrics = metrics or PlannerMetrics()
        self.history: collections.deque[Tick] = collections.deque(maxlen=history)
        self.events: collections.deque[Event] = collections.deque(maxlen=history)
        self.time_scale = time_scale
        self.slo = slo  # what each tick's SLA attainment is measured against
        self.accelerator_hours = 0.0
        self._clock = clock
        self._last: tuple[Round, float] | None = None
        self._seq = 0
        # the last failure of each kind, so a failure repeated every tick is logged
        # once (and again when its message changes), not every interval
        self._failing: dict[tuple[str, str], str] = {}  # (kind, pool) -> message
        self._adopted = False

    def now(self) -> float:
        """Seconds on the planner's clock (simulated seconds under a time scale)."""
        return self._clock() * self.time_scale

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def failed(self, kind: str, pool: str, text: str) -> None:
        self.metrics.errors.labels(kind=kind).inc()
        if self._failing.get((kind, pool)) != text:
            self._failing[kind, pool] = text
            log.warning("planner: %s", text)
            self.events.append(Event(self._next(), time.time(), kind, pool, text))

    def _recovered(self, kind: str, pool: str = "") -> None:
        if self._failing.pop((kind, pool), None) is not None:
            text = f"{kind} of {pool} works again" if pool else f"{kind} works again"
            log.info("planner: %s", text)
            self.events.append(Event(self._next(), time.time(), kind, pool, text))

    async def tick_once(self) -> TickResult | None:
        now = self.now()
        try:
            current = await self.source.scrape()
        except Exception as e:
            self.failed("scrape", "", f"skipping this tick, metrics unreadable: {e}")
            return None
        self._recovered("scrape")
        last, self._last = self._last, (current, now)
        if last is None:
            return None  # the first round is the baseline
        previous, then = last
        if not self._adopted:
            await self._adopt()
        obs = observe(now, now - then, (previous.frontend, current.frontend),
                      pairs(previous, current), self.slo)  # fmt: skip
        result = self.planner.tick(obs)
        self.metrics.record(result)
        wall = time.time()
        held = sum(obs.ready_in(p) * self.planner.limits.of(p).cost for p in POOLS)
        self.accelerator_hours += held * (now - then) / 3600
        self.history.append(Tick(self._next(), wall, result, self.accelerator_hours))
        for d in result.decisions:
            if d.changed or d.first:
                text = f"{d.previous} -> {d.target}: {d.reason}"
                if self.planner.dry_run:
                    text = "(dry run) " + text
                log.info("planner: %s %s", d.pool, text)
                self.events.append(Event(self._next(), wall, "decision", d.pool, text))
        if self.connector is not None and not self.planner.dry_run:
            for d in result.decisions:
                try:
                    await self.connector.scale(d.pool, d.target)
                except Exception as e:
                    # a connector may say what kind of refusal it is (a hand edit)
                    kind = str(getattr(e, "kind", "scale"))
                    self.failed(kind, d.pool, f"scaling {d.pool} to {d.target}: {e}")
                else:
                    for kind, pool in [k for k in self._failing if k[1] == d.pool]:
                        self._recovered(kind, pool)
        return result

    async def _adopt(self) -> None:
        """Before the first decision: start from the sizes the connector runs (workers
        starting included), not from the pools' minimums."""
        self._adopted = True
        if self.connector is None:
            return  # the first tick adopts the replicas ready
        sizes: dict[str, int] = {}
        for pool in POOLS:
            try:
                n = await self.connector.current(pool)
            except Exception as e:
                self.failed("scale", pool, f"reading {pool}'s size: {e}; starting from ready")
                continue
            if n is not None:
                sizes[pool] = n
        self.planner.adopt(sizes, f"running on {self.connector.name}")

    async def run(self) -> None:
        """Tick every interval until cancelled."""
        while True:
            started = time.monotonic()
            try:
                await self.tick_once()
            except Exception as e:  # a bug: log it, keep the planner alive
                log.exception("planner tick failed")
                self.failed("tick", "", f"the tick failed: {e!r}")
            wall = self.interval_s / self.time_scale
            await asyncio.sleep(max(wall - (time.monotonic() - started), 0.0))
