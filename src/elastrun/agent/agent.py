"""The elastic agent: one per node; runs rounds of workers until the job ends.

The loop (see :mod:`elastrun.rendezvous.api`)::

    next_round -> start workers -> first of: workers exited | membership change | signal
      all ok     -> complete() (exit barrier), exit 0
      a failure  -> stop workers, failure summary, request_restart() (budget) -> next round
      change     -> stop workers (not counted) -> next round
      signal     -> forward it, stop workers, leave, exit 128 + signum (SIGTERM: 143)
    finally: rendezvous.shutdown() (leave; never closes the job for the others)

Signal handlers only enqueue; the loop acts on them. A second terminating
signal during a stop cuts the grace short (SIGKILL at once).

**The core and its features.** The core is this loop (with its signals and
the log folder) and one round's workers (agent/workers.py: spawned, watched,
stopped, reaped). Everything else the agent does is a *feature* that plugs
into the core's hooks (agent/hooks.py), listed in :data:`FEATURES`:

* warm starts (agent/warm.py, agent/zygote.py) and the module learning
  that feeds them (agent/modlearn.py);
* hang diagnosis: the watchdog, the stacks, the stragglers
  (agent/hang_group.py, with watchdog.py, stacks.py, hangs.py,
  stragglers.py, progress_faults.py);
* the wait, before a restart, for the stopped workers' GPU memory
  (agent/gpu_release.py);
* memory checkpoints: the workers' snapshots in shared memory, kept across
  worker restarts and written to disk in the background (agent/memory.py);
* torch's file timers (agent/file_timers.py): the server of
  ``TORCHELASTIC_TIMER_FILE``; the health check of
  ``TORCHELASTIC_HEALTH_CHECK_PORT`` (agent/health_check.py).

Why hooks rather than a richer core: each feature is several kinds of code
(a process of its own, per-round state, job notes, its events and console
lines), and a core that calls it directly must know all of them; a change to
one feature would then be a change to the core. With hooks, the core knows
only *when* things happen (the agent starts; a round is joined; a round's
workers start, send a message, exit; the round ends, fails or changes; a
child changes state; the agent ends) and a feature knows *what* it does
then. The hooks are few and typed, with no-op defaults, so a feature
overrides only its own. Two kinds keep per-round state out of long-lived
objects: a :class:`~elastrun.agent.hooks.Feature` lives as long as the
agent, and makes a :class:`~elastrun.agent.hooks.RoundHooks` for each round,
which goes with it. Features get what they may use of the agent
(:class:`~elastrun.agent.hooks.Core`) when they are made, never the agent
itself. The core has two generic ways to be acted on: a feature may start
workers (``fork``) and may declare a running rank failed
(``WorkerGroup.declare``); a failure's root cause is then decided by the one
rule (agent/failures.py ``roles``). The rendezvous gets its callbacks the same
explicit way (``Rendezvous.attach``).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
from collections.abc import Callable, Sequence
from typing import Any

from elastrun.agent import (
    file_timers,
    goodput,
    gpu_release,
    hang_group,
    health_check,
    memory,
    metrics_server,
    node_health,
    warm,
)
from elastrun.agent.attribution import Attribution
from elastrun.agent.children import Reaper
from elastrun.agent.env import check_round
from elastrun.agent.failures import (
    ROOT_CAUSE,
    SETTLE_TIMEOUT,
    change_line,
    classify,
    elsewhere,
    failure_record,
    format_summary,
    summary_title,
    with_report,
)
from elastrun.agent.guard import OrphanGuard
from elastrun.agent.hooks import Core, Feature, Leave
from elastrun.agent.log_dirs import (
    claim_host_dir,
    error_files,
    open_event_log,
    release_host_dir,
    temp_dir,
)
from elastrun.agent.logs import LogWriteErrors, needs_files
from elastrun.agent.metrics import Metrics
from elastrun.agent.process import Worker
from elastrun.agent.refusals import RefusalWatch
from elastrun.agent.restart_charge import RoundEnd
from elastrun.agent.signals import Signalled, SignalRouter, StopSignals
from elastrun.agent.spec import WorkerSpec
from elastrun.agent.standby import Standbys
from elastrun.agent.waiting import WaitingConsole
from elastrun.agent.workers import WorkerGroup, stop_unowned
from elastrun.clock import SYSTEM_CLOCK, Clock
from elastrun.errors import ElastrunError, RendezvousClosed, RestartBudgetExhausted
from elastrun.event_kinds import (
    JobFailed,
    JobFinished,
    RanksLeft,
    RootCauseElsewhere,
    SignalForwarded,
    StandbyUsed,
    WorkersStarted,
    WorkersSucceeded,
)
from elastrun.events import EventSink, JsonLinesSink, NullSink, TeeSink
from elastrun.failure import FailureRecord, same_failure
from elastrun.frozen import frozen
from elastrun.procs import say, signal_name
from elastrun.rendezvous.api import Change, Rendezvous, RendezvousHooks, RoundResult
from elastrun.untrusted import printable

__all__ = ["FEATURES", "Agent"]

RDZV_SHUTDOWN_TIMEOUT = 30.0

# The agent's features, each module's own factory; their hooks run in this order.
# The node's own health check first: a node that fails it says so and leaves
# before warm starts wait (bounded) for the warm interpreter's imports.
FEATURES: tuple[Callable[[Core], list[Feature]], ...] = (
    node_health.features,
    warm.features,
    hang_group.features,
    gpu_release.features,
    memory.features,
    file_timers.features,
    health_check.features,
    goodput.features,
    metrics_server.features,
)


@frozen
class WorkersExited:
    """The round's workers ended: all exited 0 (``succeeded``), or one failed."""

    succeeded: bool


async def _exited(group: WorkerGroup) -> WorkersExited:
    return WorkersExited(await group.wait())


class Agent:
    """Runs ``spec``'s workers for the rounds of ``rendezvous`` until the job ends.

    ``await Agent(spec, rdzv, events).run()`` returns the process exit code:
    0 success (or the job was already finished), 1 failure (restart budget
    spent, rendezvous error, workers that cannot be started), 128+signum when
    stopped by a signal. Must run in the main thread for signal handling and
    so that the workers' parent-death signal is tied to a long-lived thread.
    ``features``: the factories of its features (default :data:`FEATURES`).
    ``metrics``: the Prometheus registry the launcher feeds the rendezvous'
    events to (made here, fed the agent's, when not given: agent/metrics.py).
    """

    def __init__(
        self,
        spec: WorkerSpec,
        rendezvous: Rendezvous,
        events: EventSink | None = None,
        clock: Clock = SYSTEM_CLOCK,
        features: Sequence[Callable[[Core], list[Feature]]] = FEATURES,
        *,
        metrics: Metrics | None = None,
    ) -> None:
        # ``spec`` comes checked from the launcher's plan (launcher/plan.py).
        self.spec = spec
        self.rendezvous = rendezvous
        self.clock = clock
        self._events_file: JsonLinesSink | None = None
        sink: EventSink = events if events is not None else NullSink()
        if spec.events_file:
            self._events_file = open_event_log(spec.events_file, "--events-file", host=spec.host)
            sink = TeeSink(sink, self._events_file)
        if metrics is None:
            metrics = Metrics()
            sink = TeeSink(sink, metrics)
        self.metrics = metrics
        self.events: EventSink = sink
        self._log_errors = LogWriteErrors(sink, say)
        self._stops = StopSignals()
        self._group: WorkerGroup | None = None
        # In-process restarts: processes that left the last round's function,
        # by local rank, until the next round's group takes them over.
        self._kept: dict[int, Worker] = {}
        self._attempt = -1
        self._base_dir: str | None = None
        self._temp_base = False
        self._host_pidfile: str | None = None
        self._router: SignalRouter | None = None
        # The failure that ended the job on this node, once its workers failed
        # with no restarts left (the launcher passes its error file on).
        self.ended_by: FailureRecord | None = None
        self._last_failure: FailureRecord | None = None  # this node's latest
        # How the last round ended, said once the next one formed (with its charge).
        self._round_end: RoundEnd | None = None
        self._guard = OrphanGuard()
        self._reaper = Reaper()
        # Standby ranks: processes set up ahead of time for the ranks to replace.
        self._standbys = Standbys(
            spec,
            sink,
            self._ensure_base_dir,
            clock=clock,
            guard=self._guard,
            reaper=self._reaper,
            log_errors=self._log_errors,
        )
        core = Core(
            spec, rendezvous, self.events, clock, self._guard, self._reaper, say, self.metrics
        )
        self.features: list[Feature] = [f for make in features for f in make(core)]
        self._departure = core.departure
        self._attribution = Attribution(core)
        # What next_round() waits for, on the console (the rendezvous reports it).
        self._waiting = WaitingConsole(clock=clock)
        # Peers refused for their settings, said while this node waits for them.
        self._refusals = RefusalWatch(rendezvous, say)
        rendezvous.attach(
            RendezvousHooks(
                progress=self._waiting.update,
                # Said at registration, before the waiting line is first drawn.
                notice=say,
                # Revoked by the guard if the agent is killed.
                lease_listener=self._guard.set_lease,
            )
        )

    # ------------------------------------------------------------ public
    async def run(self) -> int:
        """Run the job on this node; returns the exit code."""
        self._claim_log_dir()
        self._install_signals()
        if not self._guard.start():
            say(
                f"elastrun: warning: {self._guard.error}; "
                "children of workers may outlive a killed agent"
            )
        for feature in self.features:
            feature.start()
        code = 1
        try:
            refused = await self._refused()
            if refused is not None:
                return refused
            code = await self._loop()
        except Signalled as s:
            code = 128 + s.signum
            await self._stop_group(s.signum)
            say(f"elastrun: received {signal_name(s.signum)}: workers stopped; exiting with {code}")
            self.events.emit(JobFailed(exit_code=code, reason=f"signal {signal_name(s.signum)}"))
        except ElastrunError as e:
            say(f"elastrun: error: {e}")
            self.events.emit(JobFailed(exit_code=1, reason=type(e).__name__, detail=str(e)))
            code = 1
        finally:
            await self._finish()
        return code

    async def _finish(self) -> None:
        """Whatever happened: no worker left behind, the rendezvous left, the
        features closed, every child reaped, the files released."""
        if self._group is not None:
            # Also on cancellation / unexpected errors: never leave workers behind.
            await self._stop_group(signal.SIGTERM)
        await self._stop_kept(signal.SIGTERM)
        await self._standbys.stop(self.spec.shutdown_timeout)
        try:
            # The rendezvous bounds its leave by close_timeout; this is the backstop.
            bound = max(RDZV_SHUTDOWN_TIMEOUT, self.rendezvous.settings.close_timeout + 1.0)
            await asyncio.wait_for(self.rendezvous.shutdown(), bound)
        except (ElastrunError, TimeoutError, OSError) as e:
            say(f"elastrun: warning: leaving the rendezvous failed: {e!r}")
        self._remove_signals()
        for feature in self.features:
            await feature.close()
        self._reaper.reap()
        self._reaper.disable()
        await self._guard.close()
        if self._host_pidfile is not None:
            release_host_dir(self._host_pidfile)
        if self._temp_base and self._base_dir is not None:
            kept = error_files(self._base_dir)
            if kept:  # as torchrun: the workers' error files outlive the launch
                say(f"elastrun: the workers' error files are kept: {', '.join(kept)}")
            else:
                shutil.rmtree(self._base_dir, ignore_errors=True)
        if self._events_file is not None:
            self._events_file.close()

    # ------------------------------------------------------------ signals
    def _install_signals(self) -> None:
        router = self._router = SignalRouter(asyncio.get_running_loop())
        stop_sigs = {
            signal.SIGINT,
            signal.SIGTERM,
            signal.SIGHUP,
            signal.SIGQUIT,
            *self.spec.signals_to_handle,
        }
        handlers: list[tuple[int, Any, bool]] = [(s, self._stops.put, False) for s in stop_sigs]
        handlers += [
            (s, self._on_forward_signal, False)
            for s in self.spec.signals_to_forward
            if s not in stop_sigs
        ]
        # Orphans of workers come to the agent (a child subreaper): reap them.
        # One call for a burst of exits (agent/signals.py).
        handlers.append((signal.SIGCHLD, self._on_child, True))
        for sig, cb, coalesce in handlers:
            try:
                router.add(sig, cb, coalesce=coalesce)
            except (ValueError, OSError) as e:
                # not the main thread, or not a catchable signal
                say(f"elastrun: warning: cannot handle {signal_name(sig)}: {e}")

    def _remove_signals(self) -> None:
        if self._router is not None:
            self._router.close()
            self._router = None

    def _on_child(self, _sig: int) -> None:
        for feature in self.features:
            feature.on_child()
        if self._reaper.enabled:
            self._reaper.reap()

    def _on_forward_signal(self, sig: int) -> None:
        if self._group is not None:
            self._group.send_signal(sig)
        self.events.emit(SignalForwarded(signal=signal_name(sig)))

    async def _stop_group(self, sig: int) -> None:
        """Stop the current group (bounded); a terminating signal arriving
        meanwhile is remembered, and a second one cuts the grace short."""
        group = self._group
        if group is None:
            return
        unkillable = await self._stops.during(group.stop(sig), group.hurry)
        self._group = None
        self._kept = group.kept
        if unkillable:
            say(
                f"elastrun: warning: worker pids {unkillable} did not die after SIGKILL "
                "(stuck in the kernel, e.g. uninterruptible I/O); they are left behind"
            )

    async def _stop_kept(self, sig: int) -> None:
        """The kept processes no round took over (the job ended, a signal):
        ``sig``, the shutdown grace, SIGKILL (each bounded)."""
        kept, self._kept = list(self._kept.values()), {}
        for w in kept:
            w.kept = False
        await stop_unowned(kept, sig, self.spec.shutdown_timeout, self._guard)

    async def _leave(self, group: WorkerGroup, result: RoundResult) -> None:
        """In-process restarts: the ranks that may survive leave their
        function (bounded); the group's stop then spares them."""
        if not any(w.restartable for w in group.workers):
            return
        start = self.clock.monotonic()
        kept = await self._stops.first(group.leave())
        ids = {w.local_rank for w in kept}
        self.events.emit(
            RanksLeft(
                round=result.round,
                attempt=self._attempt,
                kept=sorted(ids),
                kept_pids=[w.pid for w in kept],
                replaced=[w.local_rank for w in group.workers if w.local_rank not in ids],
                waited_s=round(self.clock.monotonic() - start, 3),
            )
        )

    # ------------------------------------------------------------ the loop
    async def _loop(self) -> int:
        while True:
            if self._attempt >= 0 and self.spec.stragglers.replace_after > 0:
                # Replaced as a straggler while its last round ended for
                # another reason, before it saw its record: it does not rejoin.
                refused = await self._refused()
                if refused is not None:
                    return refused
            try:
                result = await self._next_round()
                self._formed(result)
            except RendezvousClosed as e:
                say(f"elastrun: the job is already finished ({e}); nothing to do")
                self.events.emit(JobFinished(exit_code=0, reason="rendezvous_closed"))
                return 0
            except RestartBudgetExhausted as e:
                stopped = await self._attribution_stopped()
                if stopped is not None:  # a script fault stopped the job (a spare's view)
                    say(f"elastrun: job stopped: {stopped}")
                    self.ended_by = self._last_failure
                    self.events.emit(JobFailed(exit_code=1, reason="script_fault", detail=stopped))
                    return 1
                say(f"elastrun: job failed: {e}")
                self.ended_by = self._last_failure
                self.events.emit(JobFailed(exit_code=1, reason="restarts_exhausted"))
                return 1
            check_round(self.spec, result)
            group = self._new_group(result)
            await self._stops.first(self._start(group, result))
            ended: WorkersExited | Change | Leave = await self._stops.first(
                _exited(group), self.rendezvous.wait_for_change(), self._departure.wait()
            )
            await group.end()
            match ended:
                case WorkersExited(succeeded=True):
                    return await self._on_success(group, result)
                case WorkersExited():
                    code = await self._on_failure(group, result)
                    if code is not None:
                        return code
                case Change():
                    code = await self._on_change(group, ended, result)
                    if code is not None:
                        return code
                case Leave():
                    return await self._on_leave(ended)

    def _formed(self, result: RoundResult) -> None:
        """The next round formed: say how the last one ended, with what the
        rendezvous charged for it (agent/restart_charge.py)."""
        end, self._round_end = self._round_end, None
        if end is None:
            return
        line = end.line(result)
        if line is not None:
            say(line)
        self.events.emit(end.restart(result))

    async def _refused(self) -> int | None:
        """1 when this node is quarantined (agent/attribution.py): it does
        not join, it says so and exits 1."""
        refused = await self._stops.first(self._attribution.refusal())
        if refused is None:
            return None
        say(refused)
        self.events.emit(JobFailed(exit_code=1, reason="quarantined", detail=refused))
        return 1

    async def _next_round(self) -> RoundResult:
        for feature in self.features:
            await self._stops.first(feature.before_round())
        self._waiting.start()
        self._refusals.start()
        try:
            return await self._stops.first(self.rendezvous.next_round())
        finally:
            self._waiting.stop()
            self._refusals.stop()

    def _new_group(self, result: RoundResult) -> WorkerGroup:
        self._attempt += 1
        base = self._ensure_base_dir()
        group = WorkerGroup(
            self.spec,
            result,
            attempt=self._attempt,
            attempt_dir=os.path.join(base, f"attempt_{self._attempt}"),
            keep_files=needs_files(self.spec),
            events=self.events,
            clock=self.clock,
            guard=self._guard,
            reaper=self._reaper,
            log_errors=self._log_errors,
            round_hooks=lambda g: [f.round(g) for f in self.features],
            kept=self._takers(result),
            on_restartable=lambda: self._standbys.want(result.run_id, result.max_restarts),
        )
        for w in self._kept.values():
            if w.done:  # ended between the rounds: its rank starts anew
                w.release()
        self._kept = {}  # the group's now (stopped with it, whatever happens)
        self._group = group
        self._departure.reset()  # a request of an earlier round is not this one's
        return group

    def _takers(self, result: RoundResult) -> dict[int, Worker]:
        """The processes the next round's group takes over, by local rank:
        the kept ones, and a ready standby for each rank that has none."""
        takers = {lr: w for lr, w in self._kept.items() if not w.done}
        missing = [lr for lr in range(self.spec.nproc) if lr not in takers]
        for lr, (w, waited) in zip(missing, self._standbys.take(len(missing)), strict=False):
            w.local_rank = lr
            takers[lr] = w
            self.events.emit(
                StandbyUsed(
                    round=result.round,
                    attempt=self._attempt,
                    rank=result.rank_offset + lr,
                    local_rank=lr,
                    pid=w.pid,
                    waited_s=waited,
                )
            )
        return takers

    async def _start(self, group: WorkerGroup, result: RoundResult) -> None:
        await group.start()  # on WorkerError or a signal, run() stops those started
        kept = group.ranks_kept()  # standbys served: told in standby_used
        if kept is not None:
            self.events.emit(kept)
        self.events.emit(
            WorkersStarted(
                round=result.round,
                attempt=self._attempt,
                restart_count=result.restart_count,
                pids=group.pids,
                ranks=[w.rank for w in group.workers],
                local_ranks=[w.local_rank for w in group.workers],
                warm=[w.warm for w in group.workers],
                world_size=result.world_size,
                group_rank=result.group_rank,
                master=f"{result.master_addr}:{result.master_port}",
            )
        )
        # In place of the standbys taken (_takers): spawned once the round's workers
        # were started or told to enter, not on the path to the round's first step.
        self._standbys.fill()

    async def _on_success(self, group: WorkerGroup, result: RoundResult) -> int:
        await group.close()
        self._group = None
        self.events.emit(WorkersSucceeded(round=result.round, attempt=self._attempt))
        await self._stops.first(self.rendezvous.complete())
        if self.spec.logs.require and self._log_errors.any:
            # The workers succeeded, but some output never reached its file.
            say(f"elastrun: error: {self._log_errors.summary()}; exiting 1 (--require-logs)")
            files = sorted(self._log_errors.failed)
            self.events.emit(JobFailed(exit_code=1, reason="log_output_lost", files=files))
            return 1
        self.events.emit(JobFinished(exit_code=0, reason="workers_succeeded"))
        return 0

    async def _on_change(
        self, group: WorkerGroup, change: Change, result: RoundResult
    ) -> int | None:
        own = group.failed  # this node's ranks failed too (a race with another node's)
        if not own:
            say(printable(change_line(change, result)))  # the detail is another node's
        await group.changed(change)
        if not change.stop_now:
            await self._leave(group, result)
        await self._stop_group(signal.SIGKILL if change.stop_now else signal.SIGTERM)
        if own and change.counts_as_restart:
            # Reported as this node's failure: the job's root cause is the
            # first of the failures the nodes report (its own, or another's).
            return await self._report(group, result, None)
        if own:
            say(printable(change_line(change, result)))
        self._stops.raise_pending()
        self._round_end = RoundEnd.changed(result, change)  # said once the next round formed
        return None

    async def _on_leave(self, leave: Leave) -> int:
        """A feature asked this node to leave the job while its workers train
        (a straggler replaced: agent/straggler_replacement.py). It leaves the
        rendezvous first (its ``left`` key, its lease revoked), so that the
        others see a member leave, a membership change, rather than their
        collectives broken by its workers' end; then its workers stop."""
        say(printable(leave.line))
        try:
            bound = max(RDZV_SHUTDOWN_TIMEOUT, self.rendezvous.settings.close_timeout + 1.0)
            await self._stops.first(asyncio.wait_for(self.rendezvous.shutdown(), bound))
        except (ElastrunError, TimeoutError, OSError) as e:
            say(f"elastrun: warning: leaving the rendezvous failed: {e!r}")
        await self._stop_group(signal.SIGTERM)
        self.events.emit(JobFailed(exit_code=1, reason=leave.reason, detail=leave.line))
        return 1

    async def _request_restart(self, record: FailureRecord) -> RestartBudgetExhausted | None:
        try:
            await self._stops.first(self.rendezvous.request_restart(record))
        except RestartBudgetExhausted as e:
            return e
        return None

    async def _job_failure(self, result: RoundResult, record: FailureRecord) -> FailureRecord:
        """The job's root cause, once the other members reported theirs: the
        one the round keeps (rendezvous/root_cause.py), the same on every
        node; another node's when it came first (its crash broke these ranks'
        collective) or is stronger evidence."""
        job = await self._stops.first(self.rendezvous.job_failure(record, SETTLE_TIMEOUT))
        if same_failure(job, record):
            return record  # this node's (as read back from the store)
        self.events.emit(
            RootCauseElsewhere(
                round=result.round, attempt=self._attempt, failure=job, node_failure=record
            )
        )
        return job

    async def _on_failure(self, group: WorkerGroup, result: RoundResult) -> int | None:
        declared = group.declared_alive()
        host = self.spec.host
        report = ""
        exhausted: RestartBudgetExhausted | None = None
        if declared:
            # A rank declared failed while it runs (a hang): tell the other
            # nodes before stopping it, so that theirs still wait for it while
            # their features look at them (their stacks).
            exhausted = await self._request_restart(failure_record(classify(declared), host))
            report = await self._stops.first(group.report())
        await self._leave(group, result)
        await self._stop_group(signal.SIGTERM)
        return await self._report(group, result, (exhausted, report) if declared else None)

    async def _report(
        self,
        group: WorkerGroup,
        result: RoundResult,
        reported: tuple[RestartBudgetExhausted | None, str] | None,
    ) -> int | None:
        """Once this node's workers stopped: report their failure (unless
        ``reported``: what requesting the restart gave, and the features'
        report), print the summary. Returns the agent's exit code when the
        job failed."""
        failures = classify(group.failures())
        record = failure_record(failures, self.spec.host)
        self._last_failure = record
        if reported is None:
            exhausted = await self._request_restart(record)
            report = await self._stops.first(group.report())
        else:
            exhausted, report = reported
        job = record if exhausted is not None else await self._job_failure(result, record)
        peer = None if job is record else job
        if peer is not None:
            failures = elsewhere(failures)
        stopped = None if exhausted is None else await self._attribution_stopped()
        if stopped is not None:  # another node stopped the job for a script fault
            say(with_report(format_summary(failures, f"elastrun: job stopped: {stopped}"), report))
            self.ended_by = record
            self.events.emit(
                JobFailed(exit_code=1, reason="script_fault", detail=stopped, failure=record)
            )
            return 1
        if exhausted is not None:
            header = (
                f"elastrun: job failed: workers failed and no restarts are left "
                f"(max restarts {result.max_restarts}, used {result.restart_count}): {exhausted}"
            )
            say(with_report(format_summary(failures, header), report))
            self.ended_by = record
            self.events.emit(JobFailed(exit_code=1, reason="restarts_exhausted", failure=record))
            return 1
        # The title says why the round ended, once (with the job's root cause);
        # whether the restart counts, once the next round formed (_formed).
        known = peer is not None or any(f.role == ROOT_CAUSE for f in failures)
        root = job if known else None
        title = summary_title(result, root)
        say(with_report(format_summary(failures, title, peer=peer), report))
        code = await self._attribute(group, result, job, record)
        if code is not None:
            return code
        # The rendezvous charges the restart when the next round closes (with
        # no restarts left, the job fails then unless a node was lost: this
        # failure is then collateral, not counted).
        self._stops.raise_pending()
        self._round_end = RoundEnd.failed(result, job, root)
        return None

    async def _attribution_stopped(self) -> str | None:
        """The script fault that stopped the job (escaped), if one did."""
        stopped = await self._stops.first(self._attribution.stopped())
        return None if stopped is None else printable(stopped)

    async def _attribute(
        self, group: WorkerGroup, result: RoundResult, job: FailureRecord, record: FailureRecord
    ) -> int | None:
        """The verdict on the job's failures so far (agent/attribution.py),
        applied; the agent's exit code when it ends the job or this node's part."""
        verdict = await self._stops.first(self._attribution.judge(group, result, job, record))
        if verdict is None:
            return None
        action = await self._stops.first(self._attribution.act(verdict, result, job))
        if action.line:
            say(action.line)
        if action.exit_code is not None:
            if action.exit_code != 0:
                self.ended_by = record
            self.events.emit(
                JobFailed(
                    exit_code=action.exit_code,
                    reason=verdict.kind.value,
                    detail=verdict.summary(),
                    failure=job,
                )
            )
        return action.exit_code

    # ------------------------------------------------------------ log folder
    def _claim_log_dir(self) -> None:
        """With --log-dir: this node's folder, before it joins the job. A
        refused folder (another user's, a link, shared) is a ConfigError
        naming it, raised before anything started."""
        if self.spec.logs.dir is None:
            return
        try:
            self._ensure_base_dir()
        except ElastrunError:
            if self._events_file is not None:
                self._events_file.close()
            raise

    def _ensure_base_dir(self) -> str:
        if self._base_dir is None:
            if self.spec.logs.dir is not None:
                try:
                    self._base_dir, self._host_pidfile = claim_host_dir(
                        self.spec.logs.dir, self.spec.run_id, self.spec.host or socket.gethostname()
                    )
                except OSError as e:  # a full or read-only disk: kept in a temporary folder
                    self._base_dir = temp_dir(self.spec.run_id)
                    fate = f"worker logs go to {self._base_dir} instead"
                    self._log_errors.report(os.path.abspath(self.spec.logs.dir), e, fate=fate)
            else:
                self._base_dir = temp_dir(self.spec.run_id)
                # Only error files live here unless redirects/tee asked for log files.
                self._temp_base = not needs_files(self.spec)
        return self._base_dir
