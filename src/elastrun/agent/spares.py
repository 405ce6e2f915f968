"""Warm spares: workers skip Python start and ``import torch``.

A worker start costs an interpreter, ``import torch`` (1-2 s on a fast disk,
far more on a shared filesystem), then the process group; every restart pays
it again. The agent keeps one *spare* per local rank instead: an interpreter
started from ``elastrun/worker/_spare.py`` with the worker's interpreter,
flags, working directory, command line and environment, which imports torch
and waits. The first spares start with the agent, so the import overlaps the
rendezvous; after each start, new ones are kept while a restart is possible.
Starting a round's workers hands each spare its environment and arguments
over a socket (JSON, one line); it runs the script as ``python -u script``
would. A spare that has died or was started with an environment that differs
from the worker's in anything but the per-round variables (``ROUND_VARS``) is
killed and the worker is started cold: a spare can only save time, never
change what runs. A spare still importing is kept for a later start while the
worker starts cold, except for a restart of a script that imports the
preloaded modules itself (its source says so): there it is used all the same,
raised to normal priority, as a head start. (On a first start, a script that
fails early, say on a mistyped argument, must fail at once, not after
``import torch``.)

Spares preload at idle CPU priority where the spare may return to normal
priority afterwards (root or ``CAP_SYS_NICE``), otherwise after a delay, so
they do not slow the workers' own start. They are the agent's children like
workers: own session, ``PR_SET_PDEATHSIG``, registered with the orphan guard,
killed when the agent ends. Only Python commands built by the launcher (a
script or ``-m`` module, not ``--no-python`` or ``--run-path``) get spares
(``WorkerSpec.prewarm``).
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from elastrun.agent.env import ROUND_ENV_VARS, stable_env
from elastrun.agent.guard import OrphanGuard
from elastrun.agent.spec import WorkerSpec, argv_for
from elastrun.agent.watchdog import HEARTBEAT_ENV, HEARTBEAT_INTERVAL_ENV, heartbeat_interval
from elastrun.agent.workers import preexec_for
from elastrun.events import EventSink

__all__ = ["ROUND_VARS", "SPARE_SCRIPT", "PythonEntry", "SparePool", "compatible", "python_entry"]

SPARE_SCRIPT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "worker", "_spare.py"
)
PROTOCOL = 1
PRELOAD_ENV = "ELASTRUN_SPARE_PRELOAD"  # read (and removed) by worker/_spare.py
DELAY_ENV = "ELASTRUN_SPARE_DELAY"
PRELOAD = ("torch",)
UNPRIVILEGED_DELAY = 3.0  # s: without idle priority, let the workers import first
REAP_WAIT = 2.0

# Worker variables that change from round to round; everything else in a
# worker's environment must be what the spare was started with.
ROUND_VARS = frozenset((*ROUND_ENV_VARS, HEARTBEAT_ENV))


@dataclass(frozen=True)
class PythonEntry:
    """A worker argv split as ``prefix + [target] + args`` (script) or
    ``prefix + ["-m", target] + args`` (module)."""

    prefix: tuple[str, ...]
    kind: str  # "script" | "module"
    target: str
    args: tuple[str, ...]


def python_entry(argv: Sequence[str]) -> PythonEntry | None:
    """The launcher's Python argv shapes: ``python -u [-m] target args``."""
    if len(argv) < 3 or argv[1] != "-u":
        return None
    if argv[2] == "-m":
        if len(argv) < 4:
            return None
        return PythonEntry(tuple(argv[:2]), "module", argv[3], tuple(argv[4:]))
    if argv[2].startswith("-"):
        return None
    return PythonEntry(tuple(argv[:2]), "script", argv[2], tuple(argv[3:]))


def entry_file(entry: PythonEntry) -> str | None:
    """The source file the worker runs first: the script, or for ``-m`` the
    module's file under the working directory (None when not found there; the
    agent never imports user code to find it)."""
    if entry.kind == "script":
        return entry.target
    base = os.path.join(os.getcwd(), *entry.target.split("."))
    for path in (base + ".py", os.path.join(base, "__main__.py")):
        if os.path.isfile(path):
            return path
    return None


def imports_any(path: str | None, modules: Sequence[str]) -> bool:
    """Whether the Python source at ``path`` imports one of ``modules`` (or a
    submodule) anywhere in it; False when it cannot be read or parsed."""
    if path is None or not modules:
        return False
    try:
        with open(path, "rb") as fp:
            tree = ast.parse(fp.read(), path)
    except (OSError, SyntaxError, ValueError):
        return False
    roots = set(modules)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        if any(name.split(".")[0] in roots for name in names):
            return True
    return False


def compatible(started: Mapping[str, str], wanted: Mapping[str, str]) -> str | None:
    """None if a spare started with ``started`` may become a worker with
    ``wanted``; otherwise the first variable that differs."""
    for key in sorted(set(started) | set(wanted)):
        if key not in ROUND_VARS and started.get(key) != wanted.get(key):
            return key
    return None


@dataclass
class _Spare:
    local_rank: int
    popen: subprocess.Popen[bytes]
    sock: socket.socket
    env: dict[str, str]
    ready: bool = False
    started: float = 0.0
    unwatch: Callable[[], object] | None = None

    def close_socket(self) -> None:
        if self.unwatch is not None:
            with contextlib.suppress(OSError, ValueError):
                self.unwatch()
            self.unwatch = None
        with contextlib.suppress(OSError):
            self.sock.close()

    def poll_ready(self) -> bool:
        if not self.ready:
            with contextlib.suppress(BlockingIOError, InterruptedError, OSError):
                data = self.sock.recv(4096)
                self.ready = b'"ready": true' in data
        return self.ready


class SparePool:
    """One warm spare per local rank, across rounds."""

    def __init__(
        self,
        spec: WorkerSpec,
        entry: PythonEntry,
        events: EventSink,
        guard: OrphanGuard | None = None,
        preload: Sequence[str] = PRELOAD,
    ) -> None:
        self.spec = spec
        self.entry = entry
        self.events = events
        self.guard = guard
        self.preload = tuple(preload)
        # A spare still importing is a head start only for a worker that
        # imports the same: a script that never imports torch would wait for it.
        self.head_start = not self.preload or imports_any(entry_file(entry), self.preload)
        self._spares: dict[int, _Spare] = {}
        self._dead: list[subprocess.Popen[bytes]] = []
        self._closed = False

    @property
    def pids(self) -> list[int]:
        return [s.popen.pid for s in self._spares.values()]

    def first_envs(self, max_restarts: int) -> dict[int, dict[str, str]]:
        """Environments for spares started before the first round: the stable
        part of each worker's environment (the round's part comes with the
        order). ``max_restarts`` as this node's settings say; should the job's
        differ, the spare is discarded at hand-over."""
        envs = {}
        for lr in range(self.spec.nproc):
            env = stable_env(self.spec, lr, self.spec.run_id, max_restarts)
            if self.spec.hang_timeout is not None:
                env[HEARTBEAT_INTERVAL_ENV] = repr(heartbeat_interval(self.spec.hang_timeout))
            envs[lr] = env
        return envs

    # ------------------------------------------------------------ spawning
    def replenish(self, envs: Mapping[int, Mapping[str, str]]) -> None:
        """Start a spare for every local rank in ``envs`` that has none."""
        if self._closed:
            return
        self._reap()
        for lr, env in sorted(envs.items()):
            if lr not in self._spares:
                spare = self._spawn(lr, dict(env))
                if spare is not None:
                    self._spares[lr] = spare

    def _spawn(self, local_rank: int, env: dict[str, str]) -> _Spare | None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        entry = self.entry
        command = ["-m", entry.target] if entry.kind == "module" else [entry.target]
        argv = [*entry.prefix, SPARE_SCRIPT, *command, *argv_for(entry.args, local_rank)]
        spare_env = {
            **env,
            PRELOAD_ENV: ",".join(self.preload),
            DELAY_ENV: repr(UNPRIVILEGED_DELAY),
        }
        try:
            popen = subprocess.Popen(
                argv,
                env=spare_env,
                stdin=theirs.fileno(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                preexec_fn=preexec_for(os.getpid()),  # noqa: PLW1509 - a pre-resolved prctl
                close_fds=True,
            )
        except OSError as e:
            ours.close()
            self.events.emit("spare_failed", local_rank=local_rank, reason=str(e))
            return None
        finally:
            theirs.close()
        ours.setblocking(False)
        if self.guard is not None:
            self.guard.add(popen.pid)
        self.events.emit("spare_started", local_rank=local_rank, pid=popen.pid)
        spare = _Spare(local_rank, popen, ours, env, started=time.monotonic())
        self._watch_ready(spare)
        return spare

    def _watch_ready(self, spare: _Spare) -> None:
        """Note (and report) the spare's "ready" as it arrives, where a loop runs."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop: take() reads it when needed

        def on_readable() -> None:
            loop.remove_reader(spare.sock.fileno())
            if spare.poll_ready():
                self.events.emit(
                    "spare_ready",
                    local_rank=spare.local_rank,
                    pid=spare.popen.pid,
                    preload_s=round(time.monotonic() - spare.started, 3),
                )

        loop.add_reader(spare.sock.fileno(), on_readable)
        spare.unwatch = lambda: loop.remove_reader(spare.sock.fileno())

    # ------------------------------------------------------------ using
    def take(
        self, local_rank: int, env: Mapping[str, str], *, restart: bool = True
    ) -> subprocess.Popen[bytes] | None:
        """The spare of ``local_rank`` turned into the worker with ``env``, or
        None (the caller starts the worker cold). A spare still importing is
        used only for a restart of a worker that imports those modules itself
        (``head_start``); otherwise it is left alone, kept for a later start."""
        spare = self._spares.get(local_rank)
        if spare is None:
            return None
        unready_ok = restart and self.head_start
        if not unready_ok and spare.popen.poll() is None and not spare.poll_ready():
            return None
        del self._spares[local_rank]
        why = self._unusable(spare, env)
        ready = spare.poll_ready()
        if why is None and not ready:
            # Still importing: it has a head start on a cold worker, so use it,
            # at normal priority from now on (it reads the order once done).
            _promote(spare.popen.pid)
        if why is None:
            order = {"v": PROTOCOL, "env": dict(env), "args": argv_for(self.entry.args, local_rank)}
            try:
                spare.sock.setblocking(True)
                spare.sock.settimeout(1.0)
                spare.sock.sendall(json.dumps(order).encode() + b"\n")
            except OSError as e:
                why = f"cannot hand over: {e}"
        if why is not None:
            self.events.emit(
                "spare_discarded", local_rank=local_rank, pid=spare.popen.pid, reason=why
            )
            self._discard(spare)
            return None
        spare.close_socket()
        self.events.emit(
            "spare_used",
            local_rank=local_rank,
            pid=spare.popen.pid,
            warm_s=round(time.monotonic() - spare.started, 3),
            ready=ready,
        )
        return spare.popen

    def _unusable(self, spare: _Spare, env: Mapping[str, str]) -> str | None:
        rc = spare.popen.poll()
        if rc is not None:
            return f"exited with {rc} before it was needed: {_tail(spare.popen)}"
        differs = compatible(spare.env, env)
        if differs is not None:
            return f"started with a different {differs}"
        return None

    # ------------------------------------------------------------ ending
    def _discard(self, spare: _Spare) -> None:
        spare.close_socket()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(spare.popen.pid, signal.SIGKILL)
        self._dead.append(spare.popen)

    def _reap(self) -> None:
        alive = []
        for popen in self._dead:
            if popen.poll() is None:
                alive.append(popen)
                continue
            for pipe in (popen.stdout, popen.stderr):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()
            if self.guard is not None:
                self.guard.remove(popen.pid)
        self._dead = alive

    def drop(self) -> None:
        """Kill the spares kept (no start will need them)."""
        for spare in list(self._spares.values()):
            self.events.emit(
                "spare_discarded",
                local_rank=spare.local_rank,
                pid=spare.popen.pid,
                reason="no restart is possible",
            )
            self._discard(spare)
        self._spares.clear()

    async def close(self) -> None:
        """Kill every spare and reap them (bounded)."""
        self._closed = True
        for spare in list(self._spares.values()):
            self._discard(spare)
        self._spares.clear()
        deadline = time.monotonic() + REAP_WAIT
        while self._dead and time.monotonic() < deadline:
            self._reap()
            if self._dead:
                await asyncio.sleep(0.01)


def _promote(pid: int) -> None:
    """Every thread of a spare still preloading at idle priority back to normal
    (it went idle only because it may come back; best effort)."""
    if not hasattr(os, "SCHED_IDLE"):
        return
    with contextlib.suppress(OSError):
        if os.sched_getscheduler(pid) != os.SCHED_IDLE:
            return
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                os.sched_setscheduler(int(tid), os.SCHED_OTHER, os.sched_param(0))


def _tail(popen: subprocess.Popen[bytes]) -> str:
    """The last line a dead spare wrote to stderr (for the event)."""
    pipe = popen.stderr
    if pipe is None:
        return "no output"
    try:
        os.set_blocking(pipe.fileno(), False)
        data = pipe.read(8192) or b""
    except OSError:
        data = b""
    lines = data.decode(errors="replace").strip().splitlines()
    return lines[-1][:300] if lines else "no output"
