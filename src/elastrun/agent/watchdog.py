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

Workers started through elastrun's runner record progress by themselves
(optimizer steps, DataLoader batches, checkpoint phases: worker/_progress.py),
and write, beside the last progress, their own calibrated timeout (``calib``)
and the phase they are in. With ``--hang-timeout auto[:FLOOR]``
(:class:`HangPolicy` ``auto``) a rank's timeout is ``max(FLOOR, calib)``,
times ``PHASE_FACTOR`` while it is in a phase (a checkpoint save); a fixed S
is used as it is. When an ``auto`` timeout expires on a rank whose stack shows
it waiting in torch for its peers while no local rank is stuck in code of its
own, the culprit is elsewhere (a peer in a long phase, or stuck on another
node, whose own watchdog judges it): the rank is judged again at
``PHASE_FACTOR`` times its timeout (:meth:`HangWatchdog.wait_longer`).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from dataclasses import dataclass

from elastrun.clock import SYSTEM_CLOCK, Clock, remaining

__all__ = [
    "DEFAULT_AUTO_FLOOR",
    "HEARTBEAT_ENV",
    "HEARTBEAT_INTERVAL_ENV",
    "PHASE_FACTOR",
    "Beat",
    "HangPolicy",
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
DEFAULT_AUTO_FLOOR = 300.0  # --hang-timeout auto: never judged stuck sooner than this
PHASE_FACTOR = 10.0  # auto: a rank in a phase (a checkpoint save) is allowed this much longer
MAX_CALIB = 7 * 24 * 3600.0


def heartbeat_interval(hang_timeout: float) -> float:
    """The workers' minimum gap between two heartbeat writes for timeout S."""
    return min(MAX_INTERVAL, hang_timeout / 4)


@dataclass(frozen=True)
class Beat:
    step: int | None
    monotonic: float
    steps: int | None = None  # optimizer steps counted by the runner
    step_time: float | None = None  # median of the recent step intervals (s)
    own_time: float | None = None  # the same outside backward passes (s)
    calib: float | None = None  # the rank's own calibrated timeout (s)
    phase: str | None = None  # a long phase it is in ("checkpoint")
    phase_since: float | None = None


@dataclass(frozen=True)
class HangPolicy:
    """``--hang-timeout S`` (fixed) or ``auto[:FLOOR]`` (``seconds`` is the floor)."""

    seconds: float
    auto: bool = False

    def timeout_for(self, beat: Beat | None) -> float:
        """How long this rank may go without progress, given its last beat."""
        if not self.auto or beat is None:
            return self.seconds
        t = max(self.seconds, beat.calib or 0.0)
        return t * PHASE_FACTOR if beat.phase else t

    def describe(self) -> str:
        return f"auto (floor {self.seconds:g} s)" if self.auto else f"{self.seconds:g} s"


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
    calib = _number(data.get("calib"))
    phase = data.get("phase")
    return Beat(
        step=_int(data.get("step")),
        monotonic=mono,
        steps=_int(data.get("steps")),
        step_time=_number(data.get("step_time")),
        own_time=_number(data.get("own_time")),
        calib=None if calib is None else min(calib, MAX_CALIB),
        phase=phase[:64] if isinstance(phase, str) and phase else None,
        phase_since=_number(data.get("phase_since")),
    )


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _number(value: object) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value) if value >= 0 else None
    return None


@dataclass
class _Watch:
    key: int
    path: str
    last_progress: float | None = None
    last_step: int | None = None
    beat: Beat | None = None
    handle: asyncio.TimerHandle | None = None
    patient: bool = False  # waiting for a peer: allowed PHASE_FACTOR times longer


@dataclass(frozen=True)
class Hang:
    """What the watchdog saw when it declared a rank stuck."""

    key: int
    last_step: int | None
    idle: float  # seconds without progress
    timeout: float  # the timeout it was judged by
    phase: str | None = None


HangCallback = Callable[[Hang], None]


class HangWatchdog:
    """One timer per watched rank; ``on_hang`` is called at most once."""

    def __init__(
        self, policy: HangPolicy | float, on_hang: HangCallback, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        if not isinstance(policy, HangPolicy):
            policy = HangPolicy(policy)
        if not policy.seconds > 0:
            raise ValueError(f"hang timeout must be > 0, got {policy.seconds}")
        self.policy = policy
        self.timeout = policy.seconds
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
        if beat is not None:
            w.beat = beat
            # A phase that began after the last progress restarts the clock.
            mark = max(beat.monotonic, beat.phase_since or 0.0)
            if w.last_progress is None or mark > w.last_progress:
                # A beat "from the future" (another clock) counts as progress now.
                w.last_progress = mark if mark <= now + CLOCK_SLACK else now
                w.last_step = beat.step
                w.patient = False
        if w.last_progress is None:  # never showed progress: not judged
            self._arm(w, now + self.timeout)
            return
        timeout = self.policy.timeout_for(w.beat)
        if w.patient:
            timeout *= PHASE_FACTOR
        deadline = w.last_progress + timeout
        if now < deadline:
            self._arm(w, deadline)
            return
        self._fired = True
        phase = w.beat.phase if w.beat is not None else None
        self._on_hang(Hang(key, w.last_step, now - w.last_progress, timeout, phase))

    def wait_longer(self, key: int) -> None:
        """The rank waits in torch for a peer (its stack says so), which may be
        in a long phase of its own or stuck on another node: judge it again
        at PHASE_FACTOR times its timeout (or once it progresses again)."""
        w = self._watches.get(key)
        if w is None or self._closed:
            return
        self._fired = False
        w.patient = True
        self._check(key)

    def is_patient(self, key: int) -> bool:
        w = self._watches.get(key)
        return w is not None and w.patient

    def beats(self) -> dict[int, Beat]:
        """The last beat read of each watched rank (for the step times)."""
        return {k: w.beat for k, w in self._watches.items() if w.beat is not None}
