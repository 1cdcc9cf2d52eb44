"""A one-line progress bar on stderr: done/total, failures, rate, elapsed and ETA.

On a terminal it redraws in place (at most 10 times a second); into a file or a
pipe it writes a line every 10 % so logs stay short.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

_WIDTH = 30


class Progress:
    def __init__(
        self, total: int, label: str = "", enabled: bool = True, stream: TextIO | None = None
    ) -> None:
        self.total = total
        self.label = label
        self.enabled = enabled and total > 0
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.done = 0
        self.failed = 0
        self.t0 = time.monotonic()
        self._last_draw = 0.0
        self._last_decile = -1

    def update(self, success: bool = True) -> None:
        self.done += 1
        self.failed += 0 if success else 1
        if not self.enabled:
            return
        now = time.monotonic()
        if self.tty:
            if now - self._last_draw >= 0.1 or self.done == self.total:
                self._last_draw = now
                self.stream.write("\r" + self.line(now))
                self.stream.flush()
        else:
            decile = self.done * 10 // self.total
            if decile != self._last_decile:
                self._last_decile = decile
                self.stream.write(self.line(now) + "\n")
                self.stream.flush()

    def line(self, now: float | None = None) -> str:
        elapsed = (now if now is not None else time.monotonic()) - self.t0
        frac = self.done / self.total if self.total else 1.0
        bar = "#" * int(frac * _WIDTH)
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else float("nan")
        fail = f" {self.failed} failed" if self.failed else ""
        head = f"{self.label} " if self.label else ""
        return (
            f"{head}[{bar:<{_WIDTH}}] {self.done}/{self.total}{fail} "
            f"{rate:.2f} req/s {elapsed:.0f}s elapsed, ETA {eta:.0f}s"
        )

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
