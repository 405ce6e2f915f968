"""Connect to rank 0's store the moment it listens (stdlib only).

``init_process_group()`` with ``env://`` (or ``tcp://``) has rank 0 start
torch's TCPStore on ``MASTER_ADDR:MASTER_PORT`` and every other rank connect
to it. A rank whose first connection is refused (rank 0 is still starting,
as after every restart, where all ranks start at the same moment) waits
torch's connect backoff before it tries again: 0.5-1 s measured with torch
2.13, whatever the moment rank 0 starts listening a few milliseconds later.
After a restart that is most of the time until training resumes.

:func:`install` wraps ``torch.distributed.rendezvous._create_c10d_store``
(the function both handlers call) so that a rank other than 0 first polls the
address with plain TCP connections, every ``POLL`` seconds, until one is
accepted or the store's own timeout passes, then creates its store as torch
would, with the rest of the timeout. Nothing else changes: the same store,
the same errors, within the same total timeout. Each accepted probe is
closed at once without a byte sent; torch's server drops such a connection.

This file imports only the standard library, so a runner that runs as a
script (not from the ``elastrun`` package) can load it by path.
"""

from __future__ import annotations

import datetime
import functools
import socket
import time
import types
from typing import Any

__all__ = ["POLL", "install", "wait_listening"]

POLL = 0.01  # s between two connection attempts while nothing listens
CONNECT_TIMEOUT = 1.0  # s one attempt may take (a remote host that does not answer)


def wait_listening(host: str, port: int, timeout: float) -> bool:
    """Whether ``host:port`` accepted a TCP connection within ``timeout`` s."""
    deadline = time.monotonic() + max(0.0, timeout)
    while True:
        attempt = max(0.01, min(CONNECT_TIMEOUT, deadline - time.monotonic()))
        try:
            with socket.create_connection((host, port), timeout=attempt):
                return True
        except OSError:
            pass
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(POLL, left))


def install(rendezvous: types.ModuleType) -> None:
    """Wrap ``rendezvous._create_c10d_store`` (once; nothing if absent)."""
    real = getattr(rendezvous, "_create_c10d_store", None)
    if real is None or getattr(real, "_elastrun_wait", False):
        return

    @functools.wraps(real)
    def _create_c10d_store(
        hostname: str, port: int, rank: int, world_size: int, timeout: Any, *args: Any, **kw: Any
    ) -> Any:
        waits = isinstance(rank, int) and rank != 0 and isinstance(port, int)
        if waits and isinstance(timeout, datetime.timedelta):
            start = time.monotonic()
            wait_listening(hostname, port, timeout.total_seconds())
            spent = datetime.timedelta(seconds=time.monotonic() - start)
            timeout = max(timeout - spent, datetime.timedelta(seconds=1))
        return real(hostname, port, rank, world_size, timeout, *args, **kw)

    _create_c10d_store._elastrun_wait = True  # type: ignore[attr-defined]
    rendezvous._create_c10d_store = _create_c10d_store  # type: ignore[attr-defined]
