"""One round's workers: spawn, watch, signal, stop and reap them.

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
  process group is registered with the agent's orphan guard (agent/guard.py).

A Python command runs through the worker runner, with a channel socket to
the agent (agent/channel.py: typed messages, bounded). What else a round
does comes from the features' :class:`~elastrun.agent.hooks.RoundHooks`: more
environment, workers forked rather than spawned, the runner's messages, a
rank declared failed while it runs (:meth:`WorkerGroup.declare`: a hang).
The root cause among the failures is decided by one rule, agent/failures.py
``roles``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from elastrun.agent.channel import CHANNEL_ENV, RunnerChannel
from elastrun.agent.children import ForkedProcess, Reaper
from elastrun.agent.command import Executable
from elastrun.agent.env import ROUND_ENV_VARS, rank_vars, worker_env
from elastrun.agent.failures import WorkerFailure, roles
from elastrun.agent.guard import OrphanGuard
from elastrun.agent.log_dirs import rank_dir
from elastrun.agent.logs import FilteredCopy, LogWriteErrors, routes_for
from elastrun.agent.process import Declared, Worker, killpg
from elastrun.agent.round_hooks import RoundHooks
from elastrun.agent.spawn import launcher_stdin, preexec_for
from elastrun.agent.spec import WorkerSpec
from elastrun.clock import SYSTEM_CLOCK, Clock, remaining
from elastrun.errors import WorkerError
from elastrun.event_kinds import (
    RankEntered,
    RanksKept,
    WorkerExited,
    WorkersKilled,
    WorkersStopping,
    WorkersUnkillable,
)
from elastrun.events import EventSink
from elastrun.procs import signal_name
from elastrun.rendezvous.api import Change, RoundResult
from elastrun.worker._messages import (
    Abort,
    Enter,
    Entered,
    Failing,
    InProcess,
    Left,
    Message,
    Restartable,
)
from elastrun.worker._restart import ROUND_ENV  # the round a worker starts in

__all__ = ["FAILING_GRACE", "Worker", "WorkerGroup", "spawn", "stop_unowned"]

# How long a rank whose script failed may take to end by itself (its
# interpreter's teardown) before it is stopped like the others.
FAILING_GRACE = 5.0

KILL_WAIT = 5.0  # after SIGKILL, how long to wait for the kernel to finish them
DRAIN_TIMEOUT = 2.0  # after exit, how long to wait for the rest of a worker's output
# In-process restarts (docs/in_process.md): how long a rank asked to leave its
# function may take before its process is replaced, and how long a rank that
# left by itself (its collective broke) waits for the failure that broke it
# before it is declared failed.
LEAVE_TIMEOUT = 10.0
LEFT_GRACE = 30.0


def spawn(
    spec: WorkerSpec,
    local_rank: int,
    env: dict[str, str],
    channel: socket.socket | None,
    *,
    guard: OrphanGuard | None,
    reaper: Reaper | None,
) -> subprocess.Popen[bytes]:
    """Start the command of ``local_rank`` (a standby: 0) as a new session and
    process group, dying with the agent (PR_SET_PDEATHSIG), registered with
    the orphan guard and the reaper; its stdout and stderr are pipes.
    Raises WorkerError when it cannot be started."""
    argv = spec.command.worker_argv(local_rank)
    cpus = spec.cpu_binding.get(local_rank)
    if cpus:  # --numa-binding, as torchrun
        argv = ("numactl", f"--physcpubind={cpus}", *argv)
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
            f"cannot start worker local rank {local_rank}: "
            f"{spec.command.program}: {e.strerror or e}"
        ) from e
    if guard is not None:
        guard.add(popen.pid)
    if reaper is not None:
        reaper.watch_session(popen.pid)
    return popen


async def stop_unowned(
    workers: list[Worker], sig: int, grace: float, guard: OrphanGuard | None
) -> None:
    """Stop processes no round's group owns (kept ones no round took over,
    standbys): ``sig`` to each process group, ``grace``, SIGKILL, a bounded
    wait (KILL_WAIT); what is left in their groups is killed, the agent's
    hold on them released."""
    for w in workers:
        if not w.done:
            killpg(w.pid, sig)
    waits = [w.exited for w in workers if w.exited is not None and not w.done]
    if waits:
        await asyncio.wait(waits, timeout=grace)
    for w in workers:
        if not w.done:
            killpg(w.pid, signal.SIGKILL)
    waits = [w.exited for w in workers if w.exited is not None and not w.done]
    if waits:
        await asyncio.wait(waits, timeout=KILL_WAIT)
    for w in workers:
        killpg(w.pid, signal.SIGKILL)  # what it left behind in its group
        if w.done and guard is not None:
            guard.remove(w.pid)
        w.release()


class WorkerGroup:
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
        log_errors: LogWriteErrors | None = None,
        round_hooks: Callable[[WorkerGroup], Iterable[RoundHooks | None]] = lambda _g: (),
        kept: Mapping[int, Worker] | None = None,
        on_restartable: Callable[[], None] = lambda: None,
    ) -> None:
        self.spec = spec
        # A worker said its script uses an in-process function (standbys may start).
        self.on_restartable = on_restartable
        self.result = result
        self.attempt = attempt
        self.attempt_dir = attempt_dir
        self.events = events
        self.clock = clock
        self.guard = guard
        self.reaper = reaper
        # Log files that cannot be written: warned about once (the agent's, across rounds).
        self.log_errors = log_errors if log_errors is not None else LogWriteErrors(events)
        # Python commands run through elastrun's runner, with a channel to the agent.
        self.runs_runner = not isinstance(spec.command, Executable)
        self.workers: list[Worker] = []
        self.envs: dict[int, dict[str, str]] = {}  # each local rank's, once started
        self._changed = asyncio.Event()
        self._reaping = False  # inside _reap_signalled
        self._untold: list[Worker] = []  # exited, their worker_exited events not emitted yet
        self._hurry = asyncio.Event()
        self._ended = False
        self._closed = False
        self.copies = {
            name: FilteredCopy(
                os.path.join(attempt_dir, f"filtered_{name}.log"), filters, self.log_errors
            )
            for name, filters in (
                ("stdout", spec.logs.duplicate_stdout_filters),
                ("stderr", spec.logs.duplicate_stderr_filters),
            )
            if filters and keep_files
        }
        kept = kept or {}
        for lr in range(spec.nproc):
            rank = result.rank_offset + lr
            if lr in kept:  # its process left the last round's function: kept
                w = kept[lr]
                w.take_over(rank, result.round)
                self.workers.append(w)
                continue
            routes = routes_for(
                spec,
                attempt_dir if keep_files else None,
                lr,
                rank=rank,
                group_rank=result.group_rank,
                restart=result.restart_count,
                copies=self.copies,
            )
            folder = os.path.join(attempt_dir, str(lr))
            self.workers.append(
                Worker(
                    lr, rank, folder, os.path.join(folder, "error.json"), routes, round=result.round
                )
            )
        # The features' hooks for this round (agent/hooks.py), made before its workers start.
        self.hooks: list[RoundHooks] = [h for h in round_hooks(self) if h is not None]

    # ---------------------------------------------------------------- start
    async def start(self) -> None:
        """Start every worker: the features' ``fork`` hooks may fork some, the
        rest are spawned one at a time, yielding to the event loop after each
        so that a signal is handled while a large group spawns. Raises
        WorkerError if one cannot be started (the caller stops the others)."""
        for h in self.hooks:
            await h.before_start()
        theirs: dict[int, socket.socket] = {}
        for w in self.workers:
            self._prepare(w)
            env = worker_env(self.spec, self.result, w.local_rank, w.error_file)
            for h in self.hooks:
                env.update(h.worker_env(w))
            self.envs[w.local_rank] = env
            if w.popen is not None:  # kept: it enters its function again
                continue
            if self.runs_runner:
                env[ROUND_ENV] = str(self.result.round)
                ours, theirs[w.local_rank] = socket.socketpair()
                w.channel = RunnerChannel(ours)
        try:
            for w in self.workers:
                if w.popen is not None:
                    self._enter(w)
            forked: dict[int, ForkedProcess] = {}
            for h in self.hooks if self.runs_runner else ():
                rest = {
                    lr: env for lr, env in self.envs.items() if lr not in forked and lr in theirs
                }
                channels = {lr: theirs[lr].fileno() for lr in rest}
                forked.update(await h.fork(rest, channels) if rest else {})
            for w in self.workers:  # the forked ones exist already: registered first
                if w.local_rank in forked:
                    w.popen, w.warm = forked[w.local_rank], True
                    self._watch(w)
            for w in self.workers:
                if w.popen is None:
                    w.popen = self._spawn(w, self.envs[w.local_rank], theirs.get(w.local_rank))
                    self._watch(w)
                    await asyncio.sleep(0)
        finally:
            for sock in theirs.values():
                sock.close()
        for h in self.hooks:
            h.started()

    def _enter(self, w: Worker) -> None:
        """A kept process: watched by this group, told to enter its function
        again with this round's variables (as a fresh worker's environment)."""
        loop = asyncio.get_running_loop()
        w.on_exit = lambda: self._on_exit(loop, w)
        if w.channel is not None:
            w.channel.rebind(
                lambda message: self._on_message(w, message), lambda: self._channel_closed(w)
            )
            env = self.envs[w.local_rank]
            if w.standby_env is not None:  # a standby: every variable its rank sets
                given = rank_vars(w.standby_env, env)
                w.standby_env = None
            else:
                given = {k: env[k] for k in ROUND_ENV_VARS}
            w.channel.send(Enter(self.result.round, given))
        if w.done:  # it ended meanwhile: its exit is this round's failure
            self._changed.set()

    def _prepare(self, w: Worker) -> None:
        """The worker's folder (private, see ``rank_dir``: a refused one is a
        WorkerError before any worker starts), without the error file of an
        earlier run."""
        try:
            rank_dir(self.attempt_dir, w.local_rank)
        except OSError as e:  # a full or read-only disk: the worker runs without one
            self.log_errors.report(
                w.folder,
                e,
                rank=w.rank,
                local_rank=w.local_rank,
                fate="the worker runs without an error file",
            )
        with contextlib.suppress(OSError):
            os.unlink(w.error_file)  # a stale file from an earlier run with this run id

    def _spawn(
        self, w: Worker, env: dict[str, str], channel: socket.socket | None
    ) -> subprocess.Popen[bytes]:
        return spawn(self.spec, w.local_rank, env, channel, guard=self.guard, reaper=self.reaper)

    # ------------------------------------------------------------- watching
    def _watch(self, w: Worker) -> None:
        """Watch a started worker: its exit, its output, its channel."""
        loop = asyncio.get_running_loop()
        w.watch_exit(loop, lambda: self._on_exit(loop, w))
        w.pump(loop, self.log_errors)
        if w.channel is not None:
            w.channel.watch(
                self.clock.monotonic,
                lambda message: self._on_message(w, message),
                lambda: self._channel_closed(w),
            )
            if w.warm:
                w.channel.go()  # registered: the forked worker may run

    def _on_message(self, w: Worker, message: Message) -> None:
        if isinstance(message, Restartable | Left | Entered):
            self._in_process(w, message)
            if isinstance(message, Restartable):
                self.on_restartable()
            return
        if isinstance(message, InProcess):
            self.on_restartable()
            return
        if isinstance(message, Failing):
            if w.failing is None and not w.done:
                self._reap_signalled(asyncio.get_running_loop(), w)
                w.failing = (self.clock.monotonic(), time.time())
                self._changed.set()  # the group has failed
            return
        for h in self.hooks:
            h.on_message(w, message)

    def _in_process(self, w: Worker, message: Restartable | Left | Entered) -> None:
        """The in-process restart protocol's messages (docs/in_process.md);
        one of another round than the worker's is ignored."""
        if message.round != w.round or w.done:
            return
        match message:
            case Restartable() | Entered():
                w.restartable = True
                self.events.emit(
                    RankEntered(
                        round=w.round,
                        attempt=self.attempt,
                        rank=w.rank,
                        local_rank=w.local_rank,
                        pid=w.pid,
                        world_size=self.result.world_size,
                        master=f"{self.result.master_addr}:{self.result.master_port}",
                        again=isinstance(message, Entered),
                    )
                )
            case Left() if w.left is None:
                w.left = (message.why, self.clock.monotonic())
                # Its collective broke: a failure that broke it is expected
                # soon; with none, the rank is declared failed (bounded).
                loop = asyncio.get_running_loop()
                loop.call_later(LEFT_GRACE, self._left_alone, w)
                self._changed.set()

    def _left_alone(self, w: Worker) -> None:
        if not self._ended and w.left is not None and not self.failed and w in self.workers:
            self.declare(w, f"it left its function ({w.left[0]}) and no failure followed")

    async def leave(self, timeout: float = LEAVE_TIMEOUT) -> list[Worker]:
        """The group failed: every rank whose process may survive (it entered
        an in-process function, has not raised, is not declared failed, runs)
        is asked to leave its function; returns those that left within
        ``timeout`` (marked kept: :meth:`stop` and :meth:`close` spare them),
        the others are stopped with the group."""
        candidates = [
            w
            for w in self.workers
            if w.restartable
            and w.popen is not None
            and not w.done
            and w.failing is None
            and w.declared is None
        ]
        if not candidates:
            return []  # nothing to keep: the group is stopped as a whole, at once
        # A rank that raised ends by itself (its interpreter's teardown); a
        # rank declared hung (its stacks taken already) is stopped now: its
        # peers' collectives, waiting on it, break once its sockets close (an
        # Abort alone does not end a gloo collective that waits on a live peer).
        hung = [w for w in self.workers if w.declared is not None and w.popen is not None]
        for w in hung:
            if not w.done:
                w.stopped_by_agent = True
                killpg(w.pid, signal.SIGTERM)
        ending = [
            w.exited
            for w in self.workers
            if (w.failing is not None or w in hung) and w.exited is not None and not w.done
        ]
        if ending:
            await asyncio.wait(ending, timeout=min(timeout, FAILING_GRACE))
        for w in candidates:
            w.note_dying(self.clock.monotonic())
            if w.left is None and w.dying is None and w.channel is not None:
                w.channel.send(Abort(w.round))
        deadline = self.clock.monotonic() + timeout
        while True:
            waiting = [w for w in candidates if w.left is None and not w.done and w.dying is None]
            left = remaining(deadline, self.clock)
            if not waiting or left <= 0:
                break
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)
        kept = [w for w in candidates if w.left is not None and not w.done and w.dying is None]
        for w in kept:
            w.kept = True
        return kept

    def _channel_closed(self, w: Worker) -> None:
        for h in self.hooks:
            h.channel_closed(w)

    def _reap_signalled(self, loop: asyncio.AbstractEventLoop, w: Worker) -> None:
        """Before ``w``'s failure is timed: every other rank already ended,
        first. A rank killed by a signal says nothing before it dies; its
        death reaches the agent only as its exit, which may wait in the same
        turn of the event loop as the failure it caused in a peer, or not be
        reported yet at all: its sockets close while its last threads still
        end. Found killed now, it is reaped now; found ending (exit_begun),
        its exit is timed now, before ``w``'s failure."""
        if self._reaping:  # already at it: one pass, not one per rank found
            return
        self._reaping = True
        try:
            for x in self.workers:
                if x is w or x.done or x.popen is None or x.exited is None:
                    continue
                try:  # a look only: the exit status stays for reap()
                    found = os.waitid(os.P_PID, x.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                except (ChildProcessError, OSError):
                    continue
                if found is not None and found.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
                    self._on_exit(loop, x)
                elif found is None:
                    x.note_dying(self.clock.monotonic())
        finally:
            self._reaping = False

    def _on_exit(self, loop: asyncio.AbstractEventLoop, w: Worker) -> None:
        if not w.done and w.failing is None:
            self._reap_signalled(loop, w)
        rc = w.reap(loop, self.clock.monotonic())
        if rc is None:
            return
        for h in self.hooks:
            h.exited(w)
        # Its role is told once no peer is still ending unreported (found
        # dying): that peer may have ended first. Milliseconds, and bounded
        # by the stop (FAILING_GRACE, then SIGKILL) and close().
        self._untold.append(w)
        if not any(x.dying is not None and not x.done for x in self.workers):
            self._tell_exits()
        self._changed.set()

    def _tell_exits(self) -> None:
        """The worker_exited events of the exits not told yet, each with its
        role among the failures so far, by the one rule."""
        untold, self._untold = self._untold, []
        ended = [x for x in self.workers if x.done or x.declared is not None]
        now = self.clock.monotonic()
        endings = [x.ending(now) for x in ended]
        causes = roles(endings)
        for w in untold:
            mine = ended.index(w)
            rc = w.returncode
            assert rc is not None
            exitcode, sig = (rc, None) if rc >= 0 else (None, signal_name(-rc))
            self.events.emit(
                WorkerExited(
                    rank=w.rank,
                    local_rank=w.local_rank,
                    pid=w.pid,
                    exitcode=exitcode,
                    signal=sig,
                    cause=causes[mine],
                    stopped_by_agent=endings[mine].by_agent,
                    round=self.result.round,
                    attempt=self.attempt,
                )
            )

    def ranks_kept(self) -> RanksKept | None:
        """Which ranks' processes this round took over from the last one
        (kept), and which started anew; None when none was kept. A rank served
        by a standby in this round is in neither (``standby_used`` tells it);
        that process, kept again in a later round, is kept."""
        kept = [w for w in self.workers if w.taken_over]
        if not kept:
            return None
        return RanksKept(
            round=self.result.round,
            attempt=self.attempt,
            kept=[w.rank for w in kept],
            kept_pids=[w.pid for w in kept],
            started=[w.rank for w in self.workers if not w.taken_over and not w.standby],
        )

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self.workers if w.popen is not None]

    @property
    def kept(self) -> dict[int, Worker]:
        """The processes the next round takes over, by local rank (:meth:`leave`)."""
        return {w.local_rank: w for w in self.workers if w.kept and not w.done}

    @property
    def failed(self) -> bool:
        return any(
            (w.done and w.returncode != 0) or w.declared is not None or w.failing is not None
            for w in self.workers
        )

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

    def declare(self, w: Worker, why: str) -> None:
        """A feature found ``w`` failed while it runs (a hang): the group has
        failed, ``w`` at this moment, for ``why``."""
        if w.declared is None and not w.done:
            w.declared = Declared(why, self.clock.monotonic(), time.time())
            self._changed.set()

    def signalling(self, local_rank: int, signum: int) -> None:
        """A feature is about to send ``signum`` to the worker of ``local_rank``
        for another purpose than stopping it (the stack signal): should the worker
        die of it, that is the agent's doing, never a root cause (failures.roles)."""
        self.workers[local_rank].agent_signals.add(signum)

    # ------------------------------------------------------------- the end
    async def end(self) -> None:
        """The round is over: the features' ``ended`` hooks, once."""
        if self._ended:
            return
        self._ended = True
        for h in self.hooks:
            await h.ended()

    async def report(self) -> str:
        """The features' lines for the failure summary ("" when none)."""
        lines = [await h.failed() for h in self.hooks]
        return "\n".join(x for x in lines if x)

    async def changed(self, change: Change) -> None:
        for h in self.hooks:
            await h.changed(change)

    # ------------------------------------------------------------- stopping
    def send_signal(self, sig: int) -> None:
        """Forward a signal to every live worker's process group."""
        for w in self.workers:
            if w.popen is not None and not w.done:
                killpg(w.pid, sig)

    def hurry(self) -> None:
        """Cut the current grace short: SIGKILL now."""
        self._hurry.set()

    async def _wait_exits(self, deadline: float) -> None:
        while True:
            pending = [
                w.exited for w in self.workers if w.exited is not None and not w.done and not w.kept
            ]
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
        await self.end()  # nobody is judged while stopping
        live = [w for w in self.workers if w.popen is not None and not w.done and not w.kept]
        for w in live:
            w.note_dying(self.clock.monotonic())
        # A rank whose script failed, or whose process was found ending, is
        # ending by itself (its interpreter's teardown, its last threads): it
        # keeps its own exit status unless that takes longer than
        # FAILING_GRACE; it stays its own failure either way.
        ending = [
            w for w in live if (w.failing is not None or w.dying is not None) and w.declared is None
        ]
        for w in live:
            if w not in ending:
                w.stopped_by_agent = True
                killpg(w.pid, sig)
        if live:
            self.events.emit(
                WorkersStopping(signal=signal_name(sig), pids=[w.pid for w in live], grace=grace)
            )
            start = self.clock.monotonic()
            if ending:
                await self._wait_exits(start + min(grace, FAILING_GRACE))
                for w in ending:
                    if not w.done:
                        killpg(w.pid, sig)
            await self._wait_exits(start + grace)
        stubborn = [w for w in self.workers if w.popen is not None and not w.done and not w.kept]
        if stubborn:
            self.events.emit(WorkersKilled(pids=[w.pid for w in stubborn], after_grace=grace))
            for w in stubborn:
                killpg(w.pid, signal.SIGKILL)
            self._hurry.clear()
            await self._wait_exits(self.clock.monotonic() + KILL_WAIT)
        unkillable = [
            w.pid for w in self.workers if w.popen is not None and not w.done and not w.kept
        ]
        await self.close()
        if unkillable:
            self.events.emit(WorkersUnkillable(pids=unkillable))
        return unkillable

    async def close(self) -> None:
        """After the workers exited: kill what is left of their process groups
        (children they left behind), finish reading their output, release fds."""
        if self._closed:
            return
        self._closed = True
        self._tell_exits()  # a peer found dying that never ended: told without it
        await self.end()
        gone = [w for w in self.workers if not w.kept]  # the kept run on, the next round's
        for w in gone:
            if w.popen is not None:
                killpg(w.pid, signal.SIGKILL)
                if self.guard is not None and w.done:
                    self.guard.remove(w.pid)
        tasks = [t for w in gone for t in w.pump_tasks]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=DRAIN_TIMEOUT)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)
        for w in gone:
            w.release()
        for copy in self.copies.values():
            copy.close()

    # ------------------------------------------------------------- failures
    def failures(self) -> list[WorkerFailure]:
        """Every worker that ended with a non-zero code or a signal, or was
        declared failed (unclassified)."""
        return [
            self._failure_of(w, w.returncode)
            for w in self.workers
            if w.popen is not None
            and w.returncode is not None
            and (w.returncode != 0 or w.declared is not None)
        ]

    def declared_alive(self) -> list[WorkerFailure]:
        """The ranks declared failed that still run, as the failures they will
        be once the agent stops them (SIGTERM): what the agent reports to the
        other nodes before it stops its own, so that theirs still wait for
        the declared rank while their features look at them (its stacks)."""
        return [
            self._failure_of(w, -signal.SIGTERM)
            for w in self.workers
            if w.declared is not None and w.popen is not None and not w.done
        ]

    def _failure_of(self, w: Worker, rc: int) -> WorkerFailure:
        return w.failure(
            rc,
            host=self.spec.host,
            attempt=self.attempt,
            restart_count=self.result.restart_count,
            now=self.clock.monotonic(),
        )
