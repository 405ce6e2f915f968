"""Warm starts: workers forked from an interpreter that already imported
what they need.

A worker start costs an interpreter, ``import torch`` and whatever the script
imports next (``torch.optim`` alone pulls in some 800 modules: seconds on a
fast disk, far more on a shared filesystem); every restart pays it again, and
N workers starting at once pay it N times over on the node's cores. The agent
keeps one warm interpreter instead, the *zygote* (``worker/_zygote.py``): it
is started with the worker's interpreter, flags, working directory, command
line and environment (less the per-round and per-rank variables), imports
torch and the modules the script imported when it last ran on this machine
(``agent/modcache.py``), and forks the workers when a round starts. A forked
worker has every one of those modules loaded (shared copy-on-write with the
zygote), and runs the script as ``python -u script`` would.

When the zygote is used:

* ready (its imports done): always;
* still importing: for a script that imports the preloaded modules itself
  (its source says so, or its module list was recorded), it is a head start
  (raised to normal priority): with more workers than usable CPUs the start
  waits for it (at most ``READY_WAIT``: one import beats N fighting for the
  cores); otherwise the workers are forked as soon as it has torch, between
  two of its imports, and import the rest themselves, in parallel;
* never for a script that does not import them: its workers start cold at
  once, and the zygote is kept for a later start.

A zygote that has died, or was started with an environment that differs from
a worker's in anything but the per-round and per-rank variables
(``ROUND_VARS``, ``LOCAL_VARS``), is discarded and the workers start cold: a
warm start can only save time, never change what runs. The zygote imports at
idle CPU priority where it may return to normal priority afterwards (root or
``CAP_SYS_NICE``), otherwise after a delay, so it does not slow the workers'
own start. It is the agent's child like a worker: own session,
``PR_SET_PDEATHSIG``, registered with the orphan guard, killed when the agent
ends or no start will need it. Workers are forked through an intermediate
process so that they are the agent's children (``agent/children.py``).

Only Python commands built by the launcher (a script or ``-m`` module, not
``--no-python`` or ``--run-path``) get a zygote (``WorkerSpec.prewarm``).
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from elastrun.agent.channel import decode
from elastrun.agent.children import ForkedProcess, Reaper
from elastrun.agent.command import PythonCommand, with_local_rank
from elastrun.agent.env import ROUND_ENV_VARS, stable_env
from elastrun.agent.guard import OrphanGuard
from elastrun.agent.modcache import (
    ModuleCache,
    ModuleList,
    ModuleReport,
    installed_only,
    merged,
    skipped,
    valid_names,
)
from elastrun.agent.spawn import entry_file, imports_any, launcher_stdin, preexec_for
from elastrun.agent.spec import WorkerSpec
from elastrun.agent.stacks import STACK_SIGNAL_ENV, STACKS_ENV
from elastrun.agent.watchdog import HEARTBEAT_ENV, HEARTBEAT_INTERVAL_ENV, heartbeat_interval
from elastrun.errors import WorkerError
from elastrun.events import EventSink
from elastrun.untrusted import printable
from elastrun.worker._messages import Fork, Forked, Preload, PreloadPlan, Ready, Unsafe, encode
from elastrun.worker._modnames import script_module

__all__ = ["LOCAL_VARS", "ROUND_VARS", "SparePool", "compatible"]

PRELOAD = ("torch",)
UNPRIVILEGED_DELAY = 3.0  # s: without idle priority, let cold workers import first
PRELOAD_BUDGET = 120.0  # s a zygote may spend importing
PRELOAD_MAX_RSS = 4096  # MiB a zygote may grow to while importing
READY_WAIT = 60.0  # s a start of more workers than CPUs waits for a zygote importing
MAX_REFUSALS = 8  # zygotes quitting on an unsafe module before the list is dropped
FORK_TIMEOUT = 30.0  # s for a zygote to answer a fork order
REAP_WAIT = 2.0
MAX_MESSAGE = 1 << 20
STDERR_TAIL = 4096

# Worker variables that change from round to round, and from local rank to
# local rank; everything else in a worker's environment must be what the
# zygote was started with.
ROUND_VARS = frozenset((*ROUND_ENV_VARS, HEARTBEAT_ENV, STACKS_ENV, STACK_SIGNAL_ENV))
LOCAL_VARS = frozenset(("LOCAL_RANK",))

# What the runner and the zygote read (worker/_runner.py, worker/_zygote.py).
MODE_ENV = "ELASTRUN_RUNNER"
SCOPE_ENV = "ELASTRUN_MODULE_SCOPE"
PRELOAD_ENV = "ELASTRUN_PRELOAD"
DELAY_ENV = "ELASTRUN_SPARE_DELAY"
AGENT_ENV = "ELASTRUN_AGENT_PID"
BUDGET_ENV = "ELASTRUN_PRELOAD_BUDGET"
RSS_ENV = "ELASTRUN_PRELOAD_MAX_RSS"
# Set per worker by the agent for the runner, which removes them.
RUNNER_VARS = frozenset((SCOPE_ENV, "ELASTRUN_CHANNEL_FD"))


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def compatible(started: Mapping[str, str], wanted: Mapping[str, str]) -> str | None:
    """None if a zygote started with ``started`` may fork a worker with
    ``wanted``; otherwise the first variable that differs (the runner's own
    variables, which it removes before the script runs, aside)."""
    skip = ROUND_VARS | LOCAL_VARS | RUNNER_VARS
    for key in sorted(set(started) | set(wanted)):
        if key not in skip and started.get(key) != wanted.get(key):
            return key
    return None


@dataclass
class _Zygote:
    popen: subprocess.Popen[bytes]
    sock: socket.socket
    env: dict[str, str]
    started: float
    ready: bool = False
    ready_event: asyncio.Event = field(default_factory=asyncio.Event)
    pending: asyncio.Future[list[int | None]] | None = None
    stderr: bytearray = field(default_factory=bytearray)
    gone: str | None = None  # why it cannot be used any more

    @property
    def pid(self) -> int:
        return self.popen.pid


class SparePool:
    """The node's warm interpreter, across rounds."""

    def __init__(
        self,
        spec: WorkerSpec,
        command: PythonCommand,
        events: EventSink,
        guard: OrphanGuard | None = None,
        reaper: Reaper | None = None,
        *,
        preload: Sequence[str] = PRELOAD,
        cache: ModuleCache | None = None,
        scope: str = "installed",
        budget: float = PRELOAD_BUDGET,
        max_rss_mb: float = PRELOAD_MAX_RSS,
        say: Any = None,
    ) -> None:
        self.spec = spec
        self.command = command
        self.events = events
        self.guard = guard
        self.reaper = reaper if reaper is not None else Reaper()
        self.preload = tuple(preload)
        self.cache = cache
        self.scope = scope
        self.budget = budget
        self.max_rss_mb = max_rss_mb
        self._say = say
        # The module name that would run the script: never imported ahead of time.
        self.script = script_module(command.kind, command.target)
        self._cache_said = False
        self.recorded = cache.load(self.script) if cache is not None else ModuleList()
        self._cache_problem()
        # A zygote still importing is a head start only for a worker that
        # imports the same: a script that never imports torch would wait for it.
        self.head_start = (
            not self.preload
            or bool(self.recorded.modules)
            or imports_any(entry_file(command), self.preload)
        )
        self._z: _Zygote | None = None
        self._dead: list[subprocess.Popen[bytes]] = []
        self._closed = False
        self.error: WorkerError | None = None
        # False for the next start only: a zygote still importing is not used
        # (set when a joining node stopped waiting for it: it is slow).
        self.use_unready = True
        self.refusals = 0  # zygotes that quit on an unsafe module
        self.gave_up = False  # the recorded list was dropped once already

    # ------------------------------------------------------------ state
    @property
    def pids(self) -> list[int]:
        z = self._z
        return [] if z is None or z.gone else [z.pid]

    @property
    def ready(self) -> bool:
        z = self._z
        return z is not None and z.gone is None and z.ready

    def first_env(self, max_restarts: int) -> dict[str, str]:
        """The zygote's environment before the first round: the stable part of a
        worker's (the round's part comes with the fork order). ``max_restarts``
        as this node's settings say; should the job's differ, the zygote is
        discarded at the first fork."""
        env = stable_env(self.spec, 0, self.spec.run_id, max_restarts)
        if self.spec.hang_timeout is not None:
            env[HEARTBEAT_INTERVAL_ENV] = repr(heartbeat_interval(self.spec.hang_timeout))
        return env

    # ------------------------------------------------------------ starting
    def keep(self, env: Mapping[str, str]) -> None:
        """Make sure a zygote compatible with workers of environment ``env``
        lives (after a start: for the next one)."""
        if self._closed:
            return
        self.reap()
        z = self._z
        if z is not None and z.gone is None and z.popen.poll() is None:
            why = compatible(z.env, env)
            if why is None:
                return
            self._discard(z, f"started with a different {why}")
        self._z = self._spawn(env)

    def _spawn(self, env: Mapping[str, str]) -> _Zygote | None:
        if not self.reaper.enable():
            if self.error is None:
                self.error = self.reaper.error
                self.events.emit("spare_failed", reason=str(self.reaper.error))
            return None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = self.command.worker_argv(None)  # the fork order brings each rank's arguments
        # Only what every worker shares: no rank, round or runner variable.
        z_env = {k: v for k, v in env.items() if k not in ROUND_VARS | LOCAL_VARS | RUNNER_VARS}
        skip = self.recorded.skip
        modules = [m for m in (*self.preload, *self.recorded.modules) if not skipped(m, skip)]
        preload = PreloadPlan(
            modules=tuple(modules),
            python=self.recorded.python,
            torch=self.recorded.torch,
            # What a module must not read while the zygote imports it.
            watch=tuple(sorted(ROUND_VARS | LOCAL_VARS)),
            # Imported before any fork: every worker forked has torch.
            base=sum(1 for m in self.preload if not skipped(m, skip)),
        )
        spawn_env = {
            **z_env,
            MODE_ENV: "zygote",
            SCOPE_ENV: self.scope,
            PRELOAD_ENV: json.dumps(preload.to_json()),
            DELAY_ENV: repr(UNPRIVILEGED_DELAY),
            AGENT_ENV: str(os.getpid()),
            BUDGET_ENV: repr(self.budget),
            RSS_ENV: repr(self.max_rss_mb),
        }
        try:
            popen = subprocess.Popen(
                argv,
                env=spawn_env,
                stdin=theirs.fileno(),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
                preexec_fn=preexec_for(os.getpid()),  # noqa: PLW1509 - a pre-resolved prctl
                close_fds=True,
            )
        except OSError as e:
            ours.close()
            self.events.emit("spare_failed", reason=str(e))
            return None
        finally:
            theirs.close()
        ours.setblocking(False)
        if self.guard is not None:
            self.guard.add(popen.pid)
        # Whatever an import starts in the zygote's session comes to the agent
        # if the zygote is killed first: reaped like a worker's orphans.
        self.reaper.watch_session(popen.pid)
        z = _Zygote(popen, ours, z_env, started=time.monotonic())
        self.events.emit("spare_started", pid=popen.pid, modules=len(modules))
        self._watch(z)
        return z

    # ------------------------------------------------------------ messages
    def _watch(self, z: _Zygote) -> None:
        loop = asyncio.get_running_loop()
        loop.add_reader(z.sock.fileno(), self._on_message, z)
        if z.popen.stderr is not None:
            fd = z.popen.stderr.fileno()
            os.set_blocking(fd, False)
            loop.add_reader(fd, self._on_stderr, z, fd)

    def _on_stderr(self, z: _Zygote, fd: int) -> None:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            asyncio.get_running_loop().remove_reader(fd)
            return
        z.stderr += data
        del z.stderr[:-STDERR_TAIL]

    def _on_message(self, z: _Zygote) -> None:
        while True:
            try:
                data = z.sock.recv(MAX_MESSAGE)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self._lost(z)
                return
            message = decode(data, max_bytes=MAX_MESSAGE, what="a warm interpreter's message")
            match message:
                case Ready():
                    self._ready(z, message)
                case Forked(pids=pids):
                    if z.pending is not None and not z.pending.done():
                        z.pending.set_result(list(pids))
                case Unsafe():
                    self._refused(z, message.modules, message.why)

    def _ready(self, z: _Zygote, message: Ready) -> None:
        z.ready = True
        z.ready_event.set()
        self.events.emit(
            "spare_ready",
            pid=z.pid,
            preload_s=round(time.monotonic() - z.started, 3),
            loaded=message.loaded,
            failed=[name for name, _ in message.failed],
            rss_mb=round(message.rss_kb / 1024, 1),
            stopped=message.stopped,
        )
        for name, why in message.failed:
            self.debug(f"warm interpreter skipped module {name}: {why}")
        if message.stopped:
            self.debug(f"warm interpreter stopped importing: {message.stopped}")

    def _refused(self, z: _Zygote, unsafe: Sequence[str], why: str) -> None:
        """The zygote found a module unsafe to import ahead of time and quit:
        remember it (with its package) and start another without it, a bounded
        number of times."""
        names = valid_names(list(unsafe))
        for name in names:
            self.recorded.skip[name] = why
        self.recorded.modules = [
            m for m in self.recorded.modules if not skipped(m, self.recorded.skip)
        ]
        self._save()
        shown = f"modules {', '.join(names)} are" if len(names) > 1 else f"module {names[0]} is"
        if not names:
            shown = "a module is"
        self._discard(z, f"{shown} not safe to import ahead of time: {why}")
        self.debug(f"{shown} not imported ahead of time any more: {why}")
        if self._z is not z:
            return
        self.refusals += 1
        if not names or self.refusals > MAX_REFUSALS:
            # Something keeps refusing that the skip list does not catch:
            # torch alone from now on, and after that, no zygote at all.
            if self.gave_up:
                self._z = None
                return
            self.gave_up = True
            self.recorded = ModuleList(skip=self.recorded.skip)
        self._z = self._spawn(z.env)

    def _lost(self, z: _Zygote) -> None:
        self._unwatch(z)
        if z.gone is None:
            z.gone = f"exited before it was needed: {self._tail(z)}"
        if z.pending is not None and not z.pending.done():
            z.pending.set_result([])
        z.ready_event.set()  # nobody waits for a zygote that is gone

    def _unwatch(self, z: _Zygote) -> None:
        with contextlib.suppress(RuntimeError, ValueError, OSError):
            loop = asyncio.get_running_loop()
            loop.remove_reader(z.sock.fileno())
            if z.popen.stderr is not None:
                loop.remove_reader(z.popen.stderr.fileno())

    def _tail(self, z: _Zygote) -> str:
        lines = z.stderr.decode(errors="replace").strip().splitlines()
        rc = z.popen.poll()
        head = f"exit code {rc}" if rc is not None else "still running"
        return f"{head}: {lines[-1][:300]}" if lines else head

    def debug(self, line: str) -> None:
        """``line`` on the agent's console with ``ELASTRUN_DEBUG`` set."""
        if self._say is not None and os.environ.get("ELASTRUN_DEBUG"):
            self._say(f"elastrun: debug: {printable(line, limit=1000)}")

    # ------------------------------------------------------------ learning
    def learn(self, report: ModuleReport, why: str, *, peer: bool = False) -> bool:
        """The modules a script imported, as a local worker reported them or
        (``peer``) as the job's note from another node says: remember them,
        and have the zygote import the new ones for the next start. Every name
        passes ``_modnames.refusal`` (again: ``report`` may have been built by
        hand); a peer's names must also resolve to the standard library or an
        installed package here, unless the scope is ``all``. True when there
        were new ones."""
        names = valid_names(list(report.modules), script=self.script)
        if peer and self.scope != "all":
            names = installed_only(names)
        known = set(self.preload) | set(self.recorded.modules)
        new = [n for n in names if n not in known and not skipped(n, self.recorded.skip)]
        if report.refused or len(names) < len(report.modules):
            dropped = report.refused + len(report.modules) - len(names)
            self.debug(f"{dropped} module names {'of the job' if peer else 'reported'} refused")
        if not new:
            return False
        self.recorded.modules = merged(self.recorded.modules, new, self.recorded.skip)
        self.recorded.python = report.python
        self.recorded.torch = report.torch
        self.head_start = True
        saved = self._save()
        self.events.emit(
            "modules_recorded",
            modules=len(self.recorded.modules),
            new=len(new),
            why=why,
            cache=self.cache.path if self.cache is not None and saved else None,
        )
        z = self._z
        if z is not None and z.gone is None:
            with contextlib.suppress(OSError):
                z.sock.send(encode(Preload(tuple(new))))
                z.ready = False
                z.ready_event.clear()
        return True

    def note(self) -> ModuleReport:
        """What the other agents of the job may learn from this one."""
        r = self.recorded
        return ModuleReport(tuple(r.modules), r.python, r.torch)

    def _save(self) -> bool:
        if self.cache is None:
            return False
        if self.cache.save(self.recorded):
            return True
        self._cache_problem()
        return False

    def _cache_problem(self) -> None:
        """Say why the cache could not be used: a refused file or folder once
        on the console (it costs only warmth), a plain I/O failure in debug."""
        cache = self.cache
        if cache is None or cache.error is None:
            return
        line = f"module cache: {cache.error}"
        if not cache.refused or self._cache_said:
            self.debug(line)
            return
        self._cache_said = True
        if self._say is not None:
            self._say(f"elastrun: warning: {printable(line, limit=1000)}")

    # ------------------------------------------------------------ using
    async def wait_ready(self, timeout: float) -> bool:
        """Wait (bounded) until the zygote is ready; False if it is not (or gone)."""
        z = self._z
        if z is None or z.gone is not None:
            return False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(z.ready_event.wait(), timeout)
        return z.gone is None and z.ready

    async def fork(
        self, envs: Mapping[int, Mapping[str, str]], channels: Mapping[int, int]
    ) -> dict[int, ForkedProcess]:
        """Workers forked from the zygote, by local rank: each with its
        environment ``envs[lr]`` and its channel socket fd ``channels[lr]``
        (see worker/_runner.py). Empty (start them cold) when the zygote cannot
        be used now; a zygote still importing is kept for later then."""
        z = self._usable(envs)
        if z is None:
            return {}
        waited = time.monotonic()
        use_unready, self.use_unready = self.use_unready, True
        if not z.ready:
            # The workers would import the same themselves: the zygote's
            # import is a head start (and one import, not one per worker).
            if not (self.head_start and use_unready):
                return {}
            _promote(z.pid)
            # More workers than CPUs: one import beats N fighting for the
            # cores, so wait for all of it. Otherwise fork now: the zygote
            # forks once it has torch, between two imports, and the workers
            # import the rest in parallel.
            if len(envs) > usable_cpus() and not await self.wait_ready(READY_WAIT):
                return {}  # gone, or too slow: start cold (a slow one is kept)
        waited = time.monotonic() - waited
        ranks = sorted(envs)
        pipes: dict[int, tuple[int, int, int, int]] = {}
        z.pending = asyncio.get_running_loop().create_future()
        pids: list[int | None] = []
        try:
            pids = await self._order_forks(z, ranks, envs, channels, pipes)
        except (OSError, TimeoutError) as e:
            self._discard(z, f"cannot fork workers: {e!r}")
            self._z = None
        finally:
            z.pending = None
            for _, out_w, _, err_w in pipes.values():
                os.close(out_w)
                os.close(err_w)
        return self._adopt(z, ranks, pipes, pids, waited)

    def _usable(self, envs: Mapping[int, Mapping[str, str]]) -> _Zygote | None:
        """The zygote, if workers with ``envs`` can be forked from it (an
        exited or incompatible one is discarded)."""
        z = self._z
        if z is None or not envs:
            return None
        if z.gone is not None or z.popen.poll() is not None:
            self._discard(z, z.gone or f"exited before it was needed: {self._tail(z)}")
            self._z = None
            return None
        for env in envs.values():
            why = compatible(z.env, env)
            if why is not None:
                self._discard(z, f"started with a different {why}")
                self._z = None
                return None
        return z

    async def _order_forks(
        self,
        z: _Zygote,
        ranks: list[int],
        envs: Mapping[int, Mapping[str, str]],
        channels: Mapping[int, int],
        pipes: dict[int, tuple[int, int, int, int]],
    ) -> list[int | None]:
        """Ask the zygote for one fork per rank (with its output pipes, which
        are recorded in ``pipes``, and channel); the forks' pids, in order."""
        assert z.pending is not None
        stdin = launcher_stdin()
        for i, lr in enumerate(ranks):
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            pipes[lr] = (out_r, out_w, err_r, err_w)
            args = with_local_rank(self.command.args, lr)
            order = Fork(env=dict(envs[lr]), args=args, index=i, count=len(ranks))
            # The worker's stdin too (the agent's, as a cold worker's), with each
            # order: the zygote, shared across rounds, never keeps it.
            fds = array.array(
                "i", [out_w, err_w, channels[lr], *([] if stdin is None else [stdin])]
            )
            z.sock.setblocking(True)
            z.sock.settimeout(5.0)
            z.sock.sendmsg([encode(order)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        z.sock.setblocking(False)
        return await asyncio.wait_for(z.pending, FORK_TIMEOUT)

    def _adopt(
        self,
        z: _Zygote,
        ranks: list[int],
        pipes: dict[int, tuple[int, int, int, int]],
        pids: list[int | None],
        waited: float,
    ) -> dict[int, ForkedProcess]:
        """The forked workers, by local rank (the read ends of the pipes of
        ranks that got no process are closed)."""
        out: dict[int, ForkedProcess] = {}
        for i, lr in enumerate(ranks):
            out_r, _, err_r, _ = pipes.get(lr, (-1, -1, -1, -1))
            pid = pids[i] if i < len(pids) else None
            if pid is None:
                for fd in (out_r, err_r):
                    if fd >= 0:
                        os.close(fd)
                continue
            out[lr] = ForkedProcess(pid, os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb"))
            self.reaper.watch_session(pid)
            if self.guard is not None:
                self.guard.add(pid)
            self.events.emit(
                "spare_used",
                local_rank=lr,
                pid=pid,
                zygote=z.pid,
                warm_s=round(time.monotonic() - z.started, 3),
                waited_s=round(waited, 3),
            )
        return out

    # ------------------------------------------------------------ ending
    def _discard(self, z: _Zygote, reason: str) -> None:
        if z.gone is None or not z.gone.startswith("discarded"):
            self.events.emit("spare_discarded", pid=z.pid, reason=reason)
        z.gone = f"discarded: {reason}"
        self._unwatch(z)
        with contextlib.suppress(OSError):
            z.sock.close()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(z.pid, signal.SIGKILL)
        z.ready_event.set()
        self._dead.append(z.popen)

    def reap(self) -> None:
        """Reap zygotes that were let go (on SIGCHLD, and before a new one)."""
        alive = []
        for popen in self._dead:
            if popen.poll() is None:
                alive.append(popen)
                continue
            if popen.stderr is not None:
                with contextlib.suppress(OSError):
                    popen.stderr.close()
            if self.guard is not None:
                self.guard.remove(popen.pid)
        self._dead = alive

    def drop(self) -> None:
        """Kill the zygote (no start will need it)."""
        z = self._z
        if z is not None and z.gone is None:
            self._discard(z, "no restart is possible")
        self._z = None

    async def close(self) -> None:
        """Kill the zygote and reap it (bounded)."""
        self._closed = True
        z = self._z
        if z is not None:
            if z.gone is None:
                z.gone = "closed"
            self._unwatch(z)
            with contextlib.suppress(OSError):
                z.sock.close()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(z.pid, signal.SIGKILL)
            self._dead.append(z.popen)
        self._z = None
        deadline = time.monotonic() + REAP_WAIT
        while self._dead and time.monotonic() < deadline:
            self.reap()
            if self._dead:
                await asyncio.sleep(0.01)


def _promote(pid: int) -> None:
    """Every thread of a zygote importing at idle priority back to normal
    (it went idle only because it may come back; best effort)."""
    if not hasattr(os, "SCHED_IDLE"):
        return
    with contextlib.suppress(OSError):
        if os.sched_getscheduler(pid) != os.SCHED_IDLE:
            return
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))
