"""The failure a node reports when its workers fail: one record, one description.

The agent builds a :class:`FailureRecord` from its failed workers (the root
cause, else the first); the rendezvous keeps it in the store (the round's
``pending_failure`` / ``last_failure``) and puts :meth:`FailureRecord.describe`
in the new round's ``detail``; every node prints that line; ``elastrun status``
and the event log show the record. On the wire it is a JSON object
(:meth:`to_json` / :meth:`from_json`) with ``"v": FAILURE_RECORD_VERSION``::

    {"v": 1, "reason": "worker_failed", "host": "node-a", "rank": 1, "local_rank": 1,
     "pid": 4242, "exitcode": 1, "signal": null, "time": 1700000000.123,
     "role": "root_cause", "kind": "error", "stopped_by_agent": false,
     "message": "ValueError: ...",
     "traceback": "...", "stderr_tail": ["..."], "stderr_log": "...", "error_file": "...",
     "attempt": 0, "restart_count": 0, "hang": null,
     "failures": [{"rank": 1, "exitcode": 1, "signal": null, "role": "root_cause",
                   "stopped_by_agent": false}]}

Across nodes the job's root cause is decided by one pure rule,
:func:`first_failure`: the failure the round keeps (the first reported, in
the store's order: no wall clocks compared across nodes) stays, unless a
later report is stronger evidence of a root cause (:func:`weight`: a rank
that failed by itself, of a signal, an error or a hang, over one whose only
failure is a broken collective, over a node whose ranks the agent stopped).

Fields are only ever added within a version. Reading is lenient, as the record
comes from another node, possibly of another elastrun version: a record
without ``v`` (written before records had one) or of a newer version is read
for the fields known here; a missing or mistyped field reads as its default.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

from elastrun.fields import Fields
from elastrun.frozen import frozen

__all__ = [
    "BROKEN_COLLECTIVE",
    "ERROR",
    "FAILURE_RECORD_VERSION",
    "HANG",
    "SIGNAL",
    "FailedWorker",
    "FailureRecord",
    "describe_stored",
    "first_failure",
    "same_failure",
    "weight",
]

FAILURE_RECORD_VERSION = 1
NO_RECORD = "workers failed on another node"

# How the reported rank failed (``FailureRecord.kind``), as evidence of a root
# cause across nodes (agent/failures.failure_kind decides it).
SIGNAL = "signal"  # killed by a signal the agent did not send (an OOM kill, a segfault)
ERROR = "error"  # its script failed: an exception or a non-zero exit
HANG = "hang"  # declared failed while it ran (the hang watchdog, a file timer)
BROKEN_COLLECTIVE = "broken_collective"  # its error says a peer's connection broke


@frozen
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
        f = Fields(raw, "a failed worker")
        return cls(
            rank=f.maybe_int("rank"),
            exitcode=f.maybe_int("exitcode"),
            signal=f.maybe_text("signal"),
            role=f.maybe_text("role") or "",
            stopped_by_agent=raw.get("stopped_by_agent") is True,
        )


@frozen
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
    kind: str = ""  # signal | error | hang | broken_collective ("": an older record)
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
            "kind": self.kind,
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
        f = Fields(raw, "a failure record")
        tail = raw.get("stderr_tail")
        failures = raw.get("failures")
        return cls(
            reason=f.maybe_text("reason") or "worker_failed",
            host=f.maybe_text("host") or "",
            rank=f.maybe_int("rank"),
            local_rank=f.maybe_int("local_rank"),
            pid=f.maybe_int("pid"),
            exitcode=f.maybe_int("exitcode"),
            signal=f.maybe_text("signal"),
            time=f.maybe_number("time"),
            role=f.maybe_text("role") or "",
            kind=f.maybe_text("kind") or "",
            stopped_by_agent=raw.get("stopped_by_agent") is True,
            message=f.maybe_text("message") or "",
            traceback=f.maybe_text("traceback"),
            stderr_tail=tuple(str(ln) for ln in tail) if isinstance(tail, list) else (),
            stderr_log=f.maybe_text("stderr_log"),
            error_file=f.maybe_text("error_file"),
            attempt=f.maybe_int("attempt") or 0,
            restart_count=f.maybe_int("restart_count") or 0,
            hang=f.maybe_text("hang"),
            failures=tuple(FailedWorker.from_json(w) for w in failures if isinstance(w, Mapping))
            if isinstance(failures, list)
            else (),
        )


def weight(record: FailureRecord) -> int:
    """How strongly ``record`` says its node holds the job's root cause
    (lower: stronger). 0: a rank of the node failed by itself (a signal the
    agent did not send, an error, a hang; an older record without a kind);
    1: its only failure of its own is a broken collective (a peer's
    connection closed: the peer failed first); 2: no rank failed by itself
    (the agent stopped them all: the trigger was elsewhere)."""
    if record.role != "root_cause":
        return 2
    return 1 if record.kind == BROKEN_COLLECTIVE else 0


def first_failure(
    kept: FailureRecord | None, reported: FailureRecord | None
) -> FailureRecord | None:
    """The job's root cause, given the failure the round ``kept`` so far (the
    first reported, in the store's order) and one ``reported`` after it:
    ``kept``, unless ``reported`` is stronger evidence (:func:`weight`), and
    whichever is not None.

    Never by the records' times: they are wall clocks of different nodes.
    The store orders the reports (each is a compare-and-set on the round
    record), so every node that reads the round reads the same root cause,
    also when two failures carry the same time. A failure written first
    still loses to a stronger one written later: a rank killed by a signal
    (an OOM kill) says nothing before it dies, its node reports it only once
    its exit is seen, and its peers' collectives, which its death broke, may
    be reported before it."""
    if kept is None or reported is None:
        return kept or reported
    return reported if weight(reported) < weight(kept) else kept


def same_failure(a: FailureRecord | None, b: FailureRecord | None) -> bool:
    """Whether ``a`` and ``b`` are the same failure (one of them possibly
    read back from the store): the same worker of the same attempt."""
    if a is None or b is None:
        return a is b
    return _identity(a) == _identity(b)


def _identity(r: FailureRecord) -> tuple[object, ...]:
    # Not how it ended: a rank declared failed while it runs (a hang, a timer) is
    # reported before it is stopped, and its record read back has no exit yet.
    return (r.host, r.rank, r.local_rank, r.pid, r.attempt, r.restart_count)


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
