"""The launcher's own error file, as torch's launcher writes it.

A scheduler that starts ``elastrun`` (or calls :func:`elastrun.launch`) may
set ``TORCHELASTIC_ERROR_FILE`` in the launcher's environment, as it does for
torchrun. When the job fails on this node with no restarts left, torch's
``@record`` around torchrun's main copies the root cause's ``error.json``
there, with the worker's exit code as ``errorCode``; so does
:func:`pass_error_file`. The worker's file is read as untrusted (no link
followed, bounded: :mod:`elastrun.agent.error_files`' bound) and the copy
replaces the destination atomically. Without a root-cause error file (a worker
killed by a signal, a script without ``@record``) nothing is written, as
under torchrun.
"""

from __future__ import annotations

import json
import os
import signal

from elastrun.agent.error_files import MAX_ERROR_FILE_BYTES
from elastrun.failure import FailureRecord
from elastrun.procs import say
from elastrun.safefs import UnsafePath, read_regular, write_atomic
from elastrun.untrusted import UntrustedData, loads

__all__ = ["ERROR_FILE_ENV", "pass_error_file"]

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


def _error_code(failure: FailureRecord) -> int:
    """torch's ``failure.exitcode``: the exit code, or minus the signal."""
    if failure.exitcode is not None:
        return failure.exitcode
    if failure.signal:
        try:
            return -int(signal.Signals[failure.signal])
        except KeyError:
            return 0
    return 0


def copied_error(raw: bytes, error_code: int) -> bytes | None:
    """The bytes torch writes for a root cause's error file ``raw``: its JSON
    with ``message.errorCode`` set to ``error_code`` (when not 0 and the
    message is torch's object form). None: not an error file."""
    try:
        data = loads(raw, max_bytes=MAX_ERROR_FILE_BYTES, what="the root cause's error file")
    except UntrustedData:
        return None
    if not isinstance(data, dict):
        return None
    message = data.get("message")
    if error_code and isinstance(message, dict):
        message["errorCode"] = error_code
    return json.dumps(data).encode("utf-8")


def pass_error_file(failure: FailureRecord | None, dest: str | None = None) -> str | None:
    """Copy ``failure``'s error file to ``dest`` (default: this process'
    ``TORCHELASTIC_ERROR_FILE``). Returns the path written, or None."""
    dest = dest if dest is not None else os.environ.get(ERROR_FILE_ENV)
    if not dest or failure is None or not failure.error_file:
        return None
    try:
        raw = read_regular(failure.error_file, MAX_ERROR_FILE_BYTES)
    except OSError as e:
        if isinstance(e, FileNotFoundError):
            return None  # the worker wrote none
        why = e.problem if isinstance(e, UnsafePath) else (e.strerror or str(e))
        say(f"elastrun: warning: the root cause's error file {failure.error_file}: {why}")
        return None
    data = copied_error(raw, _error_code(failure))
    if data is None:
        return None
    try:
        write_atomic(dest, data, 0o644)
    except OSError as e:
        why = e.problem if isinstance(e, UnsafePath) else (e.strerror or str(e))
        say(f"elastrun: warning: could not write {ERROR_FILE_ENV}={dest}: {why}")
        return None
    return dest
