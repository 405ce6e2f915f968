"""A worker's error file, read as untrusted.

A worker that fails leaves, at best, a ``TORCHELASTIC_ERROR_FILE`` written by
torch's ``@record`` or by :func:`elastrun.record` (same JSON format)::

    {"message": {"message": "ValueError: ...",
                 "extraInfo": {"py_callstack": "<traceback>", "timestamp": "<unix s>"},
                 "errorCode": <optional int>}}

(older writers put a plain string in ``message`` and ``timestamp`` beside it).
"""

from __future__ import annotations

from typing import Any

from elastrun.frozen import frozen
from elastrun.safefs import UnsafePath, read_regular
from elastrun.untrusted import MAX_DEPTH, UntrustedData, depth, loads

__all__ = ["MAX_ERROR_FILE_BYTES", "ErrorFileInfo", "read_error_file"]

MAX_ERROR_FILE_BYTES = 1 << 20  # an error file larger than this is not read (said so)


@frozen
class ErrorFileInfo:
    message: str
    traceback: str | None
    timestamp: int | None
    error_code: int | None = None


def read_error_file(path: str | None) -> ErrorFileInfo | None:
    """Parse an error file in torch's format; ``None`` if absent. Read
    without following a link, never blocked by a FIFO, at most
    ``MAX_ERROR_FILE_BYTES``, nested at most ``MAX_DEPTH`` levels:
    otherwise its message says the error file was unreadable, and why."""
    if not path:
        return None
    raw = _error_file_bytes(path)
    if not isinstance(raw, bytes):
        return raw
    text = raw.decode("utf-8", errors="replace")
    try:
        data = loads(text, max_bytes=4 * MAX_ERROR_FILE_BYTES, what="it")
    except UntrustedData as e:
        if depth(raw) > MAX_DEPTH:
            return _unreadable(path, str(e))
        text = text.strip()
        return ErrorFileInfo(message=text[:2000], traceback=None, timestamp=None) if text else None
    if not isinstance(data, dict) or "message" not in data:
        return None
    msg = data["message"]
    if isinstance(msg, str):
        return ErrorFileInfo(
            message=msg, traceback=None, timestamp=_int_or_none(data.get("timestamp"))
        )
    if not isinstance(msg, dict):
        return None
    extra = msg.get("extraInfo")
    extra = extra if isinstance(extra, dict) else {}
    tb = extra.get("py_callstack")
    return ErrorFileInfo(
        message=str(msg.get("message", "")),
        traceback=tb if isinstance(tb, str) and tb.strip() else None,
        timestamp=_int_or_none(extra.get("timestamp")),
        error_code=_int_or_none(msg.get("errorCode")),
    )


def _error_file_bytes(path: str) -> bytes | ErrorFileInfo | None:
    """The bytes of the error file (None: absent), or why it is unreadable."""
    try:
        return read_regular(path, MAX_ERROR_FILE_BYTES)
    except FileNotFoundError:
        return None
    except OSError as e:
        why = e.problem if isinstance(e, UnsafePath) else (e.strerror or str(e))
        return _unreadable(path, why)


def _unreadable(path: str, why: str) -> ErrorFileInfo:
    return ErrorFileInfo(
        message=f"the error file {path} was unreadable: {why}", traceback=None, timestamp=None
    )


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
