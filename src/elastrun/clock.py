"""Time, injected.

Everything that waits works with *absolute monotonic deadlines* obtained from a
:class:`Clock`, never with wall-clock time and never with clocks of other nodes.
Production code uses :data:`SYSTEM_CLOCK`; pure tests use :class:`FakeClock`.
"""

from __future__ import annotations

import math
import time
from typing import Protocol

__all__ = ["SYSTEM_CLOCK", "Clock", "FakeClock", "SystemClock", "remaining"]


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a monotonic scale; only differences are meaningful."""
        ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()


SYSTEM_CLOCK: Clock = SystemClock()


class FakeClock:
    """A clock that only moves when told to (for pure tests)."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start

    def monotonic(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock does not go backwards")
        self._now += seconds


def remaining(deadline: float, clock: Clock = SYSTEM_CLOCK) -> float:
    """Seconds left until ``deadline`` (never negative; ``inf`` stays ``inf``)."""
    if math.isinf(deadline):
        return math.inf
    return max(0.0, deadline - clock.monotonic())
