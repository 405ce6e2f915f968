"""Progress heartbeat for the hang watchdog (``elastrun --hang-timeout``).

A training script calls :func:`heartbeat` once per step (or as often as it
likes). When the launcher sets ``ELASTRUN_HEARTBEAT_FILE`` for the worker, the
call overwrites that file, at most about once per second, with one line of
JSON::

    {"v": 1, "pid": 1234, "step": 42, "monotonic": 51234.125}

``monotonic`` is ``time.monotonic()`` of the worker: CLOCK_MONOTONIC, which on
Linux is shared by all processes of the machine, so the agent on the same node
compares it with its own ``time.monotonic()``. The file is replaced atomically
(a new, randomly named file, no link followed, then ``os.replace``:
``elastrun.safefs.write_atomic``), so a reader never sees a torn line. Without
the variable the call is a cheap no-op, so scripts can call it unconditionally.

A write that fails (a full disk, a read-only folder) never raises. It is said
once on stderr, the stale file is removed so that the watchdog cannot take it
for a worker that stopped (it then does not judge this worker: see
agent/watchdog.py), and the file is tried again with backoff, up to
``MAX_BACKOFF_S`` seconds apart.

In a worker that elastrun's runner started, progress is recorded
automatically (optimizer steps, DataLoader batches: see
``elastrun/worker/_progress.py``); ``heartbeat(step)`` then feeds the same
record, and :func:`phase` marks a long phase of the script.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from elastrun.safefs import write_atomic
from elastrun.untrusted import ascii_decimal

__all__ = ["HEARTBEAT_ENV", "HEARTBEAT_INTERVAL_S", "HEARTBEAT_SCHEMA", "heartbeat", "phase"]

HEARTBEAT_ENV = "ELASTRUN_HEARTBEAT_FILE"
HEARTBEAT_SCHEMA = 1
HEARTBEAT_INTERVAL_S = 1.0
# The agent may ask for more frequent writes (a short --hang-timeout).
HEARTBEAT_INTERVAL_ENV = "ELASTRUN_HEARTBEAT_INTERVAL"
MAX_BACKOFF_S = 30.0  # between two tries of a file that cannot be written

_lock = threading.Lock()
_path: str | None = None
_path_read = False
_last_write = -float("inf")
_interval = HEARTBEAT_INTERVAL_S
_failure: OSError | None = None  # the file's last write error (None: it works)
_backoff = 0.0


def _target() -> str | None:
    global _path, _path_read, _interval
    if not _path_read:
        _path = os.environ.get(HEARTBEAT_ENV) or None
        given = ascii_decimal(os.environ.get(HEARTBEAT_INTERVAL_ENV, ""))
        if given is None or given < 0:
            given = HEARTBEAT_INTERVAL_S
        _interval = min(HEARTBEAT_INTERVAL_S, given)
        _path_read = True
    return _path


def _reset_for_tests() -> None:
    """Forget the cached path and rate limit (the env var is read on first use)."""
    global _path, _path_read, _last_write, _failure, _backoff
    with _lock:
        _path, _path_read, _last_write = None, False, -float("inf")
        _failure, _backoff = None, 0.0


def _progress() -> Any:
    """The worker runner's automatic progress (worker/_progress.py), if on."""
    mod = sys.modules.get("_elastrun_progress")
    return mod.current() if mod is not None else None


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark a long phase of the script (an evaluation without a DataLoader, an
    export), so that ``--hang-timeout auto`` allows it longer than a step.

    Inside a phase the watchdog waits 10 times the rank's timeout
    (``--hang-timeout auto`` only); the phase's duration does not count as a gap between two steps.
    elastrun's checkpoint helpers and ``torch.save``/``torch.load`` are
    phases already. A no-op outside elastrun."""
    progress = _progress()
    if progress is None:
        yield
        return
    with progress.in_phase(str(name)):
        yield


def heartbeat(step: int | None = None) -> None:
    """Report progress: "this worker is alive and at ``step``".

    Rate-limited to about once per second (more often when the agent's
    ``--hang-timeout`` is short: ``ELASTRUN_HEARTBEAT_INTERVAL``); calls in between return at once.
    Never raises for I/O problems (a full disk must not kill training): said
    once on stderr, tried again with backoff; the watchdog does not judge this
    worker while its file cannot be written, and says so.
    """
    progress = _progress()
    if progress is not None:
        progress.heartbeat(step)  # written by its thread, rate-limited
        return
    path = _target()
    if path is None:
        return
    global _last_write
    now = time.monotonic()
    if now - _last_write < max(_interval, _backoff):
        return
    with _lock:
        if now - _last_write < max(_interval, _backoff):
            return
        _last_write = now
        line = json.dumps(
            {"v": HEARTBEAT_SCHEMA, "pid": os.getpid(), "step": step, "monotonic": now}
        )
        try:
            write_atomic(path, (line + "\n").encode())
        except OSError as e:
            _failed(path, e)
        else:
            _recovered()


def _recovered() -> None:
    global _failure, _backoff
    _failure, _backoff = None, 0.0


def _failed(path: str, error: OSError) -> None:
    """Said once; the stale file removed; the next try later (under ``_lock``)."""
    global _failure, _backoff
    _backoff = min(MAX_BACKOFF_S, max(_interval, 2 * _backoff))
    first = _failure is None
    _failure = error
    if not first:
        return
    with contextlib.suppress(Exception):
        print(
            f"elastrun: worker pid {os.getpid()}: heartbeat file {path} not recorded: {error}; "
            "retrying with backoff; the hang watchdog cannot judge this worker meanwhile",
            file=sys.stderr,
            flush=True,
        )
    with contextlib.suppress(OSError):
        os.unlink(path)  # a stale record would look like a worker that stopped
