"""One worker process, as the agent holds it: its handle, its output pumped
to the console and its log files, its exit watched, its channel, and what it
ended as (for the root-cause rule and the failure summary).

The group of a round's workers, and when each thing happens: agent/workers.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO

from elastrun.agent.channel import RunnerChannel
from elastrun.agent.children import ForkedProcess
from elastrun.agent.error_files import ErrorFileInfo, read_error_file
from elastrun.agent.failures import Ending, WorkerFailure
from elastrun.agent.logs import TAIL_LINES, LinePump, LogWriteErrors, StreamRoute
from elastrun.frozen import frozen

__all__ = ["Declared", "Process", "Worker", "exit_begun", "killpg"]

# The process handle of a worker: started cold, or forked and adopted.
Process = subprocess.Popen[bytes] | ForkedProcess


def killpg(pgid: int, sig: int) -> bool:
    """Signal a worker's process group; False when nothing is left in it."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


PF_EXITING = 0x4  # a task's flag from the first step of its exit (linux/sched.h)


def exit_begun(pid: int) -> bool:
    """Whether process ``pid`` has begun to end though the kernel does not
    report its exit yet: its main thread ending or gone (a zombie) while its
    other threads still end. A rank killed by a signal is seen so for a few
    milliseconds after its sockets closed: a peer's broken collective can
    reach the agent inside that window."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read(1024)
    except OSError:
        return False
    fields = stat[stat.rfind(b")") + 2 :].split()  # after "pid (comm) "
    if len(fields) < 7 or not fields[6].isdigit():
        return False
    return fields[0] in (b"Z", b"X") or bool(int(fields[6]) & PF_EXITING)


@frozen
class Declared:
    """A rank a feature declared failed while it ran: why (one line), when."""

    why: str
    monotonic: float
    wall: float


@dataclass
class Worker:
    """The worker of one local rank in one round."""

    local_rank: int
    rank: int
    folder: str  # its own folder of the attempt (private)
    error_file: str
    routes: tuple[StreamRoute, StreamRoute]  # where its stdout and stderr go
    popen: Process | None = None
    channel: RunnerChannel | None = None  # the agent's end of the runner's channel
    exited: asyncio.Future[int] | None = None
    exit_monotonic: float | None = None
    exit_wall: float | None = None
    stopped_by_agent: bool = False
    # Signals the agent sent it besides a stop (the stack signal): dying of one
    # is the agent's doing, never a root cause (failures.roles).
    agent_signals: set[int] = field(default_factory=set)
    declared: Declared | None = None
    # When its runner said the script failed (an uncaught exception, a
    # non-zero exit: the Failing message), by the agent's clocks: its failure
    # time, as its exit may come a while later (the interpreter's teardown).
    failing: tuple[float, float] | None = None  # monotonic, wall
    # When the agent found its exit begun (exit_begun) before the kernel
    # reported it: its exit time, by the agent's clocks.
    dying: tuple[float, float] | None = None  # monotonic, wall
    warm: bool = False  # forked by a feature (a warm start), not spawned
    pumps: list[LinePump] = field(default_factory=list)
    pump_tasks: list[asyncio.Task[None]] = field(default_factory=list)
    transports: list[asyncio.BaseTransport] = field(default_factory=list)
    pidfd: int | None = None
    # The order of its output lines across stdout and stderr (its pumps share it).
    lines: Iterator[int] = field(default_factory=itertools.count)
    # In-process restarts (agent/in_process.py): the round its process is in,
    # whether its script entered an in-process function, when it left it (and
    # why), and whether the next round takes it over.
    round: int = -1
    restartable: bool = False
    left: tuple[str, float] | None = None  # why, monotonic
    kept: bool = False
    taken_over: bool = False  # its process was kept from an earlier round (status shows it)
    # A standby's (agent/standby.py): the environment it started with, until it
    # is told its rank's; ``standby``: its process came from a standby in this
    # round (a later round that takes it over keeps it: ``taken_over``).
    standby_env: dict[str, str] | None = None
    standby: bool = False
    on_exit: Callable[[], None] = lambda: None  # its exit's callback (the group's)

    @property
    def pid(self) -> int:
        return self.popen.pid if self.popen is not None else -1

    @property
    def done(self) -> bool:
        return self.exited is not None and self.exited.done()

    @property
    def returncode(self) -> int | None:
        return self.exited.result() if self.done and self.exited is not None else None

    # ------------------------------------------------------------ watching
    def pump(self, loop: asyncio.AbstractEventLoop, log_errors: LogWriteErrors) -> None:
        """Read its stdout and stderr, line by line, to where they go."""
        assert self.popen is not None
        for pipe, route in zip((self.popen.stdout, self.popen.stderr), self.routes, strict=True):
            assert pipe is not None
            self._pump(loop, pipe, route, log_errors)

    def _pump(
        self,
        loop: asyncio.AbstractEventLoop,
        pipe: IO[bytes],
        route: StreamRoute,
        log_errors: LogWriteErrors,
    ) -> None:
        reader = asyncio.StreamReader(limit=1 << 20)
        protocol = asyncio.StreamReaderProtocol(reader)
        pump = LinePump(reader, route, log_errors, self.rank, self.local_rank, order=self.lines)
        self.pumps.append(pump)

        async def run() -> None:
            transport, _ = await loop.connect_read_pipe(lambda: protocol, pipe)
            self.transports.append(transport)
            await pump.run()

        self.pump_tasks.append(loop.create_task(run()))

    def watch_exit(self, loop: asyncio.AbstractEventLoop, on_exit: Callable[[], None]) -> None:
        """Call ``on_exit`` in ``loop`` when it may have exited: its pidfd
        readable (a waiting thread where pidfds are unavailable)."""
        assert self.popen is not None
        self.on_exit = on_exit
        on_exit = self._exit_seen  # a group that takes it over rebinds on_exit
        self.exited = loop.create_future()
        try:
            self.pidfd = os.pidfd_open(self.popen.pid)
        except (OSError, AttributeError):
            self.pidfd = None
        if self.pidfd is not None:
            loop.add_reader(self.pidfd, on_exit)
            return
        pid = self.popen.pid

        def wait_thread() -> None:  # fallback: kernels without pidfd
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(on_exit)

        threading.Thread(target=wait_thread, name=f"wait-{pid}", daemon=True).start()

    def _exit_seen(self) -> None:
        self.on_exit()

    def take_over(self, rank: int, round_: int) -> None:
        """A new round's group takes this kept process over (rank ``rank``):
        what it ended as in the last round is forgotten."""
        # A standby's process was never in a round before: served, not kept.
        # Once it was in a round (served then), a later round keeps it.
        self.standby = self.standby and self.round < 0
        self.rank, self.round, self.taken_over = rank, round_, not self.standby
        self.kept, self.left, self.declared, self.failing, self.dying = (
            False,
            None,
            None,
            None,
            None,
        )
        self.stopped_by_agent = False
        self.agent_signals = set()

    def reap(self, loop: asyncio.AbstractEventLoop, now: float) -> int | None:
        """Its exit status, the first time it is found exited (reaped, its
        pidfd released, ``exited`` set); None otherwise."""
        assert self.popen is not None and self.exited is not None
        rc = self.popen.poll()  # reaps (WNOHANG)
        if rc is None or self.exited.done():
            return None
        if self.pidfd is not None:
            loop.remove_reader(self.pidfd)
            os.close(self.pidfd)
            self.pidfd = None
        self.exit_monotonic = now
        self.exit_wall = time.time()
        self.exited.set_result(rc)
        return rc

    def release(self) -> None:
        """Close what the agent holds of it: its channel, output pipes and
        pumps, its pidfd."""
        if self.channel is not None:
            self.channel.close()
        for tr in self.transports:
            tr.close()
        for p in self.pumps:
            p.close()
        if self.pidfd is not None:
            with contextlib.suppress(OSError, ValueError, RuntimeError):
                asyncio.get_running_loop().remove_reader(self.pidfd)
            with contextlib.suppress(OSError):
                os.close(self.pidfd)
            self.pidfd = None
        if self.popen is not None:
            for pipe in (self.popen.stdout, self.popen.stderr):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()

    # ------------------------------------------------------------ its end
    def note_dying(self, monotonic: float) -> None:
        """Its exit timed now when it has begun (exit_begun), not reported yet."""
        if self.dying is None and not self.done and exit_begun(self.pid):
            self.dying = (monotonic, time.time())

    def failed_at(self) -> tuple[float | None, float | None]:
        """When it failed (monotonic, wall): declared, else when its runner
        said so (for a non-zero exit), else its exit (when it was first seen
        ending)."""
        if self.declared is not None:
            return self.declared.monotonic, self.declared.wall
        if self.failing is not None and self.returncode not in (None, 0):
            return self.failing
        if self.dying is not None:
            return self.dying
        return self.exit_monotonic, self.exit_wall

    def ending(self, now: float) -> Ending:
        """As the root-cause rule sees it."""
        declared = self.declared
        at = self.failed_at()[0]
        return Ending(
            self.returncode,
            now if at is None else at,
            stopped_by_agent=self.stopped_by_agent,
            declared=declared is not None,
            agent_signals=frozenset(self.agent_signals),
        )

    def failure(
        self, rc: int, *, host: str, attempt: int, restart_count: int, now: float
    ) -> WorkerFailure:
        """What it failed as, with exit status ``rc`` (unclassified)."""
        stdout_pump = self.pumps[0] if self.pumps else None
        stderr_pump = self.pumps[1] if len(self.pumps) > 1 else None
        error = read_error_file(self.error_file)
        declared = self.declared
        if declared is not None:
            # The declaration is the failure; a traceback written while it was
            # stopped (e.g. by @record) shows where it was stuck.
            error = ErrorFileInfo(
                message=declared.why,
                traceback=error.traceback if error is not None else None,
                timestamp=int(declared.wall),
            )
        at, wall = self.failed_at()
        return WorkerFailure(
            rank=self.rank,
            local_rank=self.local_rank,
            host=host,
            pid=self.pid,
            returncode=rc,
            exit_time=wall or time.time(),
            exit_monotonic=now if at is None else at,
            stopped_by_agent=self.ending(now).by_agent,
            error=error,
            stderr_tail=tuple(stderr_pump.tail) if stderr_pump else (),
            stdout_tail=tuple(stdout_pump.tail) if stdout_pump else (),
            output_tail=last_output(stdout_pump, stderr_pump),
            stdout_log=self.routes[0].file_path,
            stderr_log=self.routes[1].file_path,
            error_file=self.error_file,
            attempt=attempt,
            restart_count=restart_count,
            hang=declared.why if declared else None,
        )


def last_output(*pumps: LinePump | None) -> tuple[str, ...]:
    """The last lines a worker wrote, stdout and stderr together, in the
    order they reached the agent."""
    lines = [
        (n, line)
        for pump in pumps
        if pump is not None
        for n, line in zip(pump.tail_order, pump.tail, strict=False)
    ]
    return tuple(line for _, line in sorted(lines)[-TAIL_LINES:])
