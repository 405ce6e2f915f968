"""A hang on this node's worker group: the stacks, the hung rank, the
progress relayed over the runners' channels.

The part of :class:`~elastrun.agent.workers.WorkerGroup` that the hang
watchdog (agent/watchdog.py) drives:

* progress a runner relays over its channel, because it cannot write its
  file, goes to the watchdog; a rank the watchdog cannot judge is reported
  once (agent/progress_faults.py);
* when the watchdog fires, every live local rank's Python stack is collected
  (agent/stacks.py). A rank whose script no longer catches the stack signal
  is skipped, never signalled. The rank stuck in code of its own is named the
  hung one, and the hang fails the group as its root cause.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import TYPE_CHECKING

from elastrun.agent.progress_faults import ProgressFaults
from elastrun.agent.spec import WorkerSpec
from elastrun.agent.stacks import collect, in_torch, main_thread, ordered, top_frame
from elastrun.agent.watchdog import Hang, HangWatchdog, parse_beat
from elastrun.clock import Clock
from elastrun.events import EventSink
from elastrun.procs import say, signal_name
from elastrun.rendezvous.api import RoundResult
from elastrun.worker._messages import Progress, ProgressFailed

if TYPE_CHECKING:
    from elastrun.agent.workers import Worker

__all__ = ["GroupHangs"]


class GroupHangs:
    """Mixed into WorkerGroup: its hang declaration and relayed progress."""

    spec: WorkerSpec
    result: RoundResult
    attempt: int
    events: EventSink
    clock: Clock
    workers: list[Worker]
    watchdog: HangWatchdog | None
    progress_faults: ProgressFaults
    _changed: asyncio.Event
    _closed: bool
    _hang_task: asyncio.Task[None] | None

    def _relayed(self, w: Worker, message: Progress | ProgressFailed) -> None:
        """The runner cannot write the progress file: it says so, then sends
        each new record here (worker/_progress.py)."""
        beat = parse_beat(message.beat) if isinstance(message, Progress) else None
        if self.watchdog is not None:
            self.watchdog.relayed(w.local_rank, beat)
        self.progress_faults.write_failed(
            rank=w.rank,
            local_rank=w.local_rank,
            attempt=self.attempt,
            round_=self.result.round,
            path=w.heartbeat_file,
            error=message.error,
            relayed=w.channel is not None and w.channel.open,
            watched=self.watchdog is not None,
        )

    def _progress_unknown(self, local_rank: int, why: str) -> None:
        w = self.workers[local_rank]
        self.progress_faults.unknown(
            rank=w.rank,
            local_rank=local_rank,
            attempt=self.attempt,
            round_=self.result.round,
            why=why,
        )

    def _on_hang(self, hang: Hang) -> None:
        """The watchdog found a rank without progress: collect every local
        rank's stacks first (bounded), then fail the group."""
        if self._closed or self._hang_task is not None:
            return
        self._hang_task = asyncio.ensure_future(self._declare_hang(hang))

    async def collect_stacks(self) -> dict[int, str]:
        """Every live local rank's Python stacks (by local rank), also kept on
        the workers for the failure summary. Bounded (agent/stacks.py). A rank
        whose script no longer catches the stack signal is skipped (why: its
        ``stacks_skipped``), never signalled."""
        live = {
            w.local_rank: (w.pid, w.stacks_file)
            for w in self.workers
            if w.stacks_file is not None and w.popen is not None and not w.done
        }
        if not live or self.spec.stack_signal is None:
            return {}

        signum = self.spec.stack_signal

        def signalled(lr: int) -> None:  # before it can die of it
            self.workers[lr].agent_signals.add(signum)

        got = await collect(
            live, clock=self.clock, signum=self.spec.stack_signal, on_signal=signalled
        )
        for lr, why in got.skipped.items():
            w = self.workers[lr]
            if w.stacks_skipped is not None:
                continue  # said at an earlier collection
            w.stacks_skipped = why
            say(f"elastrun: rank {w.rank}: Python stacks not collected: {why}")
            self.events.emit(
                "stacks_skipped",
                rank=w.rank,
                local_rank=lr,
                signal=signal_name(self.spec.stack_signal),
                why=why,
                round=self.result.round,
                attempt=self.attempt,
            )
        for lr, dump in got.dumps.items():
            w = self.workers[lr]
            w.stacks = dump
            w.main_thread = main_thread(w.stacks_file) if w.stacks_file else None
        return got.dumps

    def skipped_stacks(self) -> str:
        """Lines for the failure summary: the local ranks whose stacks were
        not collected, and why ("" when none)."""
        return "\n".join(
            f"rank {w.rank} on {self.spec.host or '?'}: no stacks: {w.stacks_skipped}"
            for w in self.workers
            if w.stacks_skipped is not None
        )

    def _hung_one(self, hang: Hang) -> Worker:
        """The hung rank: the one the watchdog judged, unless it waits in torch
        (for a peer) while another rank, also without progress for half the
        timeout, sits in code of its own: that one is the culprit."""
        judged = self.workers[hang.key]
        if judged.stacks is None or not in_torch(judged.stacks, judged.main_thread):
            return judged
        dumps = {
            w.local_rank: (w.stacks, w.main_thread) for w in self.workers if w.stacks is not None
        }
        for lr in ordered(dumps, range(len(self.workers))):
            w, got = self.workers[lr], dumps.get(lr)
            if got is None or in_torch(*got) or w.done or self.watchdog is None:
                continue
            _, idle = self.watchdog.latest(lr)  # None: its progress is unknown
            if idle is not None and idle >= hang.timeout / 2:
                return w
        return judged

    async def _declare_hang(self, hang: Hang) -> None:
        await self.collect_stacks()
        w = self._hung_one(hang)
        if w.done or self._closed:
            return
        if (
            self.spec.hang_auto
            and self.watchdog is not None
            and w.stacks is not None
            and in_torch(w.stacks, w.main_thread)
            and not self.watchdog.is_patient(w.local_rank)
        ):
            # Waiting for a peer: the culprit is elsewhere (see watchdog.py).
            self.events.emit(
                "hang_suspected",
                rank=w.rank,
                idle_s=round(hang.idle, 3),
                sits_in=str(top_frame(w.stacks, w.main_thread)),
                round=self.result.round,
            )
            self._hang_task = None
            self.watchdog.wait_longer(w.local_rank)
            return
        beat, since = self.watchdog.latest(w.local_rank) if self.watchdog else (None, None)
        last_step = beat.step if beat is not None else hang.last_step
        step = "no step reported" if last_step is None else f"last step {last_step}"
        if self.spec.hang_auto:
            during = f", in phase {hang.phase}" if hang.phase else ""
            idle = since if since is not None and math.isfinite(since) else hang.idle
            w.hang = (
                f"rank {w.rank} made no progress for {idle:.0f} s "
                f"(timeout auto: {hang.timeout:g} s; {step}{during})"
            )
        else:
            w.hang = f"rank {w.rank} made no progress for {hang.timeout:g} s ({step})"
        w.hang_monotonic = self.clock.monotonic()
        w.hang_wall = time.time()
        self.events.emit(
            "hang_detected",
            rank=w.rank,
            local_rank=w.local_rank,
            pid=w.pid,
            last_step=last_step,
            idle_s=round(hang.idle, 3),
            hang_timeout=round(hang.timeout, 3),
            auto=self.spec.hang_auto,
            phase=hang.phase,
            judged_rank=self.workers[hang.key].rank,
            sits_in={
                x.rank: str(top_frame(x.stacks, x.main_thread))
                for x in self.workers
                if x.stacks is not None
            },
            round=self.result.round,
            attempt=self.attempt,
        )
        self._changed.set()
