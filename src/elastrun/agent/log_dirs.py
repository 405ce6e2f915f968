"""Folders of the job's logs, made without following links (see
:mod:`elastrun.safefs`): every folder under ``--log-dir`` (the run, the
host, each attempt and local rank) is created mode 0700 and must be ours
(not a link, not another user's, not writable by others), and ``--log-dir``
itself must not be writable by others unless it is sticky (as ``/tmp``). A
refused folder stops the agent before any worker starts (:func:`refusal`
says which folder, why, and what to do).
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from typing import Any, TypeGuard

from elastrun.errors import ConfigError, WorkerError
from elastrun.events import JsonLinesSink
from elastrun.names import RunId, path_component
from elastrun.procs import pid_alive
from elastrun.safefs import UnsafePath, check_parent, create_new, private_dir, read_regular

__all__ = [
    "HOST_PID_FILE",
    "claim_host_dir",
    "error_files",
    "open_event_log",
    "rank_dir",
    "refusal",
    "refused",
    "release_host_dir",
    "run_dir",
    "temp_dir",
]

MAX_HOST_DIRS = 64
HOST_PID_FILE = ".agent.pid"
MAX_PID_FILE_BYTES = 64


def refused(error: OSError) -> TypeGuard[UnsafePath]:
    """Whether ``error`` refuses a path as unsafe (a link, a FIFO, another
    user's or a shared folder), not a failing disk."""
    return isinstance(error, UnsafePath) and error.errno == errno.EPERM


def refusal(error: UnsafePath, flag: str = "--log-dir") -> str:
    """One line for a refused path: which, why, and what to do."""
    advice = "" if ";" in error.problem else f"; remove it, or choose another {flag}"
    return (
        f"{flag}: refusing {error.path}: it {error.problem}{advice} (files of the job are "
        "kept only in folders of this user that no other user can change)"
    )


def _private(path: str, below: str, flag: str = "--log-dir") -> str:
    """``private_dir``; a refusal is a ConfigError, a failing disk an OSError."""
    try:
        return private_dir(path, below=below)
    except UnsafePath as e:
        if refused(e):
            raise ConfigError(refusal(e, flag)) from None
        raise


def open_event_log(path: str, flag: str, **common: Any) -> JsonLinesSink:
    """The event log ``path`` (from ``flag``): never a link, a FIFO or another
    user's file. Raises ConfigError saying why it cannot be opened."""
    try:
        return JsonLinesSink(path, **common)
    except OSError as e:
        if refused(e):
            raise ConfigError(refusal(e, flag)) from None
        raise ConfigError(f"cannot open the event log {path}: {e.strerror or e}") from None


def run_dir(log_dir: str, run_id: RunId) -> str:
    """``{log_dir}/{run_id}`` (absolute), made private when missing.
    ``log_dir`` is created when missing (as given: its links are the user's
    choice) and must not be writable by others unless sticky. Raises
    ConfigError for a refused folder, OSError when it cannot be made."""
    log_dir = os.path.abspath(log_dir)
    os.makedirs(log_dir, exist_ok=True)
    return _private(os.path.join(log_dir, run_id), log_dir)


def rank_dir(attempt_dir: str, local_rank: int) -> str:
    """``{attempt_dir}/{local_rank}``, made private (so is the attempt's
    folder) below the agent's own base folder. Raises WorkerError for a
    refused folder, OSError when it cannot be made (a full disk)."""
    path = os.path.join(attempt_dir, str(local_rank))
    try:
        return private_dir(path, below=os.path.dirname(os.path.abspath(attempt_dir)))
    except UnsafePath as e:
        if refused(e):
            raise WorkerError(refusal(e)) from None
        raise


def temp_dir(run_id: RunId) -> str:
    """A fresh temporary folder for one agent's attempts (error files, logs):
    random, mode 0700, in a temporary folder others cannot rearrange."""
    parent = tempfile.gettempdir()
    try:
        check_parent(parent)
        return tempfile.mkdtemp(prefix=f"elastrun-{run_id}-", dir=parent)
    except UnsafePath as e:
        raise WorkerError(
            f"cannot keep the workers' error files in {e.path}: it {e.problem}; "
            "set TMPDIR to a folder only you can write"
        ) from None
    except OSError as e:
        raise WorkerError(
            f"cannot create a folder for the workers' error files in {parent}: {e.strerror or e}"
        ) from None


def claim_host_dir(log_dir: str, run_id: RunId, host: str) -> tuple[str, str | None]:
    """``{log_dir}/{run_id}/{host}``: one folder per node, so nodes sharing a
    file system never write the same file. A second live agent of the same run
    on the same host (tests; one agent per GPU set) gets ``{host}.1``, ...
    ``.agent.pid`` in a folder names its holder; a dead holder's folder is
    taken over. Every folder is private (see :func:`run_dir`). Returns (the
    folder, absolute; the pid file to release at exit). Raises ConfigError
    for a refused folder, OSError when one cannot be made."""
    run = run_dir(log_dir, run_id)
    name = _safe_name(host)
    for i in range(MAX_HOST_DIRS):
        cand = _private(os.path.join(run, name if i == 0 else f"{name}.{i}"), run)
        pidfile = os.path.join(cand, HOST_PID_FILE)
        held = _mark(pidfile)
        if held is None:
            return cand, None  # cannot mark it: use it anyway
        if held:
            return cand, pidfile
    raise ConfigError(f"--log-dir: {MAX_HOST_DIRS} live agents of one run on {name}?")


def _mark(pidfile: str) -> bool | None:
    """Write our pid into a new ``pidfile`` (never through a link): True;
    False when a live agent holds it; None when it cannot be written. A
    stale one (a dead holder, or not a pid file) is removed and made anew."""
    me = os.getpid()
    for _ in range(2):
        try:
            fd = create_new(pidfile, 0o644)
        except FileExistsError:
            holder = _read_pid(pidfile)
            if holder is not None and holder != me and pid_alive(holder):
                return False
            try:
                os.unlink(pidfile)  # stale: the name itself, never what it points at
            except FileNotFoundError:
                pass
            except OSError:
                return None
            continue
        except OSError:
            return None
        with os.fdopen(fd, "w", encoding="ascii") as fp:
            fp.write(str(me))
        return True
    return False  # another agent took it over meanwhile: try the next folder


def release_host_dir(pidfile: str) -> None:
    """At exit: free the host folder (if this process still holds it)."""
    if _read_pid(pidfile) == os.getpid():
        with contextlib.suppress(OSError):
            os.unlink(pidfile)


def _safe_name(text: str) -> str:
    return path_component(text, "unknown-host")


def _read_pid(path: str) -> int | None:
    try:
        return int(read_regular(path, MAX_PID_FILE_BYTES).decode("ascii", "replace").strip())
    except (OSError, ValueError):
        return None


MAX_LISTED_ERROR_FILES = 64  # error files named at exit (attempts x local ranks)


def error_files(base: str) -> list[str]:
    """The workers' error files under an agent's folder of attempts
    (``attempt_N/LOCAL_RANK/error.json``), at most ``MAX_LISTED_ERROR_FILES``,
    oldest attempt first; links and other files are not followed."""
    found: list[str] = []
    try:
        attempts = sorted(
            (e for e in os.scandir(base) if e.is_dir(follow_symlinks=False)),
            key=lambda e: (len(e.name), e.name),
        )
        for attempt in attempts:
            for rank in sorted(os.scandir(attempt.path), key=lambda e: (len(e.name), e.name)):
                path = os.path.join(rank.path, "error.json")
                if rank.is_dir(follow_symlinks=False) and os.path.isfile(path):
                    found.append(path)
                    if len(found) >= MAX_LISTED_ERROR_FILES:
                        return found
    except OSError:
        pass
    return found
