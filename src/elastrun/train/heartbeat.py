"""Progress heartbeat for the hang watchdog (``elastrun --hang-timeout``).

A training script calls :func:`heartbeat` once per step (or as often as it
likes). When the launcher sets ``ELASTRUN_HEARTBEAT_FILE`` for the worker, the
call overwrites that file, at most about once per second, with one line of
JSON::

    {"v": 1, "pid": 1234, "step": 42, "monotonic": 51234.125}

``monotonic`` is ``time.monotonic()`` of the worker: CLOCK_MONOTONIC, which on
Linux is shared by all processes of the machine, so the agent on the same node
compares it with its own ``time.monotonic()``. The file is replaced atomically
(temporary file + ``os.replace``), so a reader never sees a torn line. Without
the variable the call is a cheap no-op, so scripts can call it unconditionally.
"""

from __future__ import annotations

import json
import os
import threading
import time

__all__ = ["HEARTBEAT_ENV", "HEARTBEAT_INTERVAL_S", "HEARTBEAT_SCHEMA", "heartbeat"]

HEARTBEAT_ENV = "ELASTRUN_HEARTBEAT_FILE"
HEARTBEAT_SCHEMA = 1
HEARTBEAT_INTERVAL_S = 1.0
# The agent may ask for more frequent writes (a short --hang-timeout).
HEARTBEAT_INTERVAL_ENV = "ELASTRUN_HEARTBEAT_INTERVAL"

_lock = threading.Lock()
_path: str | None = None
_path_read = False
_last_write = -float("inf")
_interval = HEARTBEAT_INTERVAL_S


def _target() -> str | None:
    global _path, _path_read, _interval
    if not _path_read:
        _path = os.environ.get(HEARTBEAT_ENV) or None
        try:
            _interval = min(HEARTBEAT_INTERVAL_S, float(os.environ[HEARTBEAT_INTERVAL_ENV]))
        except (KeyError, ValueError):
            _interval = HEARTBEAT_INTERVAL_S
        _path_read = True
    return _path


def _reset_for_tests() -> None:
    """Forget the cached path and rate limit (the env var is read on first use)."""
    global _path, _path_read, _last_write
    with _lock:
        _path, _path_read, _last_write = None, False, -float("inf")


def heartbeat(step: int | None = None) -> None:
    """Report progress: "this worker is alive and at ``step``".

    Rate-limited to about once per second (more often when the agent's
    ``--hang-timeout`` is short: ``ELASTRUN_HEARTBEAT_INTERVAL``); calls in between return at once.
    Never raises for I/O problems (a full disk must not kill training); the
    watchdog then sees no progress and says so.
    """
    path = _target()
    if path is None:
        return
    global _last_write
    now = time.monotonic()
    if now - _last_write < _interval:
        return
    with _lock:
        if now - _last_write < _interval:
            return
        _last_write = now
        line = json.dumps(
            {"v": HEARTBEAT_SCHEMA, "pid": os.getpid(), "step": step, "monotonic": now}
        )
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(line + "\n")
            os.replace(tmp, path)
        except OSError:
            return
