"""torch.distributed.elastic.timer's file timers, served by the agent.

A script that guards a block with torch's expiration timers::

    timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
    with timer.expires(after=60, scope="step"):
        train_step()

sends requests to a named pipe (the server side of torch's
``FileTimerServer`` protocol, read from torch's
``torch/distributed/elastic/timer/file_based_local_timer.py``): one JSON line
per request, at most ``PIPE_BUF`` bytes, written atomically by a client that
opens the pipe, writes and closes::

    {"version": 1, "pid": 4242, "scope_id": "step", "expiration_time": 1700000060.5,
     "signal": 9}

(an ``expiration_time`` below 0 releases the scope). torch's agent serves
them when ``TORCHELASTIC_ENABLE_FILE_TIMER=1`` and gives the workers the
pipe's path as ``TORCHELASTIC_TIMER_FILE``; so does this one, also when only
``TORCHELASTIC_TIMER_FILE`` is set (its workers would otherwise fail to open
it). A process whose timer expires gets the timer's signal, as under
torchrun, and its worker is declared failed (:meth:`WorkerGroup.declare`):
the root cause, named in the summary (``rank 1: timer 'step' expired``); the
group is stopped and restarted as for any failure. torchrun also kills its
own agent with that signal; elastrun's agent goes on, so the other ranks are
stopped and restarted, never orphaned.

A timer is for the process that asks for it (torch's client sends its own
pid). A pipe cannot tell who wrote to it, so each worker gets a pipe of its
own (``PATH.{local_rank}``, PATH the ``TORCHELASTIC_TIMER_FILE`` given, else
``timer.fifo`` in a private folder), and a request read from a worker's pipe
is held (or released) only when its pid is one of that worker's own
processes: its process group, the worker and the children it starts. A rank
that names a sibling's pid (torch's server would kill any pid it is sent)
is refused. The limit: a process of the same user that finds a sibling's
pipe (in its environment, ``/proc/PID/environ``) can write to it; such a
process could as well signal the sibling itself.

What a stranger can make the agent hold is bounded: the pipes are created
mode 0600 in a private folder (or at the paths given: never a link, an
existing FIFO of another user, or a file of another kind), two descriptors
each (one per local rank), read without blocking in bounded chunks; a line
longer than ``MAX_LINE`` bytes is dropped, every request is decoded within
bounds (``elastrun.untrusted``) and checked field by field; at most
``MAX_TIMERS`` timers in all.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import tempfile
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from elastrun.agent.hooks import Core, Feature
from elastrun.agent.round_hooks import RoundHooks
from elastrun.agent.spec import FileTimerSettings
from elastrun.event_kinds import (
    FileTimerExpired,
    FileTimerRefused,
    FileTimersFailed,
    FileTimersStarted,
)
from elastrun.fields import Fields
from elastrun.frozen import frozen
from elastrun.procs import signal_name
from elastrun.untrusted import loads, printable

if TYPE_CHECKING:
    from elastrun.agent.process import Worker
    from elastrun.agent.workers import WorkerGroup

__all__ = [
    "ENABLE_ENV",
    "TIMER_FILE_ENV",
    "FileTimers",
    "TimerRequest",
    "TimerTable",
    "features",
    "parse_request",
    "settings_from",
]

ENABLE_ENV = "TORCHELASTIC_ENABLE_FILE_TIMER"
TIMER_FILE_ENV = "TORCHELASTIC_TIMER_FILE"
MAX_LINE = 8192  # a request is at most PIPE_BUF (4096) bytes; longer lines are dropped
MAX_READ = 1 << 20  # bytes read per wake-up (the rest waits for the next)
MAX_TIMERS = 4096  # timers held at once, all processes together
MAX_SCOPE = 1024  # characters of a scope id


@frozen
class TimerRequest:
    """One request of torch's FileTimerClient (``expiration_time`` < 0: a release)."""

    pid: int
    scope_id: str
    expiration_time: float
    signal: int

    @property
    def release(self) -> bool:
        return self.expiration_time < 0


def parse_request(line: bytes) -> TimerRequest | None:
    """The request in one line of the pipe; None when it is none."""
    try:  # UntrustedData is a ValueError too
        raw = loads(line, max_bytes=MAX_LINE, what="a timer request")
        f = Fields.versioned(raw, 1, "a timer request", key="version")
        return TimerRequest(
            pid=f.integer("pid", low=1),
            scope_id=f.text("scope_id", MAX_SCOPE),
            expiration_time=f.number("expiration_time", low=None, high=None),
            signal=f.integer("signal", high=64),
        )
    except ValueError:
        return None


class TimerTable:
    """The timers held, by (pid, scope), as torch's server keeps them."""

    def __init__(self, limit: int = MAX_TIMERS) -> None:
        self.limit = limit
        self.timers: dict[tuple[int, str], TimerRequest] = {}
        self.refused = 0  # acquisitions past the limit

    def register(self, request: TimerRequest) -> None:
        key = (request.pid, request.scope_id)
        if request.release:
            self.timers.pop(key, None)
        elif key in self.timers or len(self.timers) < self.limit:
            self.timers[key] = request
        else:
            self.refused += 1

    def next_expiry(self) -> float | None:
        return min((r.expiration_time for r in self.timers.values()), default=None)

    def expired(self, now: float) -> dict[int, TimerRequest]:
        """Each process with an expired timer: its first expired one with a
        signal (torch's choice); processes whose expired timers have none keep
        them, unreaped, as under torch."""
        out: dict[int, TimerRequest] = {}
        for r in sorted(self.timers.values(), key=lambda r: r.expiration_time):
            if r.expiration_time <= now and r.signal > 0 and r.pid not in out:
                out[r.pid] = r
        return out

    def clear(self, pids: set[int]) -> None:
        for key in [k for k in self.timers if k[0] in pids]:
            del self.timers[key]


def settings_from(env: Mapping[str, str]) -> FileTimerSettings:
    """What the launcher's environment (and the spec's ``env``) asks for."""
    return FileTimerSettings(
        enabled=env.get(ENABLE_ENV) == "1" or bool(env.get(TIMER_FILE_ENV)),
        path=env.get(TIMER_FILE_ENV) or "",
    )


class _Pipe:
    """One worker slot's named pipe (its local rank's), and what was read of
    a line not yet whole."""

    def __init__(self, local_rank: int, path: str, fds: tuple[int, int]) -> None:
        self.local_rank = local_rank
        self.path = path
        self.fds = fds
        self.partial = b""
        self.dropping = False


class FileTimers(Feature):
    """The agent's timer server (see the module doc)."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.path = core.spec.file_timers.path  # the pipes' prefix: PATH.{local_rank}
        self.table = TimerTable()
        self.group: WorkerGroup | None = None
        self.pipes: dict[int, _Pipe] = {}  # by local rank
        self._folder: str | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._strangers = 0

    # ------------------------------------------------------------ the pipes
    def start(self) -> None:
        try:
            if not self.path:
                self._folder = tempfile.mkdtemp(prefix="elastrun-timers-")
                self.path = os.path.join(self._folder, "timer.fifo")
            else:
                self.path = os.path.abspath(self.path)
            for local_rank in range(self.core.spec.nproc):
                self._open(local_rank)
        except OSError as e:
            self.core.say(
                f"elastrun: warning: the file timer server cannot use {self.path}: "
                f"{e.strerror or e}; workers that use torch's FileTimerClient will fail"
            )
            self.core.events.emit(FileTimersFailed(path=self.path, error=str(e)))
            self._close_pipes()
            return
        self.core.events.emit(FileTimersStarted(path=self.path, pipes=len(self.pipes)))

    def pipe_path(self, local_rank: int) -> str:
        """The named pipe of the worker at ``local_rank``."""
        return f"{self.path}.{local_rank}"

    def _open(self, local_rank: int) -> None:
        path = self.pipe_path(local_rank)
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(path)
            if not stat.S_ISFIFO(st.st_mode) or st.st_uid != os.geteuid():
                raise OSError(0, f"{path} exists and is not a named pipe of this user")
            os.unlink(path)  # as torch: a fresh pipe
        os.mkfifo(path, 0o600)
        rd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        try:
            # Our own writer keeps the pipe open between clients (no end of file).
            wr = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        except OSError:
            os.close(rd)
            raise
        pipe = _Pipe(local_rank, path, (rd, wr))
        self.pipes[local_rank] = pipe
        asyncio.get_running_loop().add_reader(rd, self._readable, pipe)

    def _readable(self, pipe: _Pipe) -> None:
        got = 0
        while got < MAX_READ:
            try:
                data = os.read(pipe.fds[0], 65536)
            except BlockingIOError:
                break
            except OSError:
                return
            if not data:
                break
            got += len(data)
            self._take(pipe, data)
        self._arm()

    def _take(self, pipe: _Pipe, data: bytes) -> None:
        *lines, rest = (pipe.partial + data).split(b"\n")
        for line in lines:
            if pipe.dropping:
                pipe.dropping = False  # the end of a line too long: dropped
                continue
            request = parse_request(line)
            if request is not None:
                self._register(request, pipe.local_rank)
        pipe.partial = rest
        if len(rest) > MAX_LINE:
            pipe.partial, pipe.dropping = b"", True

    def _register(self, request: TimerRequest, local_rank: int) -> None:
        """Hold ``request``, read from ``local_rank``'s pipe, when its pid is
        one of that worker's own processes (its process group)."""
        w = self._worker_of(request.pid)
        if w is None or w.local_rank != local_rank:
            self._strangers += 1
            if self._strangers == 1:
                self.core.events.emit(FileTimerRefused(pid=request.pid, local_rank=local_rank))
            return
        self.table.register(request)

    def _worker_of(self, pid: int) -> Worker | None:
        """The worker whose process group ``pid`` is in (None: not ours)."""
        if self.group is None:
            return None
        try:
            pgid = os.getpgid(pid)
        except OSError:
            return None
        for w in self.group.workers:
            if w.popen is not None and not w.done and w.pid == pgid:
                return w
        return None

    # ------------------------------------------------------------ expiry
    def _arm(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        when = self.table.next_expiry()
        if when is not None:
            delay = max(0.0, when - time.time())
            self._handle = asyncio.get_running_loop().call_later(delay, self._expire)

    def _expire(self) -> None:
        self._handle = None
        gone: set[int] = set()
        for pid, request in self.table.expired(time.time()).items():
            gone.add(pid)
            w = self._worker_of(pid)
            if w is None or self.group is None:
                continue
            why = (
                f"rank {w.rank}: timer {printable(request.scope_id, limit=200)!r} expired "
                f"(torch.distributed.elastic.timer), stopped with {signal_name(request.signal)}"
            )
            self.group.declare(w, why)
            self.core.events.emit(
                FileTimerExpired(
                    rank=w.rank,
                    local_rank=w.local_rank,
                    pid=pid,
                    scope=request.scope_id,
                    signal=signal_name(request.signal),
                )
            )
            with contextlib.suppress(OSError):
                os.kill(pid, request.signal)
        self.table.clear(gone)
        self._arm()

    # ------------------------------------------------------------ rounds
    def round(self, group: WorkerGroup) -> RoundHooks | None:
        if not self.pipes:
            return None
        self.group = group
        self.table.clear({pid for pid, _ in self.table.timers})
        return _RoundTimers(self)

    def _close_pipes(self) -> None:
        for pipe in self.pipes.values():
            with contextlib.suppress(ValueError, RuntimeError):
                asyncio.get_running_loop().remove_reader(pipe.fds[0])
            for fd in pipe.fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(pipe.path)
        self.pipes = {}
        if self._folder is not None:
            with contextlib.suppress(OSError):
                os.rmdir(self._folder)

    async def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._close_pipes()


class _RoundTimers(RoundHooks):
    def __init__(self, server: FileTimers) -> None:
        self.server = server

    def worker_env(self, worker: Worker) -> Mapping[str, str]:
        return {TIMER_FILE_ENV: self.server.pipe_path(worker.local_rank)}

    def exited(self, worker: Worker) -> None:
        self.server.table.clear({worker.pid})

    async def ended(self) -> None:
        server = self.server
        server.table.clear({pid for pid, _ in server.table.timers})
        server.group = None


def features(core: Core) -> list[Feature]:
    """The timer server, when the launcher's environment asks for it."""
    return [FileTimers(core)] if core.spec.file_timers.enabled else []
