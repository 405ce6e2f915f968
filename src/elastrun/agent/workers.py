"""One worker group: spawn, watch, signal, stop and reap the workers of a round.

Process hygiene (no worker outlives the agent):

* every worker is the leader of its own session and process group, so a
  signal reaches the worker *and its children*, and the terminal's Ctrl-C
  reaches only the agent (which forwards it);
* every worker gets ``PR_SET_PDEATHSIG=SIGKILL``: it dies when the agent dies,
  even by SIGKILL. The kernel ties this to the *thread* that forked, so
  workers are spawned from the event loop's thread, which lives as long as
  the agent runs (normally the main thread);
* exits are noticed as they happen: a pidfd per worker registered with the
  event loop (a waiting thread per worker where pidfds are unavailable);
* stopping is bounded: signal each process group, wait the grace, SIGKILL
  the groups, wait a bounded time, reap; pids that would not die are reported;
* the workers' own children die with a SIGKILLed agent too: every worker's
  process group is registered with the agent's orphan guard (agent/guard.py);
* with ``hang_timeout``, a rank that showed progress and then made none for
  its timeout fails the group like a crash (agent/watchdog.py); before the
  group is stopped every local rank's Python stack is collected
  (agent/stacks.py), and the rank stuck in code of its own (not waiting in
  torch) is named the hung one. Progress relayed over a runner's channel
  (its file could not be written) counts as the file's would; a rank whose
  progress the agent cannot see is not judged (agent/progress_faults.py says so);
* the root cause is decided by one rule (agent/failures.py ``roles``): a
  worker that dies of the stack signal the agent sent it (its script
  changed the handler after the agent's check) was killed by the agent: it
  is never the root cause.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from elastrun.agent import env as worker_env_mod
from elastrun.agent.channel import CHANNEL_ENV, RunnerChannel
from elastrun.agent.children import ForkedProcess, Reaper
from elastrun.agent.command import Executable
from elastrun.agent.failures import Ending, ErrorFileInfo, WorkerFailure, read_error_file, roles
from elastrun.agent.guard import OrphanGuard
from elastrun.agent.hang_group import GroupHangs
from elastrun.agent.logs import LinePump, LogWriteErrors, StreamRoute, rank_dir, routes_for
from elastrun.agent.progress_faults import ProgressFaults
from elastrun.agent.spawn import launcher_stdin, preexec_for
from elastrun.agent.spec import WorkerSpec
from elastrun.agent.stacks import (
    STACK_SIGNAL_ENV,
    STACKS_ENV,
)
from elastrun.agent.watchdog import (
    HEARTBEAT_ENV,
    HEARTBEAT_INTERVAL_ENV,
    Beat,
    HangPolicy,
    HangWatchdog,
    heartbeat_interval,
)
from elastrun.clock import SYSTEM_CLOCK, Clock, remaining
from elastrun.errors import WorkerError
from elastrun.events import EventSink
from elastrun.procs import signal_name
from elastrun.rendezvous.api import RoundResult
from elastrun.worker._messages import Message, Progress, ProgressFailed

__all__ = ["Worker", "WorkerGroup", "preexec_for", "round_env"]

# ({local rank: environment}, {local rank: channel fd}) -> workers forked from
# the warm interpreter, by local rank (see agent/spares.py); the rest start cold.
Fork = Callable[
    [Mapping[int, Mapping[str, str]], Mapping[int, int]], Awaitable[dict[int, ForkedProcess]]
]
# (local rank, a message the worker's runner sent) -> None
OnMessage = Callable[[int, Message], None]
# The process handle of a worker: started cold, or forked and adopted.
Process = subprocess.Popen[bytes] | ForkedProcess

SCOPE_ENV = "ELASTRUN_MODULE_SCOPE"
KILL_WAIT = 5.0  # after SIGKILL, how long to wait for the kernel to finish them
DRAIN_TIMEOUT = 2.0  # after exit, how long to wait for the rest of a worker's output


def _killpg(pgid: int, sig: int) -> bool:
    """Signal a worker's process group; False when nothing is left in it."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False
    return True


@dataclass
class Worker:
    local_rank: int
    rank: int
    error_file: str
    routes: tuple[StreamRoute, StreamRoute]
    popen: Process | None = None
    channel: RunnerChannel | None = None  # the agent's end of the runner's channel
    exited: asyncio.Future[int] | None = None
    exit_monotonic: float | None = None
    exit_wall: float | None = None
    stopped_by_agent: bool = False
    pumps: list[LinePump] = field(default_factory=list)
    pump_tasks: list[asyncio.Task[None]] = field(default_factory=list)
    transports: list[asyncio.BaseTransport] = field(default_factory=list)
    pidfd: int | None = None
    heartbeat_file: str | None = None
    stacks_file: str | None = None
    stacks: str | None = None  # its Python stacks, collected when a hang was declared
    stacks_skipped: str | None = None  # why its stacks were not asked for
    # Signals the agent sent it besides a stop (the stack signal): dying of one
    # is the agent's doing, never a root cause (failures.roles).
    agent_signals: set[int] = field(default_factory=set)
    main_thread: int | None = None
    hang: str | None = None  # "rank R made no progress for S s (last step N)"
    hang_monotonic: float | None = None
    hang_wall: float | None = None
    warm: bool = False  # started from a warm spare

    @property
    def pid(self) -> int:
        return self.popen.pid if self.popen is not None else -1

    @property
    def done(self) -> bool:
        return self.exited is not None and self.exited.done()

    @property
    def returncode(self) -> int | None:
        return self.exited.result() if self.done and self.exited is not None else None


class WorkerGroup(GroupHangs):
    """The workers of one attempt on this node."""

    def __init__(
        self,
        spec: WorkerSpec,
        result: RoundResult,
        *,
        attempt: int,
        attempt_dir: str,
        keep_files: bool,
        events: EventSink,
        clock: Clock = SYSTEM_CLOCK,
        guard: OrphanGuard | None = None,
        reaper: Reaper | None = None,
        on_message: OnMessage | None = None,
        module_scope: str = "installed",
        log_errors: LogWriteErrors | None = None,
        progress_faults: ProgressFaults | None = None,
    ) -> None:
        self.spec = spec
        self.reaper = reaper
        self.on_message = on_message
        self.module_scope = module_scope
        # Python workers run through elastrun's runner (worker/_runner.py).
        self.runs_runner = not isinstance(spec.command, Executable)
        # Log files that cannot be written: warned about once (the agent's, across rounds).
        self.log_errors = log_errors if log_errors is not None else LogWriteErrors(events)
        # Progress the agent cannot see: said once (the agent's, across rounds).
        self.progress_faults = progress_faults or ProgressFaults(events)
        self.result = result
        self.attempt = attempt
        self.attempt_dir = attempt_dir
        self.events = events
        self.clock = clock
        self.workers: list[Worker] = []
        self._changed = asyncio.Event()
        self._hurry = asyncio.Event()
        self._closed = False
        self.guard = guard
        self.watchdog: HangWatchdog | None = None
        self._hang_task: asyncio.Task[None] | None = None
        if spec.hang_timeout is not None:
            policy = HangPolicy(spec.hang_timeout, spec.hang_auto)
            self.watchdog = HangWatchdog(
                policy, self._on_hang, clock, on_unknown=self._progress_unknown
            )
        for lr in range(spec.nproc):
            rank = result.rank_offset + lr
            routes = routes_for(
                spec,
                attempt_dir if keep_files else None,
                lr,
                rank=rank,
                group_rank=result.group_rank,
                restart=result.restart_count,
            )
            err = os.path.join(attempt_dir, str(lr), "error.json")
            w = Worker(lr, rank, err, routes)
            # Progress: for the watchdog, and (from the runner) the step times.
            if self.watchdog is not None or self.runs_runner:
                w.heartbeat_file = os.path.join(attempt_dir, str(lr), "heartbeat.json")
            if self.watchdog is not None and self.runs_runner and spec.stack_signal is not None:
                w.stacks_file = os.path.join(attempt_dir, str(lr), "stacks.txt")
            self.workers.append(w)

    # ---------------------------------------------------------------- start
    async def start(
        self, fork: Fork | None = None, should_stop: Callable[[], bool] | None = None
    ) -> bool:
        """Spawn every worker: ``fork`` may fork some from the warm interpreter
        (see agent/spares.py), the rest start cold, one at a time, yielding to
        the event loop after each so that a signal is handled while a large
        group spawns. Returns False as soon as ``should_stop()`` is true, True
        once every worker started. Raises WorkerError if one cannot be
        started. Either way the caller stops the ones already started."""
        envs: dict[int, dict[str, str]] = {}
        theirs: dict[int, socket.socket] = {}
        for w in self.workers:
            self._prepare(w)
            envs[w.local_rank] = round_env(
                self.spec, self.result, w.local_rank, w.error_file, w.heartbeat_file
            )
            if w.stacks_file is not None and self.spec.stack_signal is not None:
                envs[w.local_rank][STACKS_ENV] = w.stacks_file
                envs[w.local_rank][STACK_SIGNAL_ENV] = str(self.spec.stack_signal)
            if self.runs_runner:
                envs[w.local_rank][SCOPE_ENV] = self.module_scope
                ours, theirs[w.local_rank] = socket.socketpair()
                w.channel = RunnerChannel(ours)
        try:
            forked: dict[int, ForkedProcess] = {}
            if fork is not None and self.runs_runner:
                channels = {lr: sock.fileno() for lr, sock in theirs.items()}
                forked = await fork(envs, channels)
            for w in self.workers:  # the forked ones exist already: registered first
                if w.local_rank in forked:
                    w.popen, w.warm = forked[w.local_rank], True
                    self._watch(w)
            for w in self.workers:
                if w.popen is not None:
                    continue
                if should_stop is not None and should_stop():
                    return False
                w.popen = self._spawn_cold(w, envs[w.local_rank], theirs.get(w.local_rank))
                self._watch(w)
                await asyncio.sleep(0)
            return True
        finally:
            for sock in theirs.values():
                sock.close()

    def _prepare(self, w: Worker) -> None:
        """The worker's folder (private, see ``rank_dir``: a refused one is a
        WorkerError before any worker starts), without the files of an
        earlier run."""
        try:
            rank_dir(self.attempt_dir, w.local_rank)
        except OSError as e:  # a full or read-only disk: the worker runs without one
            self.log_errors.report(
                os.path.dirname(w.error_file),
                e,
                rank=w.rank,
                local_rank=w.local_rank,
                fate="the worker runs without an error file",
            )
        with contextlib.suppress(OSError):
            os.unlink(w.error_file)  # a stale file from an earlier run with this run id
        for stale in (w.heartbeat_file, w.stacks_file):
            if stale is not None:
                with contextlib.suppress(OSError):
                    os.unlink(stale)

    def _spawn_cold(
        self, w: Worker, env: dict[str, str], channel: socket.socket | None
    ) -> subprocess.Popen[bytes]:
        argv = self.spec.command.worker_argv(w.local_rank)
        fds: tuple[int, ...] = ()
        if channel is not None:
            env = {**env, CHANNEL_ENV: str(channel.fileno())}
            fds = (channel.fileno(),)
        try:
            stdin = launcher_stdin()
            popen = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL if stdin is None else stdin,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                preexec_fn=preexec_for(os.getpid()),  # noqa: PLW1509 - a pre-resolved prctl
                close_fds=True,
                pass_fds=fds,
            )
        except OSError as e:
            raise WorkerError(
                f"cannot start worker local rank {w.local_rank}: "
                f"{self.spec.command.program}: "
                f"{e.strerror or e}"
            ) from e
        if self.guard is not None:
            self.guard.add(popen.pid)
        if self.reaper is not None:
            self.reaper.watch_session(popen.pid)
        return popen

    def _watch(self, w: Worker) -> None:
        """Watch a started worker: its exit, its output, its channel."""
        loop = asyncio.get_running_loop()
        assert w.popen is not None
        w.exited = loop.create_future()
        self._watch_exit(loop, w)
        if self.watchdog is not None and w.heartbeat_file is not None:
            self.watchdog.watch(w.local_rank, w.heartbeat_file, channel=w.channel is not None)
        for pipe, route in zip((w.popen.stdout, w.popen.stderr), w.routes, strict=True):
            assert pipe is not None
            self._pump(loop, w, pipe, route)
        if w.channel is not None:
            w.channel.watch(
                self.clock.monotonic,
                lambda message: self._on_message(w, message),
                lambda: self._channel_closed(w),
            )
            if w.warm:
                w.channel.go()  # registered: the forked worker may run

    def _on_message(self, w: Worker, message: Message) -> None:
        """What the worker's runner sent (agent/channel.py: bounded, typed)."""
        if isinstance(message, Progress | ProgressFailed):
            self._relayed(w, message)
        elif self.on_message is not None:
            self.on_message(w.local_rank, message)

    def _channel_closed(self, w: Worker) -> None:
        if self.watchdog is not None:
            self.watchdog.channel_closed(w.local_rank)

    def envs(self) -> dict[int, dict[str, str]]:
        """Each local rank's environment in this round (what spares start with)."""
        return {
            w.local_rank: round_env(
                self.spec, self.result, w.local_rank, w.error_file, w.heartbeat_file
            )
            for w in self.workers
        }

    def _pump(
        self, loop: asyncio.AbstractEventLoop, w: Worker, pipe: Any, route: StreamRoute
    ) -> None:
        reader = asyncio.StreamReader(limit=1 << 20)
        protocol = asyncio.StreamReaderProtocol(reader)
        pump = LinePump(reader, route, self.log_errors, w.rank, w.local_rank)
        w.pumps.append(pump)

        async def run() -> None:
            transport, _ = await loop.connect_read_pipe(lambda: protocol, pipe)
            w.transports.append(transport)
            await pump.run()

        w.pump_tasks.append(loop.create_task(run()))

    def _watch_exit(self, loop: asyncio.AbstractEventLoop, w: Worker) -> None:
        assert w.popen is not None
        try:
            w.pidfd = os.pidfd_open(w.popen.pid)
        except (OSError, AttributeError):
            w.pidfd = None
        if w.pidfd is not None:
            loop.add_reader(w.pidfd, self._on_exit, loop, w)
            return
        popen = w.popen

        def wait_thread() -> None:  # fallback: kernels without pidfd
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitid(os.P_PID, popen.pid, os.WEXITED | os.WNOWAIT)
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._on_exit, loop, w)

        threading.Thread(target=wait_thread, name=f"wait-{popen.pid}", daemon=True).start()

    def _on_exit(self, loop: asyncio.AbstractEventLoop, w: Worker) -> None:
        assert w.popen is not None and w.exited is not None
        rc = w.popen.poll()  # reaps (WNOHANG)
        if rc is None or w.exited.done():
            return
        if w.pidfd is not None:
            loop.remove_reader(w.pidfd)
            os.close(w.pidfd)
            w.pidfd = None
        w.exit_monotonic = self.clock.monotonic()
        w.exit_wall = time.time()
        if self.watchdog is not None:
            self.watchdog.forget(w.local_rank)
        w.exited.set_result(rc)
        cause = self._role(w)
        exitcode, sig = (rc, None) if rc >= 0 else (None, signal_name(-rc))
        self.events.emit(
            "worker_exited",
            rank=w.rank,
            local_rank=w.local_rank,
            pid=w.popen.pid,
            exitcode=exitcode,
            signal=sig,
            cause=cause,
            stopped_by_agent=self._ending(w).by_agent,
            round=self.result.round,
            attempt=self.attempt,
        )
        self._changed.set()

    def _ending(self, w: Worker) -> Ending:
        declared = w.hang is not None
        at = w.hang_monotonic if declared else w.exit_monotonic
        return Ending(
            w.returncode,
            self.clock.monotonic() if at is None else at,
            stopped_by_agent=w.stopped_by_agent,
            declared=declared,
            agent_signals=frozenset(w.agent_signals),
        )

    def _role(self, w: Worker) -> str:
        """``w``'s role among the failures so far (failures.roles: the one rule)."""
        ended = [x for x in self.workers if x.done or x.hang is not None]
        return roles([self._ending(x) for x in ended])[ended.index(w)]

    # ------------------------------------------------------------- watching
    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self.workers if w.popen is not None]

    @property
    def failed(self) -> bool:
        return any((w.done and w.returncode != 0) or w.hang is not None for w in self.workers)

    def beats(self) -> dict[int, Beat]:
        """The last progress read of each local rank (the watchdog's)."""
        return self.watchdog.beats() if self.watchdog is not None else {}

    @property
    def succeeded(self) -> bool:
        return all(w.done and w.returncode == 0 for w in self.workers)

    async def wait(self) -> bool:
        """Return when a worker failed (False) or all exited 0 (True)."""
        while True:
            if self.failed:
                return False
            if self.succeeded:
                return True
            self._changed.clear()
            await self._changed.wait()

    # ------------------------------------------------------------- stopping
    def send_signal(self, sig: int) -> None:
        """Forward a signal to every live worker's process group."""
        for w in self.workers:
            if w.popen is not None and not w.done:
                _killpg(w.pid, sig)

    def hurry(self) -> None:
        """Cut the current grace short: SIGKILL now."""
        self._hurry.set()

    async def _wait_exits(self, deadline: float) -> None:
        while True:
            pending = [w.exited for w in self.workers if w.exited is not None and not w.done]
            if not pending:
                return
            left = remaining(deadline, self.clock)
            if left <= 0 or self._hurry.is_set():
                return
            hurry: asyncio.Future[Any] = asyncio.ensure_future(self._hurry.wait())
            waiters: list[asyncio.Future[Any]] = [*pending, hurry]
            try:
                await asyncio.wait(waiters, timeout=left, return_when="FIRST_COMPLETED")
            finally:
                hurry.cancel()

    async def stop(self, sig: int = signal.SIGTERM, grace: float | None = None) -> list[int]:
        """Stop every worker: ``sig`` to each process group, wait ``grace``
        (default: the spec's shutdown timeout), SIGKILL, wait, reap. Returns the
        pids that would not die."""
        grace = self.spec.shutdown_timeout if grace is None else grace
        if self.watchdog is not None:
            self.watchdog.close()  # nobody is judged while stopping
        if self._hang_task is not None and not self._hang_task.done():
            await asyncio.wait({self._hang_task}, timeout=5.0)
        live = [w for w in self.workers if w.popen is not None and not w.done]
        for w in live:
            w.stopped_by_agent = True
            _killpg(w.pid, sig)
        if live:
            self.events.emit(
                "workers_stopping", signal=signal_name(sig), pids=[w.pid for w in live], grace=grace
            )
            await self._wait_exits(self.clock.monotonic() + grace)
        stubborn = [w for w in self.workers if w.popen is not None and not w.done]
        if stubborn:
            self.events.emit("workers_killed", pids=[w.pid for w in stubborn], after_grace=grace)
            for w in stubborn:
                _killpg(w.pid, signal.SIGKILL)
            self._hurry.clear()
            await self._wait_exits(self.clock.monotonic() + KILL_WAIT)
        unkillable = [w.pid for w in self.workers if w.popen is not None and not w.done]
        await self.close()
        if unkillable:
            self.events.emit("workers_unkillable", pids=unkillable)
        return unkillable

    async def close(self) -> None:
        """After the workers exited: kill what is left of their process groups
        (children they left behind), finish reading their output, release fds."""
        if self._closed:
            return
        self._closed = True
        if self.watchdog is not None:
            self.watchdog.close()
        for w in self.workers:
            if w.popen is not None:
                _killpg(w.pid, signal.SIGKILL)
                if self.guard is not None and w.done:
                    self.guard.remove(w.pid)
        tasks = [t for w in self.workers for t in w.pump_tasks]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=DRAIN_TIMEOUT)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)
        for w in self.workers:
            self._release(w)

    def _release(self, w: Worker) -> None:
        """Close what the agent holds of worker ``w``: its channel, output
        pipes and pumps, its pidfd."""
        if w.channel is not None:
            w.channel.close()
        for tr in w.transports:
            tr.close()
        for p in w.pumps:
            p.close()
        if w.pidfd is not None:
            with contextlib.suppress(OSError, ValueError):
                asyncio.get_running_loop().remove_reader(w.pidfd)
            with contextlib.suppress(OSError):
                os.close(w.pidfd)
            w.pidfd = None
        if w.popen is not None:
            for pipe in (w.popen.stdout, w.popen.stderr):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()

    # ------------------------------------------------------------- failures
    def failures(self) -> list[WorkerFailure]:
        """Every worker that ended with a non-zero code or a signal (unclassified)."""
        out: list[WorkerFailure] = []
        for w in self.workers:
            rc = w.returncode
            if w.popen is None or rc is None or (rc == 0 and w.hang is None):
                continue
            out.append(self._failure_of(w, rc))
        return out

    def hung(self) -> list[WorkerFailure]:
        """The ranks declared hung that still run, as the failures they will
        be once the agent stops them (SIGTERM): what the agent reports to the
        other nodes before it stops its own, so that theirs are still waiting
        for the hung rank when they are asked for their stacks."""
        return [
            self._failure_of(w, -signal.SIGTERM)
            for w in self.workers
            if w.hang is not None and w.popen is not None and not w.done
        ]

    def _failure_of(self, w: Worker, rc: int) -> WorkerFailure:
        stdout_pump = w.pumps[0] if w.pumps else None
        stderr_pump = w.pumps[1] if len(w.pumps) > 1 else None
        error = read_error_file(w.error_file)
        if w.hang is not None:
            # The hang is the failure; a traceback written while it was stopped
            # (e.g. by @record) shows where it was stuck.
            error = ErrorFileInfo(
                message=w.hang,
                traceback=error.traceback if error is not None else None,
                timestamp=int(w.hang_wall) if w.hang_wall else None,
            )
        return WorkerFailure(
            rank=w.rank,
            local_rank=w.local_rank,
            host=self.spec.host,
            pid=w.pid,
            returncode=rc,
            exit_time=w.hang_wall or w.exit_wall or time.time(),
            exit_monotonic=w.hang_monotonic or w.exit_monotonic or self.clock.monotonic(),
            stopped_by_agent=self._ending(w).by_agent,
            error=error,
            stderr_tail=tuple(stderr_pump.tail) if stderr_pump else (),
            stdout_tail=tuple(stdout_pump.tail) if stdout_pump else (),
            stdout_log=w.routes[0].file_path,
            stderr_log=w.routes[1].file_path,
            error_file=w.error_file,
            attempt=self.attempt,
            restart_count=self.result.restart_count,
            hang=w.hang,
        )


def round_env(
    spec: WorkerSpec,
    result: RoundResult,
    local_rank: int,
    error_file: str,
    heartbeat_file: str | None,
) -> dict[str, str]:
    """The full environment of one worker in ``result``'s round."""
    env = worker_env_mod.worker_env(spec, result, local_rank, error_file)
    if heartbeat_file is not None:
        env[HEARTBEAT_ENV] = heartbeat_file
        if spec.hang_timeout is not None:
            env[HEARTBEAT_INTERVAL_ENV] = repr(heartbeat_interval(spec.hang_timeout))
    return env
