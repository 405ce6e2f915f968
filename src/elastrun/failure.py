"""The failure a node reports when its workers fail: one record, one description.

The agent builds a :class:`FailureRecord` from its failed workers (the root
cause, else the first); the rendezvous keeps it in the store (the round's
``pending_failure`` / ``last_failure``) and puts :meth:`FailureRecord.describe`
in the new round's ``detail``; every node prints that line; ``elastrun status``
and the event log show the record. On the wire it is a JSON object
(:meth:`to_json` / :meth:`from_json`) with ``"v": FAILURE_RECORD_VERSION``::

    {"v": 1, "reason": "worker_failed", "host": "node-a", "rank": 1, "local_rank": 1,
     "pid": 4242, "exitcode": 1, "signal": null, "time": 1700000000.123,
     "role": "root_cause", "stopped_by_agent": false, "message": "ValueError: ...",
     "traceback": "...", "stderr_tail": ["..."], "stderr_log": "...", "error_file": "...",
     "attempt": 0, "restart_count": 0, "hang": null,
     "failures": [{"rank": 1, "exitcode": 1, "signal": null, "role": "root_cause",
                   "stopped_by_agent": false}]}

Fields are only ever added within a version. Reading is lenient, as the record
comes from another node, possibly of another elastrun version: a record
without ``v`` (written before records had one) or of a newer version is read
for the fields known here; a missing or mistyped field reads as its default.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FAILURE_RECORD_VERSION",
    "FailedWorker",
    "FailureRecord",
    "describe_stored",
    "first_failure",
]

FAILURE_RECORD_VERSION = 1
NO_RECORD = "workers failed on another node"


@dataclass(frozen=True)
class FailedWorker:
    """One failed worker of the failing node, in brief."""

    rank: int | None
    exitcode: int | None = None
    signal: str | None = None
    role: str = ""
    stopped_by_agent: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "exitcode": self.exitcode,
            "signal": self.signal,
            "role": self.role,
            "stopped_by_agent": self.stopped_by_agent,
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> FailedWorker:
        return cls(
            rank=_int(raw.get("rank")),
            exitcode=_int(raw.get("exitcode")),
            signal=_str(raw.get("signal")),
            role=_str(raw.get("role")) or "",
            stopped_by_agent=raw.get("stopped_by_agent") is True,
        )


@dataclass(frozen=True)
class FailureRecord:
    """A node's worker failure: the worker that caused it, and every failed one.

    ``exitcode`` is set for a worker that exited, ``signal`` (its name) for one
    killed by a signal; ``hang`` says why the hang watchdog stopped it."""

    reason: str = "worker_failed"
    host: str = ""
    rank: int | None = None
    local_rank: int | None = None
    pid: int | None = None
    exitcode: int | None = None
    signal: str | None = None
    time: float | None = None  # wall clock of the exit
    role: str = ""  # root_cause | collateral
    stopped_by_agent: bool = False
    message: str = ""  # the error file's message, else the last line of output
    traceback: str | None = None
    stderr_tail: tuple[str, ...] = ()
    stderr_log: str | None = None
    error_file: str | None = None
    attempt: int = 0
    restart_count: int = 0
    hang: str | None = None
    failures: tuple[FailedWorker, ...] = ()

    def describe(self, *, detailed: bool = False) -> str:
        """One line: ``rank 1 on host-a exited with code 1``, ``rank 1 on
        host-a was killed by SIGKILL``, or the hang watchdog's message.

        ``detailed`` (``elastrun status``) adds when (local time), a reason
        other than ``worker_failed``, and the message: ``rank 1 on host-a
        exited with code 1 at 2024-05-01 12:00:03: ValueError: bad batch``.
        The record may come from another node: escape the line
        (:func:`elastrun.untrusted.printable`) where it reaches a terminal."""
        line = self._what()
        if not detailed:
            return line
        when = _local_time(self.time)
        if when:
            line += f" at {when}"
        if self.reason != "worker_failed":
            line += f" ({self.reason})"
        if self.message:
            line += f": {self.message}"
        return line

    def _what(self) -> str:
        host = self.host or "?"
        if self.hang:
            return f"{self.hang} on {host}"
        if self.rank is None:
            return f"workers failed on {host}"
        where = f"rank {self.rank} on {host}"
        if self.signal:
            return f"{where} was killed by {self.signal}"
        if self.exitcode is not None:
            return f"{where} exited with code {self.exitcode}"
        return f"{where} failed"

    def to_json(self) -> dict[str, Any]:
        return {
            "v": FAILURE_RECORD_VERSION,
            "reason": self.reason,
            "host": self.host,
            "rank": self.rank,
            "local_rank": self.local_rank,
            "pid": self.pid,
            "exitcode": self.exitcode,
            "signal": self.signal,
            "time": self.time,
            "role": self.role,
            "stopped_by_agent": self.stopped_by_agent,
            "message": self.message,
            "traceback": self.traceback,
            "stderr_tail": list(self.stderr_tail),
            "stderr_log": self.stderr_log,
            "error_file": self.error_file,
            "attempt": self.attempt,
            "restart_count": self.restart_count,
            "hang": self.hang,
            "failures": [f.to_json() for f in self.failures],
        }

    @classmethod
    def from_json(cls, raw: object) -> FailureRecord | None:
        """The record in ``raw`` (see the module docstring); None when ``raw``
        is not a record (absent, empty, not a JSON object)."""
        if not isinstance(raw, Mapping) or not raw:
            return None
        tail = raw.get("stderr_tail")
        failures = raw.get("failures")
        return cls(
            reason=_str(raw.get("reason")) or "worker_failed",
            host=_str(raw.get("host")) or "",
            rank=_int(raw.get("rank")),
            local_rank=_int(raw.get("local_rank")),
            pid=_int(raw.get("pid")),
            exitcode=_int(raw.get("exitcode")),
            signal=_str(raw.get("signal")),
            time=_float(raw.get("time")),
            role=_str(raw.get("role")) or "",
            stopped_by_agent=raw.get("stopped_by_agent") is True,
            message=_str(raw.get("message")) or "",
            traceback=_str(raw.get("traceback")),
            stderr_tail=tuple(str(ln) for ln in tail) if isinstance(tail, list) else (),
            stderr_log=_str(raw.get("stderr_log")),
            error_file=_str(raw.get("error_file")),
            attempt=_int(raw.get("attempt")) or 0,
            restart_count=_int(raw.get("restart_count")) or 0,
            hang=_str(raw.get("hang")),
            failures=tuple(FailedWorker.from_json(f) for f in failures if isinstance(f, Mapping))
            if isinstance(failures, list)
            else (),
        )


def _order(record: FailureRecord) -> tuple[int, float]:
    """A record's place in the job's order of failures: a node's own root
    cause (a rank that failed by itself) before a failure its agent caused,
    then by time (a record without one last)."""
    when = record.time if record.time is not None and math.isfinite(record.time) else math.inf
    return (0 if record.role == "root_cause" else 1, when)


def first_failure(
    current: FailureRecord | None, other: FailureRecord | None
) -> FailureRecord | None:
    """The job's root cause of two nodes' failures: the one that came first
    (see :func:`_order`; ``current`` on a tie, and when ``other`` is None).

    Ranks that fail because a peer's crash broke their collective exit
    after that crash (cause precedes effect: the peer's process ended, its
    sockets closed, the rank noticed, raised and its interpreter shut down),
    so the earliest failure across nodes is the one that started the cascade,
    as long as the nodes' clocks agree better than that delay (NTP keeps
    them within milliseconds; the cascade takes tens of milliseconds or more)."""
    if current is None or other is None:
        return current or other
    return other if _order(other) < _order(current) else current


def describe_stored(raw: object) -> str:
    """:meth:`FailureRecord.describe` of a record as stored (the round's
    ``last_failure``: its JSON, or the record read from it), or ``workers
    failed on another node`` when there is none."""
    record = raw if isinstance(raw, FailureRecord) else FailureRecord.from_json(raw)
    return record.describe() if record is not None else NO_RECORD


def _local_time(ts: float | None) -> str:
    """``2024-05-01 12:00:03``, or "" for no time (or one out of range)."""
    if ts is None or not math.isfinite(ts):
        return ""
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))
    except (OverflowError, OSError, ValueError):
        return ""


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float(value: object) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def _str(value: object) -> str | None:
    return value if isinstance(value, str) else None
