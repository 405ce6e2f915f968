"""Workers forked by the warm interpreter, made the agent's own children.

A worker forked from the zygote (``worker/_zygote.py``) would be the
zygote's child. The agent makes itself a *child subreaper*
(``PR_SET_CHILD_SUBREAPER``) and the zygote forks each worker through an
intermediate process that exits at once, so the worker is re-parented to the
agent: the agent waits for it, reads its exit status and kills it exactly as
it does a worker it started itself (:class:`ForkedProcess` is the
``subprocess.Popen`` stand-in for such a worker).

Being a subreaper has one more effect: every orphaned descendant of a worker
(say a data-loader process whose worker was killed) is re-parented to the
agent too, not to init. :class:`Reaper` reaps those: on ``SIGCHLD`` it waits
for every zombie child that lives in the session of a worker this agent
started (the worker itself is waited for by its own handle). Children of
other sessions (the agent's own helpers, or the children of a program that
embeds the agent through the Python API) are never touched.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import OrderedDict
from typing import IO

from elastrun.agent.spawn import PRCTL
from elastrun.errors import WorkerError

__all__ = ["ForkedProcess", "Reaper", "children_of_self"]

PR_SET_CHILD_SUBREAPER = 36
MAX_SESSIONS = 4096  # worker sessions remembered for reaping (oldest forgotten first)


def _decode(status: int) -> int:
    """A wait status as ``subprocess`` reports it (negative: killed by a signal)."""
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.waitstatus_to_exitcode(status)


class ForkedProcess:
    """A worker the agent adopted: the part of ``subprocess.Popen`` the agent uses."""

    def __init__(self, pid: int, stdout: IO[bytes], stderr: IO[bytes]) -> None:
        self.pid = pid
        self.stdout: IO[bytes] | None = stdout
        self.stderr: IO[bytes] | None = stderr
        self.stdin: IO[bytes] | None = None
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = -9  # reaped elsewhere: its status is lost
                return self.returncode
            if pid == self.pid:
                self.returncode = _decode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"pid {self.pid} still running after {timeout} s")
            time.sleep(0.005)
        assert self.returncode is not None
        return self.returncode

    def __repr__(self) -> str:
        return f"ForkedProcess(pid={self.pid}, returncode={self.returncode})"


def children_of_self() -> list[int]:
    """The pids of this process's children (all its threads')."""
    out: list[int] = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tasks:
        path = f"/proc/self/task/{tid}/children"
        with contextlib.suppress(OSError, ValueError), open(path, encoding="ascii") as fp:
            out.extend(int(p) for p in fp.read().split())
    return out


def _state_and_session(pid: int) -> tuple[str, int] | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fp:
            fields = fp.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    try:
        return fields[0], int(fields[3])  # state, session
    except (IndexError, ValueError):
        return None


class Reaper:
    """The agent as child subreaper, and the reaping of strays from worker sessions."""

    def __init__(self) -> None:
        self.enabled = False
        self.error: WorkerError | None = None
        self._sessions: OrderedDict[int, None] = OrderedDict()
        self.reaped = 0

    def enable(self) -> bool:
        """Become a child subreaper; False (and ``error``) where the kernel refuses."""
        if self.enabled:
            return True
        if not _set_subreaper(1):
            self.error = WorkerError(
                "cannot become a child subreaper (prctl PR_SET_CHILD_SUBREAPER)"
            )
            return False
        self.enabled = True
        return True

    def disable(self) -> None:
        if self.enabled:
            _set_subreaper(0)
            self.enabled = False

    def watch_session(self, sid: int) -> None:
        """Strays of worker session ``sid`` are ours to reap."""
        self._sessions[sid] = None
        self._sessions.move_to_end(sid)
        while len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)

    def reap(self) -> int:
        """Reap every zombie child of a worker session but the workers
        themselves; returns how many."""
        n = 0
        for pid in children_of_self():
            if pid in self._sessions:
                continue  # a worker: its handle waits for it
            info = _state_and_session(pid)
            if info is None or info[0] != "Z" or info[1] not in self._sessions:
                continue
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    n += 1
        self.reaped += n
        return n


def _set_subreaper(on: int) -> bool:
    prctl = PRCTL
    return prctl is not None and int(prctl(PR_SET_CHILD_SUBREAPER, on, 0, 0, 0)) == 0
