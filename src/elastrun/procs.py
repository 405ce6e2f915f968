"""Small facts about processes, the same wherever they are asked.

* :func:`pid_alive`: whether a process still runs. A zombie (exited, not yet
  reaped) counts as dead: it runs no code and holds no resources but its pid.
* :func:`signal_name`: ``SIGTERM`` for 15, the number itself for an unknown one.
* :func:`say`: one line on this process's stderr (the operator's console),
  never raising when stderr is closed or broken.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys

from elastrun.untrusted import printable

__all__ = ["pid_alive", "say", "signal_name"]


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fp:
            stat = fp.read()
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ESRCH):
            return False
        return _exists(pid)  # no /proc to read: existence is all we can tell
    # The state is the first field after the command name, which may hold ")".
    fields = stat.rsplit(")", 1)[-1].split()
    return not fields or fields[0] not in ("Z", "X")


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def signal_name(signum: int) -> str:
    """``SIGKILL`` for 9, ``SIGRTMIN+5`` for a real-time signal; ``"99"``
    for a number that names no signal."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        pass
    rtmin, rtmax = int(signal.SIGRTMIN), int(signal.SIGRTMAX)
    if rtmin < signum < rtmax:
        return f"SIGRTMIN+{signum - rtmin}"
    return str(signum)


def say(msg: str) -> None:
    """Write ``msg`` as one line to stderr and flush (errors ignored). Control
    characters but newlines and tabs are escaped (``\\x1b``): a line may carry
    what another node or a worker wrote, and none of ours needs them."""
    msg = printable(msg, lines=True)
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(msg if msg.endswith("\n") else msg + "\n")
        sys.stderr.flush()
