"""``elastrun.record``: report a worker's uncaught exception to the agent.

Decorate the entry point of a training script::

    from elastrun import record

    @record
    def main() -> None:
        ...

An exception escaping ``main`` is written, with its traceback, to the file
named by ``TORCHELASTIC_ERROR_FILE`` (set by the agent for each rank and
attempt) in the same JSON format as torch's own
``torch.distributed.elastic.multiprocessing.errors.record``, then re-raised.
The agent reads it for the failure summary. Without the variable (the script
run by hand) nothing is written. Importing this never imports torch.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from elastrun.safefs import write_atomic

__all__ = ["ERROR_FILE_ENV", "record", "write_error_file"]

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"

_P = ParamSpec("_P")
_R = TypeVar("_R")


def write_error_file(exc: BaseException, path: str | None = None) -> str | None:
    """Write ``exc`` to the error file (torch's format); returns the path
    written, or None when there is no error file to write."""
    path = path or os.environ.get(ERROR_FILE_ENV)
    if not path:
        return None
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {"py_callstack": tb, "timestamp": str(int(time.time()))},
        }
    }
    try:
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        # A new temporary file (O_EXCL, no link followed), renamed over the
        # error file: the agent never sees half a file, and a link planted
        # at either name is replaced, never written through.
        write_atomic(path, json.dumps(data).encode("utf-8"), 0o666)
    except OSError as e:
        sys.stderr.write(f"elastrun.record: cannot write the error file {path}: {e}\n")
        return None
    return path


def record(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Decorator: record an uncaught exception of ``fn`` for the agent, then re-raise."""

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        # as torch: a native crash (segfault) still shows a Python stack
        with contextlib.suppress(RuntimeError, ValueError, OSError):
            faulthandler.enable(all_threads=True)
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            write_error_file(e)
            raise

    return wrapper
