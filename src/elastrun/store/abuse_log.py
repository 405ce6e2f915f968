"""Warnings about misbehaving peers of the embedded store's server, in bounded
volume: a few lines per interval and a count of the rest, never a traceback
per connection (:class:`AbuseLog`)."""

from __future__ import annotations

import logging
import time

__all__ = ["AbuseLog"]

log = logging.getLogger("elastrun.store.server")


class AbuseLog:
    """Warnings about misbehaving peers, at most ``burst`` lines per
    ``interval`` seconds; the rest are counted and the count is reported with
    the next line that gets through."""

    def __init__(self, burst: int = 10, interval: float = 10.0) -> None:
        self.burst = burst
        self.interval = interval
        self._window_start = -1e18
        self._lines = 0
        self.suppressed = 0
        self.total = 0

    def warn(self, message: str) -> None:
        self.total += 1
        now = time.monotonic()
        if now - self._window_start >= self.interval:
            self._window_start, self._lines = now, 0
        if self._lines >= self.burst:
            self.suppressed += 1
            return
        self._lines += 1
        if self.suppressed:
            message += f" ({self.suppressed} similar message(s) suppressed)"
            self.suppressed = 0
        log.warning("elastrun store: %s", message)

    def flush(self) -> None:
        """Report the count of suppressed messages, if any."""
        if self.suppressed:
            log.warning(
                "elastrun store: %d more message(s) about misbehaving clients suppressed",
                self.suppressed,
            )
            self.suppressed = 0
