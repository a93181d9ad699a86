"""The phases of a start, timed and logged as each ends, so that a slow start says where its time went (a replica's
log: `start: load target 21.3 s`, ..., `started in 48.0 s: ...`)."""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)


class StartPhases:
    def __init__(self, what: str, log: logging.Logger = logger) -> None:
        self.what, self.log = what, log
        self.began = time.perf_counter()
        self.seconds: dict[str, float] = {}
        self.before = 0.0  # seconds of the phases that ended before this timer began (record)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = time.perf_counter() - began
            self.log.info("%s start: %s %.1f s", self.what, name, self.seconds[name])

    def record(self, name: str, seconds: float) -> None:
        """A phase timed elsewhere (one that ended before this timer began)."""
        self.seconds[name] = seconds
        self.before += seconds
        self.log.info("%s start: %s %.1f s", self.what, name, seconds)

    def done(self) -> float:
        """Log the whole start and its phases; its seconds (since this timer began, and the phases recorded)."""
        total = time.perf_counter() - self.began + self.before
        self.log.info("%s started in %.1f s: %s", self.what, total,
                    ", ".join(f"{name} {s:.1f} s" for name, s in self.seconds.items()))
        return total
