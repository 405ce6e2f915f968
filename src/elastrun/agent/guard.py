"""No orphans, even of a SIGKILLed agent.

Each worker has ``PR_SET_PDEATHSIG=SIGKILL``, so the workers die with the
agent. Their own children do not: the parent-death signal is not inherited,
and nothing of the agent runs after a SIGKILL. So the agent starts, once, a
tiny guard process (``_guard_main.py``; stdlib only, no site, about 10 ms of
start-up that overlaps the rendezvous) in a session of its own, and tells it
over a pipe the process group of every worker it starts and reaps. Only the
agent holds the pipe's write end; when the agent dies, however it dies, the
guard reads end of file and SIGKILLs every listed process group and the
processes still in those sessions, then exits. On a normal exit the agent has
already cleaned up, so the guard finds nothing left to do.

The agent also tells the guard how to revoke its rendezvous lease (the
store's address, credentials and the lease id: :meth:`OrphanGuard.set_lease`),
and the guard, after killing the workers, revokes it: the other nodes see
this node gone at once instead of at the lease TTL (etcd ties leases to no
connection; the embedded store would wait its disconnect grace). On a normal
exit the agent has revoked it itself and told the guard so.

The agent may also name folders to remove when it dies
(:meth:`OrphanGuard.remove_when_gone`: its memory checkpoints in shared
memory, which nobody would free otherwise).

Worker start costs one small write to the pipe. If the guard cannot be
started, the agent warns and goes on (workers still have PDEATHSIG).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys

from elastrun.clock import SYSTEM_CLOCK
from elastrun.errors import WorkerError
from elastrun.rendezvous.api import RevokeSpec

__all__ = ["OrphanGuard"]

GUARD_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_guard_main.py")
EXIT_WAIT = 2.0


class OrphanGuard:
    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._fd: int | None = None
        self.error: WorkerError | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> bool:
        """Start the guard; False (and ``error`` set) if it cannot be started."""
        if self._proc is not None:
            return True
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-S", "-I", "-B", GUARD_SCRIPT],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # no terminal or process-group signal reaches it
                close_fds=True,
            )
        except OSError as e:
            self.error = WorkerError(f"cannot start the orphan guard: {e.strerror or e}")
            return False
        assert self._proc.stdin is not None
        self._fd = self._proc.stdin.fileno()
        os.set_blocking(self._fd, False)  # a stuck guard must never block the agent
        return True

    def add(self, pgid: int) -> None:
        """A worker leading process group (and session) ``pgid`` was started."""
        self._send(f"+{pgid}\n")

    def remove(self, pgid: int) -> None:
        """That worker's group was cleaned up (it may be reused by others)."""
        self._send(f"-{pgid}\n")

    def set_lease(self, spec: RevokeSpec | None) -> None:
        """Revoke this lease if the agent dies (a store's ``revoke_spec``);
        None: there is none to revoke."""
        line = "" if spec is None else json.dumps(spec.to_json(), separators=(",", ":"))
        self._send("L" + line + "\n")

    def remove_when_gone(self, path: str) -> None:
        """Remove the folder ``path`` (absolute) if the agent dies without
        doing so: the agent's memory checkpoints, in shared memory."""
        self._send("R" + json.dumps(path) + "\n")  # JSON: ASCII, whatever the path

    def _send(self, line: str) -> None:
        if self._fd is None:
            return
        try:
            os.write(self._fd, line.encode("ascii"))
        except (BlockingIOError, BrokenPipeError, OSError) as e:
            self.error = WorkerError(f"the orphan guard stopped listening: {e!r}")
            self._close_pipe()

    def _close_pipe(self) -> None:
        if self._proc is not None and self._proc.stdin is not None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()
        self._fd = None

    async def close(self) -> None:
        """Normal end: close the pipe; the guard exits; reap it (bounded)."""
        proc = self._proc
        if proc is None:
            return
        self._close_pipe()
        deadline = SYSTEM_CLOCK.monotonic() + EXIT_WAIT
        while proc.poll() is None and SYSTEM_CLOCK.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self._proc = None
