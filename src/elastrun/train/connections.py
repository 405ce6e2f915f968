"""Breaking a rank's TCP connections, the in-process restart's last resort
(docs/in_process.md, *What ends a blocked rank*).

Aborting a process group does not end every wait of a rank that must leave
its function: gloo's abort closes the rank's own connections (its peers'
collectives end) but a collective of the rank's own that waits on a peer
still alive keeps waiting, and nothing aborts a wait in the group's TCP store
(``init_process_group``'s rendezvous, a barrier of the script's own on the
store). A connection shut down under such a wait ends it at once: the read
returns end-of-file, and torch raises its transport's error (gloo's
"Connection closed by peer", the store's ``DistNetworkError``), which the
wrapper takes as a broken collective.

Which connections: the connected TCP sockets (IPv4 or IPv6) the process
opened since it entered the function (:func:`snapshot` at the entry, Linux's
``/proc/self/fd``): the round's process group and store, and any the script
itself opened inside the function. Sockets opened before the entry (the
script's setup, the runner's channel to the agent: a pipe or a Unix socket)
and listening sockets are left alone. A socket is shut down, never closed:
its file descriptor stays its owner's, who closes it (no descriptor is
reused under torch's threads). Elsewhere than Linux, :func:`snapshot` finds
nothing and :func:`shut_down` does nothing.
"""

from __future__ import annotations

import contextlib
import os
import socket

FD_DIR = "/proc/self/fd"
MAX_FDS = 1 << 16  # descriptors looked at, at most


def _sockets() -> dict[int, str]:
    """The process's sockets: descriptor -> its kernel name (``socket:[inode]``)."""
    found: dict[int, str] = {}
    try:
        names = os.listdir(FD_DIR)
    except OSError:
        return found
    for name in names[:MAX_FDS]:
        try:
            link = os.readlink(os.path.join(FD_DIR, name))
        except OSError:
            continue  # closed since
        if link.startswith("socket:[") and name.isdigit():
            found[int(name)] = link
    return found


def snapshot() -> frozenset[str]:
    """The sockets open now (their kernel names), to spare later."""
    return frozenset(_sockets().values())


def shut_down(spared: frozenset[str]) -> int:
    """Shut down every connected TCP socket not in ``spared``; how many."""
    count = 0
    for fd, link in _sockets().items():
        if link in spared:
            continue
        try:
            s = socket.socket(fileno=fd)
        except OSError:
            continue  # closed since, or not a socket any more
        try:
            if s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM:
                s.getpeername()  # a listening (or unconnected) socket raises: spared
                s.shutdown(socket.SHUT_RDWR)
                count += 1
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                s.detach()  # the descriptor stays open: its owner closes it
    return count
