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

from planner.connectors import Connector
from planner.core import Planner, TickResult
from planner.metrics import PlannerMetrics
from planner.scrape import observe
from planner.source import Round, RoundSource, pairs

log = logging.getLogger(__name__)


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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"the planner interval must be above 0 s, got {interval_s}")
        self.planner = planner
        self.source = source
        self.connector = connector
        self.interval_s = interval_s
        self.metrics = metrics or PlannerMetrics()
        self.history: collections.deque[TickResult] = collections.deque(maxlen=history)
        self.time_scale = time_scale
        self._clock = clock
        self._last: tuple[Round, float] | None = None

    def now(self) -> float:
        """Seconds on the planner's clock (simulated seconds under a time scale)."""
        return self._clock() * self.time_scale

    async def tick_once(self) -> TickResult | None:
        now = self.now()
        try:
            current = await self.source.scrape()
        except Exception as e:
            self.metrics.errors.labels(kind="scrape").inc()
            log.warning("planner: skipping this tick, metrics unreadable: %s", e)
            return None
        last, self._last = self._last, (current, now)
        if last is None:
            return None  # the first round is the baseline
        previous, then = last
        obs = observe(now, now - then, (previous.frontend, current.frontend),
                      pairs(previous, current))  # fmt: skip
        result = self.planner.tick(obs)
        self.metrics.record(result)
        self.history.append(result)
        for d in result.decisions:
            if d.changed:
                log.info("planner: %s %d -> %d (%s)", d.pool, d.previous, d.target, d.reason)
        if self.connector is not None and not self.planner.dry_run:
            for d in result.decisions:
                try:
                    await self.connector.scale(d.pool, d.target)
                except Exception as e:
                    self.metrics.errors.labels(kind="scale").inc()
                    log.warning("planner: scaling %s to %d failed: %s", d.pool, d.target, e)
        return result

    async def run(self) -> None:
        """Tick every interval until cancelled."""
        while True:
            started = time.monotonic()
            try:
                await self.tick_once()
            except Exception:  # a bug: log it, keep the planner alive
                self.metrics.errors.labels(kind="tick").inc()
                log.exception("planner tick failed")
            wall = self.interval_s / self.time_scale
            await asyncio.sleep(max(wall - (time.monotonic() - started), 0.0))
