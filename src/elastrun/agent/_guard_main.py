"""The orphan guard's process (stdlib only; run as ``python -S -I -B <this file>``).

It reads lines from stdin, whose write end only the agent holds::

    +<pgid>   a worker was started: it leads process group and session <pgid>
    -<pgid>   that worker is gone and its group was cleaned up

End of file means the agent is gone. The kernel closes the agent's descriptors
however it dies, SIGKILL included, so this runs exactly when nobody else can
clean up: every process group still listed is SIGKILLed, and so is every
process still in one of those sessions (children that moved to a process
group of their own). Only descendants that started a new session (daemons)
escape. Then the guard exits.
"""

from __future__ import annotations

import os
import signal
import sys
import time

KILL_FOR = 3.0  # keep killing (new forks) for at most this long


def _sessions_members(sids: set[int]) -> list[int]:
    out: list[int] = []
    me = os.getpid()
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        pid = int(name)
        if pid == me:
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fp:
                stat = fp.read()
        except OSError:
            continue
        fields = stat.rsplit(b")", 1)[-1].split()
        # fields: state ppid pgrp session ...
        if len(fields) > 3 and fields[0] not in (b"Z", b"X") and int(fields[3]) in sids:
            out.append(pid)
    return out


def kill_all(pgids: set[int]) -> None:
    deadline = time.monotonic() + KILL_FOR
    while pgids and time.monotonic() < deadline:
        live: set[int] = set()
        for pgid in pgids:
            try:
                os.killpg(pgid, signal.SIGKILL)
                live.add(pgid)
            except (ProcessLookupError, PermissionError):
                pass
        strays = _sessions_members(pgids)
        for pid in strays:
            try:  # noqa: SIM105 - no contextlib: keep the guard's start-up minimal
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if not live and not strays:
            return
        time.sleep(0.02)


def main() -> int:
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    pgids: set[int] = set()
    buf = b""
    while True:
        try:
            data = os.read(0, 65536)
        except InterruptedError:
            continue
        except OSError:
            data = b""
        if not data:
            break
        buf += data
        *lines, buf = buf.split(b"\n")
        for line in lines:
            try:
                pgid = int(line[1:])
            except ValueError:
                continue
            if pgid <= 1:
                continue
            if line[:1] == b"+":
                pgids.add(pgid)
            elif line[:1] == b"-":
                pgids.discard(pgid)
    kill_all(pgids)
    return 0


if __name__ == "__main__":
    sys.exit(main())
