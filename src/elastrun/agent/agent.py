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
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from elastrun.agent import hangs, stragglers
from elastrun.agent.children import Reaper
from elastrun.agent.command import Executable
from elastrun.agent.env import check_round
from elastrun.agent.failures import ROOT_CAUSE, classify, failure_record, format_summary
from elastrun.agent.guard import OrphanGuard
from elastrun.agent.logs import (
    LogWriteErrors,
    claim_host_dir,
    needs_files,
    open_event_log,
    release_host_dir,
    temp_dir,
    validate_template,
)
from elastrun.agent.modcache import ModuleCache, ModuleReport, cache_key, default_cache_dir
from elastrun.agent.progress_faults import ProgressFaults
from elastrun.agent.signals import SignalRouter
from elastrun.agent.spares import SparePool
from elastrun.agent.spec import WorkerSpec
from elastrun.agent.waiting import WaitingConsole
from elastrun.agent.workers import WorkerGroup
from elastrun.clock import SYSTEM_CLOCK, Clock
from elastrun.errors import (
    ConfigError,
    ElastrunError,
    RendezvousClosed,
    RestartBudgetExhausted,
)
from elastrun.events import EventSink, JsonLinesSink, NullSink
from elastrun.failure import FailureRecord
from elastrun.names import check_run_id
from elastrun.procs import say, signal_name
from elastrun.rendezvous.api import Change, Rendezvous, RendezvousHooks, RoundResult
from elastrun.untrusted import printable
from elastrun.worker._messages import Message, Modules

__all__ = ["Agent"]

RDZV_SHUTDOWN_TIMEOUT = 30.0
CANCEL_TIMEOUT = 5.0
MODULES_NOTE = "modules"  # the job-wide list of modules the script imports
WORKER_WHY = frozenset(("optimizer_step", "timer"))  # why a worker reported its modules
NOTE_TIMEOUT = 5.0


T = TypeVar("T")


@dataclass(frozen=True)
class WorkersExited:
    """The round's workers ended: all exited 0 (``succeeded``), or one failed."""

    succeeded: bool


async def _exited(group: WorkerGroup) -> WorkersExited:
    return WorkersExited(await group.wait())


class _Signalled(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _Tee:
    def __init__(self, *sinks: EventSink) -> None:
        self.sinks = sinks

    def emit(self, kind: str, **fields: Any) -> None:
        for s in self.sinks:
            s.emit(kind, **fields)


class Agent:
    """Runs ``spec``'s workers for the rounds of ``rendezvous`` until the job ends.

    ``await Agent(spec, rdzv, events).run()`` returns the process exit code:
    0 success (or the job was already finished), 1 failure (restart budget
    spent, rendezvous error, workers that cannot be started), 128+signum when
    stopped by a signal. Must run in the main thread for signal handling and
    so that the workers' parent-death signal is tied to a long-lived thread.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        rendezvous: Rendezvous,
        events: EventSink | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if spec.nproc < 1:
            raise ConfigError(f"--nproc-per-node must be at least 1, got {spec.nproc}")
        if isinstance(spec.command, Executable) and not spec.command.argv:
            raise ConfigError("nothing to run: the worker command line is empty")
        if spec.shutdown_timeout < 0:
            raise ConfigError(f"shutdown timeout must be >= 0, got {spec.shutdown_timeout}")
        check_run_id(spec.run_id, "run id")  # a folder name under --log-dir
        validate_template(spec.log_template)
        self.spec = spec
        self.rendezvous = rendezvous
        self.clock = clock
        self._events_file: JsonLinesSink | None = None
        sink: EventSink = events if events is not None else NullSink()
        if spec.events_file:
            self._events_file = open_event_log(spec.events_file, "--events-file", host=spec.host)
            sink = _Tee(sink, self._events_file)
        self.events: EventSink = sink
        self._log_errors = LogWriteErrors(sink, say)
        self._progress_faults = ProgressFaults(sink, say)
        self._signals: asyncio.Queue[int] = asyncio.Queue()
        self._signals_seen = 0
        self._pending_signal: int | None = None
        self._group: WorkerGroup | None = None
        self._attempt = -1
        self._base_dir: str | None = None
        self._temp_base = False
        self._router: SignalRouter | None = None
        self._guard = OrphanGuard()
        self._reaper = Reaper()
        self._spares: SparePool | None = None
        command = spec.command
        if spec.prewarm and not isinstance(command, Executable):
            cache = None
            if spec.prewarm_modules != "torch":
                key = cache_key(command, os.getcwd())
                cache = ModuleCache(spec.prewarm_cache or default_cache_dir(), key)
            self._spares = SparePool(
                spec,
                command,
                self.events,
                self._guard,
                self._reaper,
                cache=cache,
                scope="all" if spec.prewarm_modules == "all" else "installed",
                say=say,
            )
        self._host_pidfile: str | None = None
        self._note_fetch: asyncio.Task[None] | None = None
        self._note_writes: set[asyncio.Task[None]] = set()
        # What next_round() waits for, on the console (the rendezvous reports it).
        self._waiting = WaitingConsole(clock=clock)
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
        if self._spares is not None:
            # The warm interpreter starts (and imports torch) while the
            # rendezvous runs; the round's variables come when it closes.
            self._spares.keep(self._spares.first_env(self.rendezvous.settings.max_restarts))
            # What the script imports, as the job's other nodes recorded it: a
            # node new to this job (a fresh machine) warms up as the others did.
            self._note_fetch = asyncio.ensure_future(self._fetch_modules_note())
        code = 1
        try:
            code = await self._loop()
        except _Signalled as s:
            code = 128 + s.signum
            await self._stop_group(s.signum)
            say(f"elastrun: received {signal_name(s.signum)}: workers stopped; exiting with {code}")
            self.events.emit("job_failed", exit_code=code, reason=f"signal {signal_name(s.signum)}")
        except ElastrunError as e:
            say(f"elastrun: error: {e}")
            self.events.emit("job_failed", exit_code=1, reason=type(e).__name__, detail=str(e))
            code = 1
        finally:
            if self._group is not None:
                # Also on cancellation / unexpected errors: never leave workers behind.
                await self._stop_group(signal.SIGTERM)
            try:
                # The rendezvous bounds its leave by close_timeout; this is the backstop.
                bound = max(RDZV_SHUTDOWN_TIMEOUT, self.rendezvous.settings.close_timeout + 1.0)
                await asyncio.wait_for(self.rendezvous.shutdown(), bound)
            except (ElastrunError, TimeoutError, OSError) as e:
                say(f"elastrun: warning: leaving the rendezvous failed: {e!r}")
            self._remove_signals()
            for task in (self._note_fetch, *self._note_writes):
                if task is not None:
                    task.cancel()
            if self._spares is not None:
                await self._spares.close()
            self._reaper.reap()
            self._reaper.disable()
            await self._guard.close()
            if self._host_pidfile is not None:
                release_host_dir(self._host_pidfile)
            if self._temp_base and self._base_dir is not None:
                shutil.rmtree(self._base_dir, ignore_errors=True)
            if self._events_file is not None:
                self._events_file.close()
        return code

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
        handlers: list[tuple[int, Any, bool]] = [
            (s, self._on_stop_signal, False) for s in stop_sigs
        ]
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

    def _on_stop_signal(self, sig: int) -> None:
        self._signals.put_nowait(sig)

    def _on_child(self, _sig: int) -> None:
        if self._spares is not None:
            self._spares.reap()
        if self._reaper.enabled:
            self._reaper.reap()

    def _on_forward_signal(self, sig: int) -> None:
        if self._group is not None:
            self._group.send_signal(sig)
        self.events.emit("signal_forwarded", signal=signal_name(sig))

    async def _first(self, *racers: Awaitable[T]) -> T:
        """The result of the first of ``racers`` to finish (the earlier one
        given when several finish together), or _Signalled when a terminating
        signal comes first. The others are cancelled (bounded)."""
        if self._pending_signal is not None:
            for aw in racers:
                if asyncio.iscoroutine(aw):
                    aw.close()
            raise _Signalled(self._pending_signal)
        tasks = [asyncio.ensure_future(aw) for aw in racers]
        sig_task = asyncio.ensure_future(self._signals.get())
        every: list[asyncio.Future[Any]] = [*tasks, sig_task]
        try:
            done, _ = await asyncio.wait(every, return_when=asyncio.FIRST_COMPLETED)
        finally:
            pending = [t for t in every if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.wait(pending, timeout=CANCEL_TIMEOUT)
        if sig_task in done:
            self._signals_seen += 1
            self._pending_signal = sig_task.result()
            raise _Signalled(self._pending_signal)
        return next(t for t in tasks if t in done).result()

    # ------------------------------------------------------------ the loop
    async def _loop(self) -> int:
        while True:
            try:
                result = await self._next_round()
            except RendezvousClosed as e:
                say(f"elastrun: the job is already finished ({e}); nothing to do")
                self.events.emit("job_finished", exit_code=0, reason="rendezvous_closed")
                return 0
            except RestartBudgetExhausted as e:
                say(f"elastrun: job failed: {e}")
                self.events.emit("job_failed", exit_code=1, reason="restarts_exhausted")
                return 1
            check_round(self.spec, result)
            group = self._new_group(result)
            await self._first(self._start(group, result))
            progress = asyncio.ensure_future(
                stragglers.publish_loop(self.rendezvous, group, result, self.spec.host, self.events)
            )
            try:
                ended: WorkersExited | Change = await self._first(
                    _exited(group), self.rendezvous.wait_for_change()
                )
            finally:
                progress.cancel()
            match ended:
                case WorkersExited(succeeded=True):
                    return await self._on_success(group, result)
                case WorkersExited():
                    code = await self._on_failure(group, result)
                    if code is not None:
                        return code
                case Change():
                    await self._on_change(ended, result)

    async def _on_success(self, group: WorkerGroup, result: RoundResult) -> int:
        await group.close()
        self._group = None
        self.events.emit("workers_succeeded", round=result.round, attempt=self._attempt)
        await self._first(self.rendezvous.complete())
        if self.spec.require_logs and self._log_errors.any:
            return self._lost_logs()
        self.events.emit("job_finished", exit_code=0, reason="workers_succeeded")
        return 0

    async def _on_change(self, change: Change, result: RoundResult) -> None:
        say(printable(self._change_line(change, result)))  # the detail is another node's
        group = self._group
        if change.hang and group is not None:
            # A hang declared on another node: our ranks' stacks, for its summary.
            await group.collect_stacks()
            await hangs.share(self.rendezvous, result, hangs.local_stacks(group, self.spec.host))
        await self._stop_group(signal.SIGTERM)
        self._raise_pending()
        self.events.emit(
            "restart",
            count=result.restart_count + (1 if change.counts_as_restart else 0),
            reason=change.reason,
            detail=change.detail,
            counted=change.counts_as_restart,
            round=result.round,
        )

    async def _warm_join(self) -> None:
        """Before joining a job that trains without this node: wait (bounded)
        for the warm interpreter, so the others pause only for the restart,
        not for this node's imports."""
        spares, timeout = self._spares, self.spec.warm_join_timeout
        if spares is None or timeout <= 0 or not spares.pids:
            return
        if self._note_fetch is not None and not self._note_fetch.done():
            await asyncio.wait({self._note_fetch}, timeout=NOTE_TIMEOUT)
        if spares.ready:
            return
        if not await self.rendezvous.joining_running_job():
            return
        say(
            f"elastrun: joining a running job: waiting up to {timeout:g}s for the warm "
            "interpreter first, so the others pause only for the restart"
        )
        t0 = self.clock.monotonic()
        ready = await self._first(spares.wait_ready(timeout))
        waited = self.clock.monotonic() - t0
        self.events.emit("warm_join", waited_s=round(waited, 3), ready=ready, timeout=timeout)
        if not ready:
            spares.use_unready = False  # too slow to wait for at the start too
            say(f"elastrun: the warm interpreter is not ready after {waited:.0f}s; joining anyway")

    async def _next_round(self) -> RoundResult:
        await self._warm_join()
        self._waiting.start()
        try:
            return await self._first(self.rendezvous.next_round())
        finally:
            self._waiting.stop()

    def _lost_logs(self) -> int:
        """--require-logs: the workers succeeded, but some output never reached its file."""
        say(f"elastrun: error: {self._log_errors.summary()}; exiting 1 (--require-logs)")
        files = sorted(self._log_errors.failed)
        self.events.emit("job_failed", exit_code=1, reason="log_output_lost", files=files)
        return 1

    def _new_group(self, result: RoundResult) -> WorkerGroup:
        self._attempt += 1
        base = self._ensure_base_dir()
        attempt_dir = os.path.join(base, f"attempt_{self._attempt}")
        group = WorkerGroup(
            self.spec,
            result,
            attempt=self._attempt,
            attempt_dir=attempt_dir,
            keep_files=needs_files(self.spec),
            events=self.events,
            clock=self.clock,
            guard=self._guard,
            reaper=self._reaper,
            on_message=self._on_worker_message,
            module_scope="all" if self.spec.prewarm_modules == "all" else "installed",
            log_errors=self._log_errors,
            progress_faults=self._progress_faults,
        )
        self._group = group
        return group

    async def _start(self, group: WorkerGroup, result: RoundResult) -> None:
        spares = self._spares
        # On WorkerError or a signal, run() stops the ones already started.
        await group.start(spares.fork if spares is not None else None)
        if spares is not None:
            if self._may_restart(result):
                spares.keep(group.envs()[0])
            else:
                spares.drop()
        self.events.emit(
            "workers_started",
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

    def _on_worker_message(self, _local_rank: int, message: Message) -> None:
        spares = self._spares
        if spares is None or self.spec.prewarm_modules == "torch":
            return
        if not isinstance(message, Modules):
            return
        report = ModuleReport.reported(message, spares.script)
        why = message.why
        learned = spares.learn(report, why if why in WORKER_WHY else "worker")
        group = self._group
        if learned and group is not None and group.result.group_rank == 0:
            # One node (group rank 0) shares the list with the job; only over a
            # store that authenticates its clients do the others use it.
            if not self.spec.store_authenticated:
                return
            note = spares.note().to_json()
            task = asyncio.ensure_future(self.rendezvous.write_note(MODULES_NOTE, note))
            self._note_writes.add(task)
            task.add_done_callback(self._note_writes.discard)

    async def _fetch_modules_note(self) -> None:
        """What the job's other nodes recorded the script imports (the note
        ``modules``): used only when the store authenticates its clients,
        and then only its names that pass the same checks as a local worker's."""
        spares = self._spares
        note = None
        with contextlib.suppress(TimeoutError):
            note = await asyncio.wait_for(self.rendezvous.read_note(MODULES_NOTE), NOTE_TIMEOUT)
        if note is None or spares is None:
            return
        if not self.spec.store_authenticated:
            self.events.emit("modules_note_ignored", reason="unauthenticated")
            spares.debug(
                "the job's module note is not used: the rendezvous store does not "
                "authenticate its clients (no token), so anyone who reaches it could "
                "have written it"
            )
            return
        report = ModuleReport.from_json(note, spares.script)
        if report is None:
            self.events.emit("modules_note_ignored", reason="invalid")
            spares.debug("the job's module note is not a module list: not used")
            return
        spares.learn(report, "job", peer=True)

    def _may_restart(self, result: RoundResult) -> bool:
        """Whether these workers can still be started again (restarts left, or
        a membership change, which is never counted)."""
        settings = self.rendezvous.settings
        return result.restart_count < result.max_restarts or settings.min_nodes < settings.max_nodes

    def _claim_log_dir(self) -> None:
        """With --log-dir: this node's folder, before it joins the job. A
        refused folder (another user's, a link, shared) is a ConfigError
        naming it, raised before anything started."""
        if self.spec.log_dir is None:
            return
        try:
            self._ensure_base_dir()
        except ElastrunError:
            if self._events_file is not None:
                self._events_file.close()
            raise

    def _ensure_base_dir(self) -> str:
        if self._base_dir is None:
            if self.spec.log_dir is not None:
                try:
                    self._base_dir, self._host_pidfile = claim_host_dir(
                        self.spec.log_dir, self.spec.run_id, self.spec.host or socket.gethostname()
                    )
                except OSError as e:  # a full or read-only disk: kept in a temporary folder
                    self._base_dir = temp_dir(self.spec.run_id)
                    fate = f"worker logs go to {self._base_dir} instead"
                    self._log_errors.report(os.path.abspath(self.spec.log_dir), e, fate=fate)
            else:
                self._base_dir = temp_dir(self.spec.run_id)
                # Only error files live here unless redirects/tee asked for log files.
                self._temp_base = not needs_files(self.spec)
        return self._base_dir

    async def _hang_report(self, group: WorkerGroup, result: RoundResult) -> str:
        """Every rank's stacks when this node declared a hang ("" otherwise)."""
        if not any(w.hang is not None for w in group.workers):
            return ""
        own = hangs.local_stacks(group, self.spec.host)
        await hangs.share(self.rendezvous, result, own)
        every = await self._first(hangs.gather(self.rendezvous, result, own))
        report = hangs.summary(every, group.attempt_dir if self.spec.log_dir else None)
        return "\n".join(x for x in (report, group.skipped_stacks()) if x)

    async def _request_restart(self, record: FailureRecord) -> RestartBudgetExhausted | None:
        try:
            await self._first(self.rendezvous.request_restart(record))
        except RestartBudgetExhausted as e:
            return e
        return None

    async def _on_failure(self, group: WorkerGroup, result: RoundResult) -> int | None:
        hung = group.hung()
        stacks = ""
        if hung:
            # A hang: tell the other nodes before stopping the hung rank, so
            # that theirs still wait for it when they dump their stacks.
            exhausted = await self._request_restart(failure_record(classify(hung), self.spec.host))
            stacks = await self._hang_report(group, result)
        await self._stop_group(signal.SIGTERM)
        failures = classify(group.failures())
        record = failure_record(failures, self.spec.host)
        if not hung:
            exhausted = await self._request_restart(record)
            stacks = await self._hang_report(group, result)  # (a hung rank that exited itself)
        if exhausted is not None:
            header = (
                f"elastrun: job failed: workers failed and no restarts are left "
                f"(max restarts {result.max_restarts}, used {result.restart_count}): {exhausted}"
            )
            say(_with(format_summary(failures, header), stacks))
            self.events.emit(
                "job_failed", exit_code=1, reason="restarts_exhausted", failure=record.to_json()
            )
            return 1
        root = next((f for f in failures if f.role == ROOT_CAUSE), None)
        if result.restart_count >= result.max_restarts:
            # The rendezvous decides when the next round closes: the job fails
            # unless a node was lost (then this failure is collateral, not counted).
            spent = f"no restarts are left (max restarts {result.max_restarts})"
            if len(result.members) <= 1:
                # No other node in the group: none can have been lost.
                header = f"elastrun: workers failed and {spent}: the job fails"
            else:
                header = (
                    f"elastrun: workers failed and {spent}; the job goes on only if another "
                    "node of the group was lost (this failure is then not counted)"
                )
            say(_with(format_summary(failures, header), stacks))
            self._raise_pending()
            return None
        header = (
            f"elastrun: workers failed; restarting them "
            f"(restart {result.restart_count + 1} of {result.max_restarts})"
        )
        say(_with(format_summary(failures, header), stacks))
        say(
            f"elastrun: restarting workers (restart {result.restart_count + 1}/"
            f"{result.max_restarts}): "
            + (record.describe() if root is not None else "workers failed on this node")
        )
        self._raise_pending()
        self.events.emit(
            "restart",
            count=result.restart_count + 1,
            reason="worker_failed",
            counted=True,
            round=result.round,
            failure=record.to_json(),
        )
        return None

    @staticmethod
    def _change_line(change: Change, result: RoundResult) -> str:
        """The one console line that says why this round ends."""
        why = change.detail or change.reason.replace("_", " ")
        if change.counts_as_restart:
            if not change.detail:
                why = f"workers failed on another node ({change.reason})"
            return (
                f"elastrun: restarting workers (restart {result.restart_count + 1}/"
                f"{result.max_restarts}): {why}"
            )
        return f"elastrun: re-forming: {why}; not counted as a restart"

    def _raise_pending(self) -> None:
        if self._pending_signal is not None:
            raise _Signalled(self._pending_signal)

    async def _stop_group(self, sig: int) -> None:
        """Stop the current group (bounded); a terminating signal arriving
        meanwhile is remembered, and a second one cuts the grace short."""
        group = self._group
        if group is None:
            return
        if self._signals_seen >= 2:
            group.hurry()
        stop_task = asyncio.ensure_future(group.stop(sig))
        while not stop_task.done():
            sig_task = asyncio.ensure_future(self._signals.get())
            done, _ = await asyncio.wait({stop_task, sig_task}, return_when="FIRST_COMPLETED")
            if sig_task in done:
                self._signals_seen += 1
                if self._pending_signal is None:
                    self._pending_signal = sig_task.result()
                if self._signals_seen >= 2:
                    group.hurry()
            else:
                sig_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sig_task
        unkillable = stop_task.result()
        self._group = None
        if unkillable:
            say(
                f"elastrun: warning: worker pids {unkillable} did not die after SIGKILL "
                "(stuck in the kernel, e.g. uninterruptible I/O); they are left behind"
            )


def _with(summary: str, stacks: str) -> str:
    """The failure summary with the stacks section before its closing bar."""
    if not stacks:
        return summary
    head, _, bar = summary.rpartition("\n")
    return f"{head}\n{stacks}\n{bar}"
