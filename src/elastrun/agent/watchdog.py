"""Hang watchdog (``--hang-timeout S``): alive-but-stuck workers fail the group.

Each worker gets ``ELASTRUN_HEARTBEAT_FILE`` (one file per rank and attempt);
:func:`elastrun.train.heartbeat` overwrites it atomically with its step and its
``time.monotonic()`` (CLOCK_MONOTONIC is machine-wide on Linux, so the agent
compares it with its own clock). Any new heartbeat counts as progress.

No polling loop: one timer per rank, armed at ``last_progress + S``. When it
fires the file is read once: newer progress re-arms the timer at the new
``last_progress + S``; none means the rank made no progress for S seconds and
``on_hang`` is called (once per watchdog). Until a rank's first heartbeat it
is not judged (it may still be importing or initialising): its timer only
looks again every S seconds.

The worker rate-limits its writes; the agent tells it the interval through
``ELASTRUN_HEARTBEAT_INTERVAL`` (at most a quarter of S, so a rank that calls
``heartbeat()`` more often than every S seconds always lands a write in time).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from dataclasses import dataclass

from elastrun.clock import SYSTEM_CLOCK, Clock, remaining

__all__ = [
    "HEARTBEAT_ENV",
    "HEARTBEAT_INTERVAL_ENV",
    "Beat",
    "HangWatchdog",
    "heartbeat_interval",
    "read_beat",
]

# Same names as elastrun.train.heartbeat (the agent does not import the train package).
HEARTBEAT_ENV = "ELASTRUN_HEARTBEAT_FILE"
HEARTBEAT_INTERVAL_ENV = "ELASTRUN_HEARTBEAT_INTERVAL"
MAX_INTERVAL = 1.0
MAX_BEAT_BYTES = 4096
CLOCK_SLACK = 1.0  # a beat stamped later than "now" + this is not trusted as-is


def heartbeat_interval(hang_timeout: float) -> float:
    """The workers' minimum gap between two heartbeat writes for timeout S."""
    return min(MAX_INTERVAL, hang_timeout / 4)


@dataclass(frozen=True)
class Beat:
    step: int | None
    monotonic: float


def read_beat(path: str) -> Beat | None:
    """The last heartbeat in ``path``; None if absent or not a heartbeat."""
    try:
        with open(path, "rb") as fp:
            raw = fp.read(MAX_BEAT_BYTES)
        data = json.loads(raw.decode("utf-8", errors="replace"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    mono = data.get("monotonic")
    if not isinstance(mono, int | float) or isinstance(mono, bool) or not math.isfinite(mono):
        return None
    step = data.get("step")
    return Beat(step if isinstance(step, int) and not isinstance(step, bool) else None, mono)


@dataclass
class _Watch:
    key: int
    path: str
    last_progress: float | None = None
    last_step: int | None = None
    handle: asyncio.TimerHandle | None = None


# on_hang(key, last_step, idle_seconds)
HangCallback = Callable[[int, int | None, float], None]


class HangWatchdog:
    """One timer per watched rank; ``on_hang`` is called at most once."""

    def __init__(self, timeout: float, on_hang: HangCallback, clock: Clock = SYSTEM_CLOCK) -> None:
        if not timeout > 0:
            raise ValueError(f"hang timeout must be > 0, got {timeout}")
        self.timeout = timeout
        self.clock = clock
        self._on_hang = on_hang
        self._watches: dict[int, _Watch] = {}
        self._fired = False
        self._closed = False

    def watch(self, key: int, path: str) -> None:
        """Start watching ``path`` (the rank was just started)."""
        w = _Watch(key, path)
        self._watches[key] = w
        self._arm(w, self.clock.monotonic() + self.timeout)

    def forget(self, key: int) -> None:
        """The rank exited: stop judging it."""
        w = self._watches.pop(key, None)
        if w is not None and w.handle is not None:
            w.handle.cancel()

    def close(self) -> None:
        self._closed = True
        for key in list(self._watches):
            self.forget(key)

    def _arm(self, w: _Watch, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        w.handle = loop.call_later(remaining(deadline, self.clock), self._check, w.key)

    def _check(self, key: int) -> None:
        w = self._watches.get(key)
        if w is None or self._closed or self._fired:
            return
        now = self.clock.monotonic()
        beat = read_beat(w.path)
        if beat is not None and (w.last_progress is None or beat.monotonic > w.last_progress):
            # A beat "from the future" (another clock) counts as progress now.
            w.last_progress = beat.monotonic if beat.monotonic <= now + CLOCK_SLACK else now
            w.last_step = beat.step
        if w.last_progress is None:  # never heartbeated: not judged
            self._arm(w, now + self.timeout)
            return
        deadline = w.last_progress + self.timeout
        if now < deadline:
            self._arm(w, deadline)
            return
        self._fired = True
        self._on_hang(key, w.last_step, now - w.last_progress)
