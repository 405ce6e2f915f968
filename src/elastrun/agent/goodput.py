"""Goodput: the share of wall time that turned into training, accounted per cause.

Each agent keeps a :class:`Ledger` of its node's time, fed from what it
already sees: its rounds (a round's workers start; the round ends; a restart
is counted, for a failure here or on another node, once the rendezvous
charged it; a hang was declared here),
and the progress record of its first local rank (worker/_progress.py, read
every ``POLL_EVERY`` seconds while the round runs): when this process's first
step ended and at which step, the time of the last progress and its step,
the median step time, and the seconds spent in ``checkpoint`` phases
(``torch.save``, ``torch.load``, elastrun's checkpoint helpers, a
``MemoryCheckpoint`` save), less those before its first step (a checkpoint
loaded: already the start's or the restart's time). Every second of the
agent's life goes to exactly one cause:

========== ==============================================================
training   from a round's first step to its end, less the two below
saves      blocked in checkpoint phases (taken out of training)
redone     steps done again after a restart: the steps between the step
           resumed from and the newest step reached before, times the
           step time (taken out of the training that follows the restart)
restart    from a restart's cause (a failure here, or another node's
           failure or lost node that ends the round) to the first step after
           it: stopping, the failure summary, the rendezvous, the start; and
           the warm-up after it: what the steps after that first one took
           beyond the pace before the failure, until the pace is back
           (``WARM_SLACK``; at most ``WARM_MAX`` seconds after the first step)
hang       from a rank's last progress to the hang being declared here
waiting    a round ended by a membership change that is no restart (a node
           joining), from its last step to the first step after it; the exit
           barrier
startup    from the agent's start to the job's first step (reported, but
           not part of the figure: it is paid once per job)
========== ==============================================================

The figure is ``training / (wall time - startup)``: the share of the time
since training began that trained, what a failure-free run of the same length
would make of it (bench/goodput_accounting.py compares both).

What it cannot see: a script that reports no steps (no optimizer of
``torch.optim``, no ``elastrun.train.heartbeat``; ``--no-python``) has no
first step: its time after the start is all ``startup`` or ``restart``, and
the figure is unknown. A script that reports no step *numbers* of its own
(``heartbeat(step)``) shows its restarts but not the steps it redoes: those
count as training. The record is written at most every ``RECORD_LAG``
seconds: a step made that close before a crash may be counted lost. A hang
declared on another node ends this node's round as a restart: the time its
ranks waited in a collective before counts as the restart's here, not the
hang's.

The warm-up: a new process's first steps are slower than the job's pace
(the allocator, autograd and the collectives' first use, a checkpoint's
pages faulted in, a new standby's start beside it); measured on
bench/goodput_accounting.py, 0.1 to 0.6 s per failure on 2 shared cores,
which, counted as training, made the figure read 4 to 7 points high at a
kill every 10 s. The pace is the median of the recent intervals between two
reads of the record (seconds over optimizer steps, saves included), taken
before the failure; a process that counts no optimizer steps shows no
warm-up, and none is counted after a change that is no restart.

The ledger is pure (times given, no clock, no I/O): tests/unit/test_goodput.py
drives it in virtual time. :class:`GoodputAccounting` is its driver, a feature
of the agent; at the end it emits a ``goodput`` event and prints
:meth:`Goodput.line`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from elastrun.agent.hang_group import PROGRESS_INTERVAL, progress_file
from elastrun.agent.hooks import Core, Feature, RoundHooks
from elastrun.agent.watchdog import Beat, read_beat
from elastrun.event_kinds import GoodputAccounted
from elastrun.goodput import Cause, Goodput
from elastrun.rendezvous.api import Change
from elastrun.rendezvous.notes import GoodputNote

if TYPE_CHECKING:
    from elastrun.agent.workers import WorkerGroup

__all__ = ["POLL_EVERY", "PUBLISH_EVERY", "GoodputAccounting", "Ledger", "features"]

POLL_EVERY = 0.5  # s between two reads of the progress record while a round runs
# The record read at a round's end lags the last step by at most the runner's
# write interval (worker/_progress.py), which the agent sets this low.
RECORD_LAG = PROGRESS_INTERVAL
PUBLISH_EVERY = 5.0  # s between two goodput notes of group rank 0's agent
# The warm-up after a restart ends at the first read whose steps came at most
# this much slower than the pace before the failure, or this long after the
# first step (a round that stays slower, a smaller world, is no warm-up).
WARM_SLACK = 1.25
WARM_MAX = 10.0  # s
PACES = 15  # recent intervals the pace is the median of


@dataclass
class _Round:
    """What the ledger keeps of the round that runs."""

    first: bool = False  # its first step was seen
    resumed: bool = False  # the script's number for it was seen
    last_at: float | None = None  # its last progress
    step: int | None = None
    saving: float = 0.0  # s in checkpoint phases seen so far (the process's count)
    started_at: float = 0.0
    seen: tuple[float, int] | None = None  # the last read's last step: when, and the count
    warm_until: float | None = None  # warming up after a restart until then at most


@dataclass
class Ledger:
    """One node's time per cause (pure: every time is given)."""

    mark: float  # the time accounted up to
    cause: Cause = Cause.STARTUP  # what the time since ``mark`` is
    seconds: dict[Cause, float] = field(default_factory=lambda: dict.fromkeys(Cause, 0.0))
    # Time owed by the training to come (saves seen, steps to redo).
    owed: dict[Cause, float] = field(default_factory=dict)
    failures: int = 0
    hangs: int = 0
    steps_redone: int = 0
    steps_known: bool = False
    high: int | None = None  # the newest step the script reached (its own numbers)
    step_time: float | None = None
    ended_at: float | None = None  # the last round's end
    run: _Round | None = None  # the round that runs (None: between rounds)
    last: _Round | None = None  # the round that ended last
    restarted_at: float | None = None  # the last restart's cause (its lost time's start)
    paces: deque[float] = field(default_factory=lambda: deque(maxlen=PACES))
    warm_pace: float | None = None  # the pace before the last restart (s per step)
    # Told each restart's recovery: from its cause to the first step after it.
    recovered: Callable[[float], None] | None = None

    # ------------------------------------------------------------ feeding
    def started(self, now: float) -> None:
        """A round's workers start."""
        self.run = _Round(started_at=now)

    def beat(self, b: Beat) -> None:
        """The progress record of the round's (first local) rank, read now."""
        r = self.run
        if r is None or b.first_at is None:
            return  # between rounds, or no step yet
        if b.step_time is not None:
            self.step_time = b.step_time
        if not r.first:
            r.first = True
            # Checkpoint phases before the first step (a checkpoint loaded)
            # are in the start or restart's time already: not owed again.
            r.saving = b.first_saving_s or 0.0
            first = max(b.first_at, self.mark)
            self._account(first)
            self.cause = Cause.TRAINING
            if self.restarted_at is not None and self.recovered is not None:
                self.recovered(max(0.0, first - self.restarted_at))
            if self.restarted_at is not None and self.warm_pace is not None and b.steps:
                r.warm_until = first + WARM_MAX
                # A new process: from its first step (count 1); one kept
                # across the restart (in-process): from this read.
                new = b.first_at >= r.started_at
                r.seen = (first, 1) if new else (b.monotonic, b.steps)
            self.restarted_at = None
        self._pace(b, max(0.0, (b.saving_s or 0.0) - r.saving))
        if not r.resumed and b.reported and b.first_step is not None:
            # The script's number for this process's first step (a record
            # written between its first optimizer step and its report of it
            # has the count there: not reported yet).
            r.resumed = True
            self._owe_redone(b)
        if r.last_at is None or b.monotonic >= r.last_at:
            r.last_at, r.step = b.monotonic, b.step
        if b.reported and b.step is not None:
            self.steps_known = True
            self.high = b.step if self.high is None else max(self.high, b.step)
        saving = b.saving_s or 0.0
        if saving > r.saving:
            self._owe(Cause.SAVES, saving - r.saving)
            r.saving = saving

    def _pace(self, b: Beat, saved: float) -> None:
        """The steps since the last read: a sample of the pace, or, warming
        up after a restart, what they took beyond the pace before it, less
        ``saved`` (the checkpoint phases among them: the saves' already)."""
        r = self.run
        assert r is not None
        if b.steps is None:
            return
        last, r.seen = r.seen, (b.monotonic, b.steps)
        if last is None or b.steps <= last[1] or b.monotonic <= last[0]:
            if last is not None and b.steps < last[1]:
                r.warm_until = None  # another process's count: no comparison
            return
        took, steps = b.monotonic - last[0], b.steps - last[1]
        pace = self.warm_pace
        if r.warm_until is None or pace is None:
            self.paces.append(took / steps)
            return
        if took <= WARM_SLACK * steps * pace or b.monotonic > r.warm_until:
            r.warm_until = None  # the pace is back
            return
        self._account(b.monotonic)
        slow = min(max(0.0, took - steps * pace - saved), self.seconds[Cause.TRAINING])
        self.seconds[Cause.TRAINING] -= slow
        self.seconds[Cause.RESTART] += slow

    def ended(self, now: float) -> None:
        """The round is over (its workers exited, one failed, or it must end);
        until a restart is counted, what follows is waiting."""
        self._account(now)
        self.cause, self.ended_at = Cause.WAITING, now
        self.last, self.run = self.run, None

    def restarting(self, *, hang: bool = False) -> None:
        """The round that ended is a restart (a failure here or elsewhere);
        ``hang``: a rank was declared hung here. The time since its last
        step is the hang's or the restart's (:meth:`_lost`). Counted among
        the failures once the rendezvous charged it (:meth:`charged`)."""
        self.cause = Cause.RESTART
        self.restarted_at = self.ended_at
        self.warm_pace = _median(self.paces) if self.paces else None
        self.hangs += hang
        self._lost(Cause.HANG if hang else Cause.RESTART)

    def charged(self) -> None:
        """The next round's close charged the restart (a failure collateral to
        a lost node or store host is not charged, and one that several nodes
        report is charged once): one failure more."""
        self.failures += 1

    def changing(self) -> None:
        """The round that ended is a change that is no restart (a node
        joins): the time since its last step is waiting (:meth:`_lost`)."""
        self._lost(Cause.WAITING)

    def _lost(self, to: Cause) -> None:
        """The time from the round's last step (read at its end, at most
        ``RECORD_LAG`` old) to its end was lost: the step in flight, or a
        rank waiting for a peer that was gone. It goes to ``to``."""
        last, end = self.last, self.ended_at
        if last is None or last.last_at is None or end is None:
            return
        lost = min(max(0.0, end - last.last_at), self.seconds[Cause.TRAINING])
        self.seconds[Cause.TRAINING] -= lost
        self.seconds[to] += lost
        if self.restarted_at is not None:
            self.restarted_at = last.last_at
        self.ended_at = last.last_at  # no step was made after it

    # ------------------------------------------------------------ figures
    def figures(self, now: float) -> Goodput:
        """The figures at ``now`` (the time since the last event counted as
        what it is so far)."""
        probe = Ledger(self.mark, self.cause, dict(self.seconds), dict(self.owed))
        probe._account(now)
        return Goodput(
            {c.value: round(v, 6) for c, v in probe.seconds.items() if v > 0},
            failures=self.failures,
            hangs=self.hangs,
            steps_redone=self.steps_redone,
            steps_known=self.steps_known,
        )

    # ------------------------------------------------------------ inside
    def _account(self, until: float) -> None:
        amount = until - self.mark
        if amount <= 0:
            return
        self.mark = until
        if self.cause is Cause.TRAINING:
            for cause in (Cause.SAVES, Cause.REDONE):
                take = min(self.owed.get(cause, 0.0), amount)
                if take > 0:
                    self.owed[cause] -= take
                    self.seconds[cause] += take
                    amount -= take
        self.seconds[self.cause] += amount

    def _owe(self, cause: Cause, amount: float) -> None:
        """``amount`` s of the training counted so far (saves: they are in the
        past) or to come (redone steps) is ``cause``'s."""
        if cause is Cause.SAVES:
            took = min(amount, self.seconds[Cause.TRAINING])
            self.seconds[Cause.TRAINING] -= took
            self.seconds[Cause.SAVES] += took
            amount -= took
        if amount > 0:
            self.owed[cause] = self.owed.get(cause, 0.0) + amount

    def _owe_redone(self, b: Beat) -> None:
        """The first step after a restart: the steps between the one resumed
        from and the newest reached before are done again."""
        last, high = self.last, self.high
        if b.first_step is None or high is None or last is None:
            return
        step_time = self.step_time
        reached = high
        redone = max(0, reached - (b.first_step - 1))
        self.high = min(high, b.first_step)  # training goes on from here
        if redone == 0:
            return
        self.steps_redone += redone
        if step_time:
            self._owe(Cause.REDONE, redone * step_time)


# ---------------------------------------------------------------- the feature


def features(core: Core) -> list[Feature]:
    return [GoodputAccounting(core)]


class GoodputAccounting(Feature):
    """The agent's ledger, fed by its rounds; the figures at the end."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.ledger = Ledger(core.clock.monotonic())
        self._last_round: int | None = None  # this node's last round
        if core.metrics is not None:  # served live (agent/metrics.py)
            core.metrics.goodput = self.figures
            core.metrics.step_time = lambda: self.ledger.step_time
            self.ledger.recovered = core.metrics.recovered

    def now(self) -> float:
        return self.core.clock.monotonic()

    def figures(self) -> Goodput:
        return self.ledger.figures(self.now())

    def round(self, group: WorkerGroup) -> RoundHooks:
        last, self._last_round = self._last_round, group.result.round
        if last is not None and group.result.charges(last):
            self.ledger.charged()
        return RoundGoodput(self, group)

    async def close(self) -> None:
        figures = self.figures()
        if self.ledger.run is None and self.ledger.last is None:
            return  # no round ran: nothing to account
        self.core.events.emit(GoodputAccounted(**figures.to_json()))
        self.core.say(f"elastrun: {figures.line()}")


class RoundGoodput(RoundHooks):
    """One round: its start, its first rank's progress, its end."""

    def __init__(self, feature: GoodputAccounting, group: WorkerGroup) -> None:
        self.feature = feature
        self.ledger = feature.ledger
        self.group = group
        self._poll: asyncio.Task[None] | None = None
        self._publish: asyncio.Task[None] | None = None
        self._counted = False  # the restart counted (failed and changed may both come)

    def _file(self) -> str | None:
        workers = sorted(self.group.workers, key=lambda w: w.local_rank)
        return progress_file(workers[0]) if workers and self.group.runs_runner else None

    def _read(self, path: str) -> None:
        beat = read_beat(path)
        if beat is not None:
            self.ledger.beat(beat)

    def started(self) -> None:
        self.ledger.started(self.feature.now())
        loop = asyncio.get_running_loop()
        path = self._file()
        if path is not None:
            self._poll = loop.create_task(self._watch(path))
        if self.group.result.group_rank == 0:  # the job's figures, for elastrun status
            self._publish = loop.create_task(self._publish_loop())

    async def _watch(self, path: str) -> None:
        while True:
            await asyncio.sleep(POLL_EVERY)
            self._read(path)

    async def _publish_loop(self) -> None:
        rendezvous, round_ = self.feature.core.rendezvous, self.group.result.round
        while True:
            await asyncio.sleep(PUBLISH_EVERY)
            note = GoodputNote(round_, round(time.time(), 3), self.feature.figures())
            await rendezvous.write_note(note)  # never raises

    async def ended(self) -> None:
        if self._publish is not None:
            self._publish.cancel()
        if self._poll is not None:
            self._poll.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poll
            path = self._file()
            if path is not None:
                self._read(path)
        self.ledger.ended(self.feature.now())

    async def failed(self) -> str:
        if not self._counted:
            self._counted = True
            hang = any(w.declared is not None for w in self.group.workers)
            self.ledger.restarting(hang=hang)
        return ""

    async def changed(self, change: Change) -> None:
        if change.counts_as_restart and not self._counted:
            self._counted = True
            self.ledger.restarting()
        elif not change.counts_as_restart:
            self.ledger.changing()


def _median(values: Iterable[float]) -> float:
    """The median of a few paces (not statistics': with decimal and
    fractions, milliseconds of every agent's start)."""
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2
