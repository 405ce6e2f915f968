"""Hang diagnosis, a feature of the agent: progress, the hang watchdog, the
stacks of hung ranks, the stragglers.

What it does in each round (:class:`RoundHangs`, the feature's hooks):

* gives every worker a progress file (``ELASTRUN_HEARTBEAT_FILE``; the runner
  records progress there, worker/_progress.py) and, with a watchdog and the
  runner, a stacks file and the stack signal (agent/stacks.py);
* with ``--hang-timeout``, watches each rank's progress (agent/watchdog.py).
  Progress a runner relays over its channel, because it cannot write its
  file, goes to the watchdog; a rank the watchdog cannot judge is reported
  once (agent/progress_faults.py);
* when the watchdog fires, collects every live local rank's Python stack (a
  rank whose script no longer catches the stack signal is skipped, never
  signalled), names the rank stuck in code of its own the hung one, and
  declares it failed (``WorkerGroup.declare``): the hang is the group's
  failure, and the root cause unless a rank failed by itself before;
* shares the stacks with the other nodes as job notes, and prints every
  node's in the failure summary (agent/hangs.py); on another node's hang
  (a change with ``hang``), shares this node's;
* publishes the ranks' step times and names stragglers (agent/stragglers.py);
  with ``--replace-stragglers``, a persistent one is replaced by a waiting
  spare (agent/straggler_replacement.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
from dataclasses import dataclass

from elastrun.agent import hangs, stragglers
from elastrun.agent.hooks import Core, Feature, RoundHooks
from elastrun.agent.progress_faults import ProgressFaults
from elastrun.agent.stacks import (
    STACK_SIGNAL_ENV,
    STACKS_ENV,
    RankStacks,
    collect,
    hung_rank,
    in_torch,
    main_thread,
    top_frame,
)
from elastrun.agent.straggler_replacement import Replacement
from elastrun.agent.watchdog import (
    HEARTBEAT_ENV,
    HEARTBEAT_INTERVAL_ENV,
    Hang,
    HangPolicy,
    HangWatchdog,
    heartbeat_interval,
    parse_beat,
)
from elastrun.agent.workers import Worker, WorkerGroup
from elastrun.event_kinds import HangDetected, HangSuspected, StacksSkipped
from elastrun.procs import signal_name
from elastrun.rendezvous.api import Change
from elastrun.worker._messages import Message, Progress, ProgressFailed

__all__ = ["PROGRESS_INTERVAL", "HangDiagnosis", "RoundHangs", "features", "progress_file"]

HANG_TASK_WAIT = 5.0  # s a round's end waits for a hang being declared (its stacks)
# s between two writes of a rank's progress record (when it changed): the
# goodput accounting's resolution (agent/goodput.py); a write is one small file.
PROGRESS_INTERVAL = 0.1


def features(core: Core) -> list[Feature]:
    return [HangDiagnosis(core)]


def progress_file(worker: Worker) -> str:
    """Where ``worker``'s runner records its progress (the goodput
    accounting reads it too: agent/goodput.py)."""
    return os.path.join(worker.folder, "heartbeat.json")


class HangDiagnosis(Feature):
    """Hang diagnosis across the agent's rounds."""

    def __init__(self, core: Core) -> None:
        self.core = core
        # Progress the agent cannot see: said once (across rounds).
        self.faults = ProgressFaults(core.events, core.say)

    def round(self, group: WorkerGroup) -> RoundHangs:
        return RoundHangs(self.core, group, self.faults)


@dataclass
class _Rank:
    """What the feature keeps of one local rank in a round."""

    heartbeat_file: str | None = None
    stacks_file: str | None = None
    stacks: str | None = None  # its Python stacks, once collected
    stacks_skipped: str | None = None  # why its stacks were not asked for
    main_thread: int | None = None
    since: float | None = None  # when its process was prepared for this round (monotonic)


class RoundHangs(RoundHooks):
    """One round's progress files, watchdog, stacks and step times."""

    def __init__(self, core: Core, group: WorkerGroup, faults: ProgressFaults) -> None:
        self.core = core
        self.spec = core.spec
        self.group = group
        self.faults = faults
        self.watchdog: HangWatchdog | None = None
        if self.spec.hang.timeout is not None:
            policy = HangPolicy(self.spec.hang.timeout, self.spec.hang.auto)
            self.watchdog = HangWatchdog(
                policy, self._on_hang, core.clock, on_unknown=self._progress_unknown
            )
        self.ranks = {w.local_rank: _Rank() for w in group.workers}
        self._hang_task: asyncio.Task[None] | None = None
        self._publish: asyncio.Task[None] | None = None
        self._over = False  # the round ended: a hang is no longer declared

    # ---------------------------------------------------------------- hooks
    def worker_env(self, worker: Worker) -> dict[str, str]:
        r, spec, env = self.ranks[worker.local_rank], self.spec, {}
        r.since = self.core.clock.monotonic()  # before it starts or enters again
        # Progress: for the watchdog, and (from the runner) the step times.
        if self.watchdog is not None or self.group.runs_runner:
            r.heartbeat_file = env[HEARTBEAT_ENV] = progress_file(worker)
            interval = PROGRESS_INTERVAL
            if spec.hang.timeout is not None:  # the watchdog's own pace
                interval = heartbeat_interval(spec.hang.timeout)
            env[HEARTBEAT_INTERVAL_ENV] = repr(interval)
        if (
            self.watchdog is not None
            and self.group.runs_runner
            and spec.hang.stack_signal is not None
        ):
            r.stacks_file = env[STACKS_ENV] = os.path.join(worker.folder, "stacks.txt")
            env[STACK_SIGNAL_ENV] = str(spec.hang.stack_signal)
        # Stale files: of an earlier run with this run id, or a kept process's
        # progress record of the last round (removed, the rank is judged from
        # its first progress in this one). Never the stacks file of a kept
        # process: its runner's handler writes to that file's descriptor, and
        # with the file gone the rank would look like one without a handler,
        # never signalled, its stack missing from this round's verdict. (A
        # standby makes its file once it has a rank, after this.)
        kept = worker.popen is not None and not worker.standby
        for stale in (r.heartbeat_file, None if kept else r.stacks_file):
            if stale is not None:
                with contextlib.suppress(OSError):
                    os.unlink(stale)
        return env

    def started(self) -> None:
        files = [
            stragglers.RankFile(
                w.rank, path, w.pid if w.popen else None, w.taken_over, w.standby or None
            )
            for w in self.group.workers
            if (path := self.ranks[w.local_rank].heartbeat_file) is not None
        ]
        if self.watchdog is not None:
            for w in self.group.workers:
                path = self.ranks[w.local_rank].heartbeat_file
                if path is not None and w.popen is not None and not w.done:
                    open_channel = w.channel is not None and w.channel.open
                    since = self.ranks[w.local_rank].since
                    self.watchdog.watch(w.local_rank, path, channel=open_channel, since=since)
        core = self.core
        replacement = Replacement(
            core.rendezvous,
            self.spec.stragglers,
            core.rendezvous.settings.sizes(),
            core.events,
            core.departure,
            self.spec.host,
        )
        self._publish = asyncio.ensure_future(
            stragglers.publish_loop(
                core.rendezvous,
                files,
                self.group.result,
                self.spec.host,
                core.events,
                every=self.spec.stragglers.interval,
                replacement=replacement,
            )
        )

    def on_message(self, worker: Worker, message: Message) -> None:
        if isinstance(message, Progress | ProgressFailed):
            self._relayed(worker, message)

    def channel_closed(self, worker: Worker) -> None:
        if self.watchdog is not None:
            self.watchdog.channel_closed(worker.local_rank)

    def exited(self, worker: Worker) -> None:
        if self.watchdog is not None:
            self.watchdog.forget(worker.local_rank)

    async def ended(self) -> None:
        if self._publish is not None:
            self._publish.cancel()
        if self.watchdog is not None:
            self.watchdog.close()  # nobody is judged any more
        if self._hang_task is not None and not self._hang_task.done():
            await asyncio.wait({self._hang_task}, timeout=HANG_TASK_WAIT)
        self._over = True

    async def failed(self) -> str:
        """Every rank's stacks when this node declared a hang ("" otherwise)."""
        if not any(w.declared is not None for w in self.group.workers):
            return ""
        result, rendezvous = self.group.result, self.core.rendezvous
        own = self.local_stacks()
        await hangs.share(rendezvous, result, own)
        every = await hangs.gather(rendezvous, result, own)
        report = hangs.summary(every, self.group.attempt_dir if self.spec.logs.dir else None)
        return "\n".join(x for x in (report, self.skipped_stacks()) if x)

    async def changed(self, change: Change) -> None:
        if change.hang:
            # A hang declared on another node: our ranks' stacks, for its summary.
            await self.collect_stacks()
            await hangs.share(self.core.rendezvous, self.group.result, self.local_stacks())

    # ------------------------------------------------------------- progress
    def _relayed(self, w: Worker, message: Progress | ProgressFailed) -> None:
        """The runner cannot write the progress file: it says so, then sends
        each new record here (worker/_progress.py)."""
        beat = parse_beat(message.beat) if isinstance(message, Progress) else None
        if self.watchdog is not None:
            self.watchdog.relayed(w.local_rank, beat)
        self.faults.write_failed(
            rank=w.rank,
            local_rank=w.local_rank,
            attempt=self.group.attempt,
            round_=self.group.result.round,
            path=self.ranks[w.local_rank].heartbeat_file,
            error=message.error,
            relayed=w.channel is not None and w.channel.open,
            watched=self.watchdog is not None,
        )

    def _progress_unknown(self, local_rank: int, why: str) -> None:
        w = self.group.workers[local_rank]
        self.faults.unknown(
            rank=w.rank,
            local_rank=local_rank,
            attempt=self.group.attempt,
            round_=self.group.result.round,
            why=why,
        )

    # --------------------------------------------------------------- stacks
    async def collect_stacks(self) -> dict[int, str]:
        """Every live local rank's Python stacks (by local rank), also kept
        for the failure summary. Bounded (agent/stacks.py). A rank whose
        script no longer catches the stack signal is skipped (why: its
        ``stacks_skipped``), never signalled."""
        signum = self.spec.hang.stack_signal
        live = {
            w.local_rank: (w.pid, r.stacks_file)
            for w in self.group.workers
            if (r := self.ranks[w.local_rank]).stacks_file is not None
            and w.popen is not None
            and not w.done
        }
        if not live or signum is None:
            return {}

        def signalling(lr: int) -> None:  # before it can die of it: the agent's doing
            self.group.signalling(lr, signum)

        got = await collect(live, clock=self.core.clock, signum=signum, on_signal=signalling)
        for lr, why in got.skipped.items():
            w, r = self.group.workers[lr], self.ranks[lr]
            if r.stacks_skipped is not None:
                continue  # said at an earlier collection
            r.stacks_skipped = why
            self.core.say(f"elastrun: rank {w.rank}: Python stacks not collected: {why}")
            self.core.events.emit(
                StacksSkipped(
                    rank=w.rank,
                    local_rank=lr,
                    signal=signal_name(signum),
                    why=why,
                    round=self.group.result.round,
                    attempt=self.group.attempt,
                )
            )
        for lr, dump in got.dumps.items():
            r = self.ranks[lr]
            r.stacks = dump
            r.main_thread = main_thread(r.stacks_file) if r.stacks_file else None
        return got.dumps

    def local_stacks(self) -> list[RankStacks]:
        """This node's ranks' stacks, as the notes carry them."""
        host = self.spec.host
        return [
            RankStacks.of(w.rank, host, r.stacks, r.main_thread, hung=w.declared is not None)
            for w in self.group.workers
            if (r := self.ranks[w.local_rank]).stacks is not None
        ]

    def skipped_stacks(self) -> str:
        """Lines for the failure summary: the local ranks whose stacks were
        not collected, and why ("" when none)."""
        return "\n".join(
            f"rank {w.rank} on {self.spec.host or '?'}: no stacks: {r.stacks_skipped}"
            for w in self.group.workers
            if (r := self.ranks[w.local_rank]).stacks_skipped is not None
        )

    # ----------------------------------------------------------------- hang
    def _on_hang(self, hang: Hang) -> None:
        """The watchdog found a rank without progress: collect every local
        rank's stacks first (bounded), then declare the hang."""
        if self._over or self._hang_task is not None:
            return
        self._hang_task = asyncio.ensure_future(self._declare_hang(hang))

    def _in_torch(self, lr: int) -> bool:
        r = self.ranks[lr]
        return r.stacks is not None and in_torch(r.stacks, r.main_thread)

    def _hung_one(self, hang: Hang) -> Worker:
        """The hung rank (agent/stacks.py ``hung_rank``): the one the watchdog
        judged, unless its stack does not show it in code of its own while
        another live rank's does, that one also without progress for half
        the timeout."""
        dumps = {
            lr: (r.stacks, r.main_thread) for lr, r in self.ranks.items() if r.stacks is not None
        }
        workers, watchdog = self.group.workers, self.watchdog
        live = [lr for lr in dumps if not workers[lr].done]
        # Seconds since its last progress in this round (None: unknown).
        idle = {lr: watchdog.latest(lr)[1] for lr in live} if watchdog is not None else {}
        return workers[hung_rank(hang.key, dumps, idle, hang.timeout)]

    async def _declare_hang(self, hang: Hang) -> None:
        await self.collect_stacks()
        w = self._hung_one(hang)
        if w.done or self._over or self.watchdog is None:
            return
        r = self.ranks[w.local_rank]
        waits = self.spec.hang.auto and self._in_torch(w.local_rank)
        if waits and not self.watchdog.is_patient(w.local_rank):
            # Waiting for a peer: the culprit is elsewhere (see watchdog.py).
            self.core.events.emit(
                HangSuspected(
                    rank=w.rank,
                    idle_s=round(hang.idle, 3),
                    sits_in=str(top_frame(r.stacks or "", r.main_thread)),
                    round=self.group.result.round,
                )
            )
            self._hang_task = None
            self.watchdog.wait_longer(w.local_rank)
            return
        beat, since = self.watchdog.latest(w.local_rank)
        last_step = beat.step if beat is not None else hang.last_step
        step = "no step reported" if last_step is None else f"last step {last_step}"
        if self.spec.hang.auto:
            during = f", in phase {hang.phase}" if hang.phase else ""
            idle = since if since is not None and math.isfinite(since) else hang.idle
            why = (
                f"rank {w.rank} made no progress for {idle:.0f} s "
                f"(timeout auto: {hang.timeout:g} s; {step}{during})"
            )
        else:
            why = f"rank {w.rank} made no progress for {hang.timeout:g} s ({step})"
        self.group.declare(w, why)
        self.core.events.emit(
            HangDetected(
                rank=w.rank,
                local_rank=w.local_rank,
                pid=w.pid,
                last_step=last_step,
                idle_s=round(hang.idle, 3),
                hang_timeout=round(hang.timeout, 3),
                auto=self.spec.hang.auto,
                phase=hang.phase,
                judged_rank=self.group.workers[hang.key].rank,
                sits_in={
                    self.group.workers[lr].rank: str(top_frame(r.stacks, r.main_thread))
                    for lr, r in self.ranks.items()
                    if r.stacks is not None
                },
                round=self.group.result.round,
                attempt=self.group.attempt,
            )
        )
