"""Goodput: the share of wall time that turned into training, accounted per cause.

Each agent keeps a :class:`Ledger` of its node's time, fed from what it
already sees: its rounds (a round's workers start; the round ends; a restart
is counted, for a failure here or on another node; a hang was declared here),
and the progress record of its first local rank (worker/_progress.py, read
every ``POLL_EVERY`` seconds while the round runs): when this process's first
step ended and at which step, the time of the last progress and its step,
the median step time, and the seconds spent in ``checkpoint`` phases
(``torch.save``, ``torch.load``, elastrun's checkpoint helpers, a
``MemoryCheckpoint`` save). Every second of the agent's life goes to exactly
one cause:

========== ==============================================================
training   from a round's first step to its end, less the two below
saves      blocked in checkpoint phases (taken out of training)
redone     steps done again after a restart: the steps between the step
           resumed from and the newest step reached before, times the
           step time (taken out of the training that follows the restart)
restart    from a restart's cause (a failure here, or another node's
           failure or lost node that ends the round) to the first step after
           it: stopping, the failure summary, the rendezvous, the start
hang       from a rank's last progress to the hang being declared here
waiting    a round ended by a membership change that is no restart (a node
           joining), to the first step after it; the exit barrier
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
count as training. The steps done between the last record read and a crash
are estimated from the step time. A hang declared on another node ends this
node's round as a restart: the time its ranks waited in a collective before
counts as training here.

The ledger is pure (times given, no clock, no I/O): tests/unit/test_goodput.py
drives it in virtual time. :class:`GoodputAccounting` is its driver, a feature
of the agent; at the end it emits a ``goodput`` event and prints
:meth:`Goodput.line`.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from elastrun.agent.hang_group import progress_file
from elastrun.agent.hooks import Core, Feature, RoundHooks
from elastrun.agent.watchdog import Beat, read_beat
from elastrun.event_kinds import GoodputAccounted
from elastrun.fields import Fields
from elastrun.rendezvous.api import Change

if TYPE_CHECKING:
    from elastrun.agent.workers import WorkerGroup

__all__ = ["POLL_EVERY", "Cause", "Goodput", "GoodputAccounting", "Ledger", "features"]

POLL_EVERY = 0.5  # s between two reads of the progress record while a round runs
# The record read at a round's end lags the last progress by at most the
# runner's write interval (worker/_progress.py): steps are extrapolated over
# that much at most.
RECORD_LAG = 1.0


class Cause(StrEnum):
    TRAINING = "training"
    RESTART = "restart"
    REDONE = "redone"
    SAVES = "saves"
    WAITING = "waiting"
    HANG = "hang"
    STARTUP = "startup"


LOSSES = (Cause.RESTART, Cause.REDONE, Cause.HANG, Cause.SAVES, Cause.WAITING)


@dataclass(frozen=True)
class Goodput:
    """The figures at one time: seconds per cause, and what was counted."""

    seconds: dict[str, float]  # Cause -> s
    failures: int = 0  # restarts counted (a failure here or elsewhere)
    hangs: int = 0  # hangs declared here
    steps_redone: int = 0
    steps_known: bool = False  # the script reports its step numbers (redone steps seen)

    def of(self, cause: Cause) -> float:
        return self.seconds.get(cause.value, 0.0)

    @property
    def accounted(self) -> float:
        """The wall time the figure is over (all but the start-up)."""
        return sum(v for k, v in self.seconds.items() if k != Cause.STARTUP)

    @property
    def ratio(self) -> float | None:
        """training / accounted; None before the first step (no training)."""
        total, training = self.accounted, self.of(Cause.TRAINING)
        return training / total if training > 0 and total > 0 else None

    def losses(self) -> list[tuple[Cause, float]]:
        """The causes of loss, the largest first (those with time only)."""
        found = [(c, self.of(c)) for c in LOSSES if self.of(c) > 0]
        return sorted(found, key=lambda cs: -cs[1])

    def line(self) -> str:
        """One line, e.g. ``goodput 96.1%: 11 failures cost 5.7 s (0 steps
        redone), saves 7%``."""
        ratio = self.ratio
        if ratio is None:
            return "goodput unknown: no training step seen (the script reports no steps)"
        total = self.accounted
        failed = self.of(Cause.RESTART) + self.of(Cause.REDONE) + self.of(Cause.HANG)
        redone = f"{self.steps_redone} steps redone" if self.steps_known else "redone steps unseen"
        n = self.failures
        parts = [f"{n} failure{'' if n == 1 else 's'} cost {failed:.1f} s ({redone})"]
        if self.hangs:
            parts.append(
                f"{self.hangs} hang{'' if self.hangs == 1 else 's'} {self.of(Cause.HANG):.1f} s"
            )
        for cause in (Cause.SAVES, Cause.WAITING):
            if self.of(cause) > 0:
                parts.append(f"{cause.value} {100 * self.of(cause) / total:.0f}%")
        return f"goodput {100 * ratio:.1f}%: " + ", ".join(parts)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["seconds"] = {k: round(v, 3) for k, v in self.seconds.items()}
        out["goodput"] = None if self.ratio is None else round(self.ratio, 4)
        return out

    @classmethod
    def from_json(cls, data: object) -> Goodput:
        """Read back (``ValueError`` naming the field when it is not one)."""
        f = Fields(data, "goodput figures")
        raw = f.raw.get("seconds")
        if not isinstance(raw, dict) or not all(
            k in Cause.__members__.values() and isinstance(v, (int, float)) and v >= 0
            for k, v in raw.items()
        ):
            raise ValueError("goodput figures: field seconds: not seconds per cause")
        return cls(
            {str(k): float(v) for k, v in raw.items()},
            failures=f.maybe_int("failures") or 0,
            hangs=f.maybe_int("hangs") or 0,
            steps_redone=f.maybe_int("steps_redone") or 0,
            steps_known=f.raw.get("steps_known") is True,
        )


@dataclass
class _Round:
    """What the ledger keeps of the round that runs."""

    first: bool = False  # its first step was seen
    last_at: float | None = None  # its last progress
    step: int | None = None
    saving: float = 0.0  # s in checkpoint phases seen so far (the process's count)


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

    # ------------------------------------------------------------ feeding
    def started(self, now: float) -> None:
        """A round's workers start."""
        self.run = _Round()

    def beat(self, b: Beat) -> None:
        """The progress record of the round's (first local) rank, read now."""
        r = self.run
        if r is None or b.first_at is None:
            return  # between rounds, or no step yet
        if b.step_time is not None:
            self.step_time = b.step_time
        if not r.first:
            r.first = True
            self._account(max(b.first_at, self.mark))
            self.cause = Cause.TRAINING
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

    def ended(self, now: float) -> None:
        """The round is over (its workers exited, one failed, or it must end);
        until a restart is counted, what follows is waiting."""
        self._account(now)
        self.cause, self.ended_at = Cause.WAITING, now
        self.last, self.run = self.run, None

    def restarting(self, *, hang: bool = False) -> None:
        """The round that ended is a restart (a failure here or elsewhere);
        ``hang``: a rank was declared hung here (its time since its last
        progress was lost)."""
        self.failures += 1
        self.cause = Cause.RESTART
        last, end = self.last, self.ended_at
        if not hang or last is None or last.last_at is None or end is None:
            return
        self.hangs += 1
        lost = min(max(0.0, end - last.last_at), self.seconds[Cause.TRAINING])
        self.seconds[Cause.TRAINING] -= lost
        self.seconds[Cause.HANG] += lost
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
        last, high, end = self.last, self.high, self.ended_at
        if not b.reported or b.first_step is None or high is None or last is None:
            return
        step_time = self.step_time
        reached = high
        if step_time and end is not None and last.last_at is not None:
            # Steps made after the last record read, before the round ended.
            reached += int(min(RECORD_LAG, max(0.0, end - last.last_at)) / step_time)
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

    def now(self) -> float:
        return self.core.clock.monotonic()

    def figures(self) -> Goodput:
        return self.ledger.figures(self.now())

    def round(self, group: WorkerGroup) -> RoundHooks:
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
        path = self._file()
        if path is not None:
            self._poll = asyncio.get_running_loop().create_task(self._watch(path))

    async def _watch(self, path: str) -> None:
        while True:
            await asyncio.sleep(POLL_EVERY)
            self._read(path)

    async def ended(self) -> None:
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
