"""Standby ranks: processes set up ahead of time for in-process restarts
(docs/in_process.md, *Standby ranks*).

Once a worker of this node says its script uses ``elastrun.train.in_process``
(its ``Restartable``), the agent keeps ``--standby-ranks`` standby processes:
each runs the script, without any rank variable (agent/env.py
``standby_env``), up to its first call of the wrapped function, says
``StandbyReady`` and waits there. When a round starts and a local rank has no
process (its process died, or was replaced for its own error), a ready
standby takes it: it is handed to the round's group as a kept process is
(workers.py), told its rank's variables (``Enter``), and enters the function
without a new process or any setup; a new standby is started in the
background.

Bounds: a standby that ends before it serves a rank, or is not ready within
``READY_TIMEOUT``, is stopped and replaced, at most ``MAX_FAILURES`` times in
a row (then none is started again: ranks start as new processes, as without
standbys). Every standby is its own session and process group, dies with the
agent (PR_SET_PDEATHSIG, the orphan guard), and is stopped with the agent
(:meth:`Standbys.stop`: SIGTERM, the grace, SIGKILL of its group).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from collections.abc import Callable

from elastrun.agent.channel import RunnerChannel
from elastrun.agent.children import Reaper
from elastrun.agent.command import Executable
from elastrun.agent.env import standby_env
from elastrun.agent.guard import OrphanGuard
from elastrun.agent.log_dirs import rank_dir
from elastrun.agent.logs import LogWriteErrors, StreamRoute
from elastrun.agent.modcache import ModuleCache, cache_key
from elastrun.agent.process import Worker, killpg
from elastrun.agent.spec import WorkerSpec
from elastrun.agent.workers import spawn, stop_unowned
from elastrun.clock import SYSTEM_CLOCK, Clock
from elastrun.errors import WorkerError
from elastrun.event_kinds import StandbyFailed, StandbyReady, StandbyStarted
from elastrun.events import EventSink
from elastrun.procs import signal_name
from elastrun.worker._messages import Message
from elastrun.worker._messages import StandbyReady as Ready
from elastrun.worker._restart import PRELOAD_ENV

__all__ = ["MAX_FAILURES", "READY_TIMEOUT", "Standbys"]

READY_TIMEOUT = 1800.0  # s a standby may take to reach the function (its setup)
MAX_FAILURES = 3  # standbys that failed in a row before no more are started


class Standbys:
    """This agent's standby processes."""

    def __init__(
        self,
        spec: WorkerSpec,
        events: EventSink,
        folder: Callable[[], str],
        *,
        clock: Clock = SYSTEM_CLOCK,
        guard: OrphanGuard | None = None,
        reaper: Reaper | None = None,
        log_errors: LogWriteErrors,
    ) -> None:
        self.spec = spec
        self.events = events
        self.folder = folder  # the agent's base folder (made on first use)
        self.clock = clock
        self.guard = guard
        self.reaper = reaper
        self.log_errors = log_errors
        self.env: dict[str, str] | None = None  # set once the script opted in
        self.starting: list[Worker] = []  # started, not ready yet
        self.ready: list[tuple[Worker, float]] = []  # ready since (monotonic)
        self.started = 0  # how many were started
        self.failures = 0  # in a row
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self._born: dict[int, float] = {}  # each standby's start (monotonic), by pid
        self._stopped = False

    # ------------------------------------------------------------ starting
    def want(self, run_id: str, max_restarts: int) -> None:
        """A worker's script uses an in-process function: keep the standbys."""
        if self.env is None and self.spec.standby.count > 0 and not self._stopped:
            self.env = standby_env(self.spec, run_id, max_restarts)
        self.fill()

    def fill(self) -> None:
        """Start standbys until ``--standby-ranks`` are ready or starting."""
        while (
            self.env is not None
            and not self._stopped
            and self.failures < MAX_FAILURES
            and len(self.starting) + len(self.ready) < self.spec.standby.count
        ):
            if not self._start(self.env):
                break

    def _start(self, env: dict[str, str]) -> bool:
        k = self.started
        self.started += 1
        try:
            folder = rank_dir(os.path.join(self.folder(), "standby"), k)
        except (OSError, WorkerError) as e:
            self._failed(None, f"no folder: {e}")
            return False
        routes = tuple(
            StreamRoute(name, os.path.join(folder, f"{name}.log"), True, f"[standby{k}]: ")
            for name in ("stdout", "stderr")
        )
        names = self._preload()
        if names:  # what the workers imported when the script last ran
            try:
                path = os.path.join(folder, "preload.txt")
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write("\n".join(names))
                env = {**env, PRELOAD_ENV: path}
            except OSError:
                pass  # it starts without: its function's first imports are slower
        w = Worker(-1, -1, folder, os.path.join(folder, "error.json"), (routes[0], routes[1]))
        w.standby_env = env
        ours, theirs = socket.socketpair()
        w.channel = RunnerChannel(ours)
        try:
            w.popen = spawn(self.spec, 0, env, theirs, guard=self.guard, reaper=self.reaper)
        except WorkerError as e:
            w.release()
            self._failed(None, str(e))
            return False
        finally:
            theirs.close()
        loop = asyncio.get_running_loop()
        w.watch_exit(loop, lambda: self._exited(loop, w))
        w.pump(loop, self.log_errors)
        w.channel.watch(self.clock.monotonic, lambda m: self._message(w, m), lambda: None)
        self._born[w.pid] = self.clock.monotonic()
        self.starting.append(w)
        self._timers[w.pid] = loop.call_later(READY_TIMEOUT, self._too_slow, w)
        self.events.emit(StandbyStarted(pid=w.pid, attempt=k))
        return True

    def _preload(self) -> list[str]:
        """The modules the warm interpreter's cache holds for this script
        (agent/modcache.py), which a standby imports while it waits."""
        command, warm = self.spec.command, self.spec.warm
        if isinstance(command, Executable) or warm.cache is None or warm.modules == "torch":
            return []
        return ModuleCache(warm.cache, cache_key(command, os.getcwd())).load().shared()

    def _message(self, w: Worker, message: Message) -> None:
        if isinstance(message, Ready) and w in self.starting:
            self.starting.remove(w)
            now = self.clock.monotonic()
            started = self._born.get(w.pid, now)
            self._cancel(w)
            self.ready.append((w, now))
            self.failures = 0
            self.events.emit(StandbyReady(pid=w.pid, setup_s=round(now - started, 3)))

    def _too_slow(self, w: Worker) -> None:
        if w in self.starting:
            killpg(w.pid, signal.SIGKILL)  # its exit counts it failed

    def _exited(self, loop: asyncio.AbstractEventLoop, w: Worker) -> None:
        rc = w.reap(loop, self.clock.monotonic())
        if rc is None:
            return
        ours = [x for x, _ in self.ready if x is w] or [x for x in self.starting if x is w]
        if not ours:
            return
        self.starting = [x for x in self.starting if x is not w]
        self.ready = [(x, t) for x, t in self.ready if x is not w]
        self._cancel(w)
        if self.guard is not None:
            self.guard.remove(w.pid)
        killpg(w.pid, signal.SIGKILL)  # what it left behind in its group
        w.release()
        why = f"exited with code {rc}" if rc >= 0 else f"killed by {signal_name(-rc)}"
        self._failed(w.pid, why)
        loop.call_soon(self.fill)

    def _failed(self, pid: int | None, why: str) -> None:
        if self._stopped:
            return
        self.failures += 1
        retry = self.failures < MAX_FAILURES
        self.events.emit(StandbyFailed(pid=pid or 0, reason=why, retry=retry))

    def _cancel(self, w: Worker) -> None:
        self._born.pop(w.pid, None)
        timer = self._timers.pop(w.pid, None)
        if timer is not None:
            timer.cancel()

    # ------------------------------------------------------------ using
    def take(self, n: int) -> list[tuple[Worker, float]]:
        """Up to ``n`` ready standbys (each with how long it was ready), no
        longer this pool's: the round's group owns them. The caller starts
        new ones (:meth:`fill`) once the round's workers have started: a
        standby's spawn is not on the path to the round's first step."""
        now = self.clock.monotonic()
        taken: list[tuple[Worker, float]] = []
        while self.ready and len(taken) < n:
            w, since = self.ready.pop(0)
            if w.done:
                continue
            w.standby = True
            taken.append((w, round(now - since, 3)))
        return taken

    # ------------------------------------------------------------ the end
    async def stop(self, grace: float) -> None:
        """Stop every standby: SIGTERM to its group, ``grace``, SIGKILL, a
        bounded wait; release what the agent holds of them."""
        self._stopped = True
        every = [*self.starting, *(w for w, _ in self.ready)]
        self.starting, self.ready = [], []
        for w in every:
            self._cancel(w)
        await stop_unowned(every, signal.SIGTERM, grace, self.guard)
