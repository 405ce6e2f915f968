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
looks again every S seconds. A record of progress from before the rank was
started (or told to enter its function again) in this round is no heartbeat:
a kept process's of an earlier round (``watch``'s ``since``).

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

**Progress it cannot see is never a hang.** A rank is declared hung only on
evidence that it stopped: a record of its progress that the agent could read,
or progress relayed over its runner's channel. When neither exists, the
rank's progress is *unknown* and the rank is not judged. The design, argued:

* Reading a stale record as "no progress" is what made a full log disk or a
  read-only folder kill healthy jobs: the file stops changing because of the
  disk, not the worker. A false hang costs a restart, and on a disk that
  stays full every later round fails too. An unjudged rank costs only the
  watchdog's protection, for as long as the fault lasts, and the agent says so.
  So unknown means not judged.
* The runner already has a channel to the agent (a socket, no disk). When its
  file cannot be written, it relays each new record there, so the watchdog
  keeps judging from what it can still see, through a disk fault. Progress
  still goes to the file when it can: the agent reads the file only when a
  timer fires. Relaying everything would wake the agent at every change of
  every rank.
* The file is read with ``elastrun.safefs.read_regular``: bounded, no link
  followed, never blocked by a FIFO. What cannot be read is unknown, never
  a wait.

So the sources are the file and the relayed records (:meth:`HangWatchdog.relayed`);
the newer of the two counts. When a rank's timeout expires, it is judged
only if its runner relays its progress over a channel that is still open,
or if its file could be read and its folder can still be written
(``os.access``; ``statvfs``: no free block or inode, a read-only file
system). Otherwise ``on_unknown(key, why)`` is called, and the rank is looked
at again one timeout later. The cases: its file cannot be read (not a regular
file, too large, no permission), it is gone after the rank showed progress
(its worker removed it), its runner relayed progress over a channel that has
since closed, or its folder cannot take a write. A file that cannot be read is
reported before the first progress too. The group says so once (console, and
a ``progress_unknown`` event). A worker without a runner (``--no-python``
calling ``heartbeat()``) has no channel. When a write fails, its
``heartbeat()`` removes the stale file, and the folder check covers a file it
could not remove.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

from elastrun.clock import SYSTEM_CLOCK, Clock, remaining
from elastrun.fields import Fields
from elastrun.frozen import frozen
from elastrun.safefs import UnsafePath, read_regular
from elastrun.untrusted import UntrustedData, loads

__all__ = [
    "DEFAULT_AUTO_FLOOR",
    "HEARTBEAT_ENV",
    "HEARTBEAT_INTERVAL_ENV",
    "PHASE_FACTOR",
    "Beat",
    "HangPolicy",
    "HangWatchdog",
    "ProgressRead",
    "folder_problem",
    "heartbeat_interval",
    "parse_beat",
    "read_beat",
    "read_progress",
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


@frozen
class Beat:
    step: int | None
    monotonic: float
    steps: int | None = None  # optimizer steps counted by the runner
    step_time: float | None = None  # median of the recent step intervals (s)
    own_time: float | None = None  # the same outside backward passes (s)
    calib: float | None = None  # the rank's own calibrated timeout (s)
    phase: str | None = None  # a long phase it is in ("checkpoint")
    phase_since: float | None = None
    # For the goodput accounting (agent/goodput.py): this process's first
    # step and when it ended, its seconds in checkpoint phases (and of them,
    # those before its first step), and whether ``step`` is the script's own.
    first_at: float | None = None
    first_step: int | None = None
    saving_s: float | None = None
    reported: bool = False
    first_saving_s: float | None = None


@frozen
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


@frozen
class ProgressRead:
    """One read of a rank's progress file: its beat (None: no valid record),
    whether the file is missing, and why it could not be read."""

    beat: Beat | None = None
    missing: bool = False
    error: str | None = None


def read_progress(path: str) -> ProgressRead:
    """Read ``path`` once (bounded, no link followed, never blocked)."""
    try:
        raw = read_regular(path, MAX_BEAT_BYTES)
    except FileNotFoundError:
        return ProgressRead(missing=True)
    except UnsafePath as e:
        return ProgressRead(error=e.problem)
    except OSError as e:
        return ProgressRead(error=e.strerror or str(e))
    try:
        data = loads(raw, max_bytes=MAX_BEAT_BYTES, what="progress record")
    except UntrustedData:
        return ProgressRead()  # torn or foreign: no record (the next write replaces it)
    return ProgressRead(beat=parse_beat(data))


def read_beat(path: str) -> Beat | None:
    """The last heartbeat in ``path``; None if absent, unreadable or not a heartbeat."""
    return read_progress(path).beat


def parse_beat(data: object) -> Beat | None:
    """A progress record (the file's JSON, or a ``progress`` message's
    ``beat``) as a Beat; None if it is not one."""
    if not isinstance(data, dict):
        return None
    f = Fields(data, "a progress record")
    mono = f.maybe_number("monotonic")
    if mono is None:
        return None
    calib = _seconds(f, "calib")
    phase = f.maybe_text("phase")
    return Beat(
        step=f.maybe_int("step"),
        monotonic=mono,
        steps=f.maybe_int("steps"),
        step_time=_seconds(f, "step_time"),
        own_time=_seconds(f, "own_time"),
        calib=None if calib is None else min(calib, MAX_CALIB),
        phase=phase[:64] if phase else None,
        phase_since=_seconds(f, "phase_since"),
        first_at=f.maybe_number("first_at"),
        first_step=f.maybe_int("first_step"),
        saving_s=_seconds(f, "saving_s"),
        reported=f.raw.get("reported") is True,
        first_saving_s=_seconds(f, "first_saving_s"),
    )


def folder_problem(folder: str) -> str | None:
    """Why a progress file in ``folder`` could not be written now (None:
    nothing known prevents it): a read-only file system, no free block or
    inode, no write permission (an immutable folder too)."""
    try:
        st = os.statvfs(folder)
    except OSError as e:
        return f"{folder} cannot be examined: {e.strerror or e}"
    if st.f_flag & os.ST_RDONLY:
        return f"{folder} is on a read-only file system"
    if st.f_bavail == 0 or (st.f_files > 0 and st.f_favail == 0):
        return f"{folder} is on a full file system"
    if not os.access(folder, os.W_OK):
        return f"{folder} is not writable"
    return None


def _seconds(f: Fields, name: str) -> float | None:
    """A finite number of at least 0, else None."""
    value = f.maybe_number(name)
    return value if value is not None and value >= 0 else None


@dataclass
class _Watch:
    key: int
    path: str
    channel: bool = False  # the runner has a channel to the agent, still open
    relayed: bool = False  # its file cannot be written: its progress comes over the channel
    last_progress: float | None = None
    last_step: int | None = None
    beat: Beat | None = None
    handle: asyncio.TimerHandle | None = None
    patient: bool = False  # waiting for a peer: allowed PHASE_FACTOR times longer
    since: float | None = None  # progress before this is an earlier round's, not this one's


@frozen
class Hang:
    """What the watchdog saw when it declared a rank stuck."""

    key: int
    last_step: int | None
    idle: float  # seconds without progress
    timeout: float  # the timeout it was judged by
    phase: str | None = None


HangCallback = Callable[[Hang], None]
# (key, why its progress is unknown): the rank was not judged.
UnknownCallback = Callable[[int, str], None]


class HangWatchdog:
    """One timer per watched rank; ``on_hang`` is called at most once."""

    def __init__(
        self,
        policy: HangPolicy | float,
        on_hang: HangCallback,
        clock: Clock = SYSTEM_CLOCK,
        on_unknown: UnknownCallback | None = None,
    ) -> None:
        if not isinstance(policy, HangPolicy):
            policy = HangPolicy(policy)
        if not policy.seconds > 0:
            raise ValueError(f"hang timeout must be > 0, got {policy.seconds}")
        self.policy = policy
        self.timeout = policy.seconds
        self.clock = clock
        self._on_hang = on_hang
        self._on_unknown = on_unknown
        self._watches: dict[int, _Watch] = {}
        self._fired = False
        self._closed = False

    def watch(self, key: int, path: str, channel: bool = False, since: float | None = None) -> None:
        """Start watching ``path`` (the rank was just started; ``channel``:
        its runner has a channel that can relay its progress; ``since``: when
        it was started or told to enter its function again in this round:
        a record of progress before that is a kept process's of an earlier
        round, never this round's progress)."""
        w = _Watch(key, path, channel=channel, since=since)
        self._watches[key] = w
        self._arm(w, self.clock.monotonic() + self.timeout)

    def relayed(self, key: int, beat: Beat | None) -> None:
        """The rank's runner cannot write its file: its progress (``beat``,
        if any) came over its channel."""
        w = self._watches.get(key)
        if w is None:
            return
        w.relayed = True
        if beat is not None:
            self._saw(w, beat, self.clock.monotonic())

    def channel_closed(self, key: int) -> None:
        """The rank's channel is gone: nothing more is relayed."""
        w = self._watches.get(key)
        if w is not None:
            w.channel = False

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

    def _saw(self, w: _Watch, beat: Beat, now: float, from_file: bool = False) -> None:
        """A beat, from the file or the channel: the newer progress counts."""
        # A phase that began after the last progress restarts the clock.
        mark = max(beat.monotonic, beat.phase_since or 0.0)
        if w.since is not None and mark < w.since:
            return  # an earlier round's (see watch)
        if from_file and w.relayed and w.last_progress is not None and mark > w.last_progress:
            w.relayed = False  # the file is written again: newer than anything relayed
        if w.last_progress is None or mark > w.last_progress:
            # A beat "from the future" (another clock) counts as progress now.
            w.last_progress = mark if mark <= now + CLOCK_SLACK else now
            w.last_step = beat.step
            w.beat = beat
            w.patient = False
        elif w.beat is None:
            w.beat = beat

    def _look(self, w: _Watch, now: float) -> ProgressRead:
        read = read_progress(w.path)
        if read.beat is not None:
            self._saw(w, read.beat, now, from_file=True)
        return read

    def unknown(self, w: _Watch, read: ProgressRead) -> str | None:
        """Why rank ``w``'s progress cannot be judged now (None: it can)."""
        if w.relayed and w.channel:
            return None  # its runner relays every change: judged by that
        if read.error is not None:
            return f"its progress file {w.path} cannot be read: {read.error}"
        if w.relayed:
            return (
                f"its progress file {w.path} cannot be written and its channel to the "
                "agent is closed"
            )
        if read.missing:
            return f"its progress file {w.path} is gone (its worker could not write it)"
        problem = folder_problem(os.path.dirname(w.path))
        return None if problem is None else f"its progress file cannot be written: {problem}"

    def _check(self, key: int) -> None:
        w = self._watches.get(key)
        if w is None or self._closed or self._fired:
            return
        now = self.clock.monotonic()
        read = self._look(w, now)
        if w.last_progress is None:  # never showed progress: not judged
            if read.error is not None and self._on_unknown is not None:
                self._on_unknown(key, f"its progress file {w.path} cannot be read: {read.error}")
            self._arm(w, now + self.timeout)
            return
        timeout = self.policy.timeout_for(w.beat)
        if w.patient:
            timeout *= PHASE_FACTOR
        deadline = w.last_progress + timeout
        if now < deadline:
            self._arm(w, deadline)
            return
        why = self.unknown(w, read)
        if why is not None:  # no evidence that it stopped: not judged (see the docstring)
            if self._on_unknown is not None:
                self._on_unknown(key, why)
            self._arm(w, now + timeout)
            return
        self._fired = True
        phase = w.beat.phase if w.beat is not None else None
        self._on_hang(Hang(key, w.last_step, now - w.last_progress, timeout, phase))

    def latest(self, key: int) -> tuple[Beat | None, float | None]:
        """The rank's newest progress now (the file read again, and what its
        channel relayed): (its last beat, seconds since its last progress);
        the seconds are None when its progress is unknown, ``inf`` before
        its first progress."""
        w = self._watches.get(key)
        if w is None:
            return None, None
        now = self.clock.monotonic()
        read = self._look(w, now)
        if w.last_progress is None:
            return w.beat, math.inf
        if self.unknown(w, read) is not None:
            return w.beat, None
        return w.beat, now - w.last_progress

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
