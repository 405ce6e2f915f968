"""Worker failures users can act on: root cause and the summary.

A worker that fails leaves, at best, a ``TORCHELASTIC_ERROR_FILE`` (read by
:mod:`.error_files`). Without a decorator there is no file, so the agent
always keeps the last lines of each rank's stderr and shows them instead (or,
when a rank wrote nothing to stderr, the last lines of its stdout: some
scripts print their errors).

The root cause is decided by one rule, :func:`roles` (pure): the earliest
failure that the agent did not cause itself. Ranks the agent ended (it was
stopping them, or they died of a signal it sent them for another purpose:
the stack signal, whose handler their script changed), and ranks that failed
after the root cause (a cascade: a peer's collective broke), are collateral.
A rank a feature declared failed while it ran (a hang) fails at the moment
of the declaration. The ``worker_exited`` event's ``cause`` and the failure
summary both come from this rule.

Across nodes, the job's root cause is the first failure any node reported,
unless a later report is stronger evidence (:func:`elastrun.failure.first_failure`;
:mod:`elastrun.rendezvous.root_cause`): what makes it stronger is the
record's ``kind`` (:func:`failure_kind`), where a rank whose error says a
peer's connection broke (:func:`broke_collective`: the peer failed first)
ranks below a rank that died of a signal or failed with an error of its own.
A node whose ranks failed after another node's learns it before it prints its
summary (:func:`elsewhere`), and names the other node's rank as the root
cause (``peer`` in :func:`format_summary`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import field, replace
from typing import Any

from elastrun.agent.error_files import ErrorFileInfo
from elastrun.failure import (
    BROKEN_COLLECTIVE,
    ERROR,
    HANG,
    SIGNAL,
    FailedWorker,
    FailureRecord,
)
from elastrun.frozen import frozen
from elastrun.procs import signal_name
from elastrun.rendezvous.api import Change, RoundResult
from elastrun.untrusted import printable

__all__ = [
    "COLLATERAL",
    "OK",
    "ROOT_CAUSE",
    "Ending",
    "WorkerFailure",
    "broke_collective",
    "change_line",
    "change_why",
    "classify",
    "describe_exit",
    "elsewhere",
    "failed_why",
    "failure_kind",
    "failure_record",
    "format_summary",
    "roles",
    "round_end_line",
    "summary_title",
    "with_report",
]

# How long a node whose workers failed waits at most for the other members of
# the round to report theirs (or rejoin, or be gone) before it prints its
# summary, while the round keeps no failure of a rank that failed by itself
# (a broken collective only: the job's root cause is likely another node's,
# not reported yet). Longer than the default lease (10 s): a lost node's
# presence is gone by then. The restart waits for those members anyway.
SETTLE_TIMEOUT = 15.0
# What a failure record keeps (it is written to the store and the event log).
MAX_TRACEBACK_CHARS = 8000
MAX_TAIL_LINES = 10
MAX_TAIL_LINE_CHARS = 300
ROOT_CAUSE = "root_cause"
COLLATERAL = "collateral"
OK = "ok"  # exited 0: no failure


@frozen
class Ending:
    """How one worker ended, as the root-cause rule sees it.

    ``returncode``: its exit status (Popen's: a negative signal number), or
    None while it still runs (then only a ``declared`` failure counts);
    ``at``: when it failed (monotonic): its exit, or the declaration;
    ``stopped_by_agent``: the agent was stopping it when it exited;
    ``declared``: a feature declared it failed while it ran (a hang);
    ``agent_signals``: signals the agent sent it for another purpose than
    stopping it (the stack signal): dying of one is the agent's doing."""

    returncode: int | None
    at: float
    stopped_by_agent: bool = False
    declared: bool = False
    agent_signals: frozenset[int] = frozenset()

    @property
    def failed(self) -> bool:
        return self.declared or self.returncode not in (None, 0)

    @property
    def by_agent(self) -> bool:
        """Whether the agent ended it (never for a declared failure)."""
        if self.declared:
            return False
        rc = self.returncode
        killed_by_ours = rc is not None and rc < 0 and -rc in self.agent_signals
        return self.stopped_by_agent or killed_by_ours


def roles(endings: Sequence[Ending]) -> list[str]:
    """The one root-cause rule: the role of each of ``endings``, in order.
    ``ROOT_CAUSE``: the earliest failure the agent did not cause (the first
    given among equal times); ``COLLATERAL``: every other failure; ``OK``:
    the rest. No root cause when the agent caused every failure (the trigger
    was elsewhere: a signal, a membership change, another node)."""
    own = [i for i, e in enumerate(endings) if e.failed and not e.by_agent]
    root = min(own, key=lambda i: (endings[i].at, i)) if own else None
    return [
        ROOT_CAUSE if i == root else COLLATERAL if e.failed else OK for i, e in enumerate(endings)
    ]


# What a rank's error says when its collective broke because a peer's process
# ended (its sockets closed): gloo's and torch's TCPStore's "closed" / "reset"
# by peer, NCCL's remote error. Matched in its last lines only (the error).
BROKEN_COLLECTIVE_SIGNS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote process exit",  # NCCL: "... or a remote process exiting prematurely"
    "ncclRemoteError",
    "NCCL communicator was aborted",
    # NCCL's watchdog on a rank whose peer died or hung: the collective timed
    # out waiting for the peer (the hung rank's own hang is the hang watchdog's).
    "Watchdog caught collective operation timeout",
    "DistNetworkError",
)
ERROR_LINES = 5  # the last lines of a rank's output that say its error


def broke_collective(lines: Sequence[str]) -> bool:
    """Whether the error in ``lines`` (a rank's error message, or its last
    lines of output) says that a peer's connection broke: its collective
    failed because a peer failed first. Only the last :data:`ERROR_LINES`
    lines that are not teardown noise are read (an older line may be a
    warning the rank went on after)."""
    said = [ln for ln in lines if ln.strip() and not ln.strip().startswith(TEARDOWN_NOISE)]
    return any(sign in ln for ln in said[-ERROR_LINES:] for sign in BROKEN_COLLECTIVE_SIGNS)


def failure_kind(returncode: int, *, hang: bool, error_lines: Sequence[str]) -> str:
    """How a rank failed, as evidence of the job's root cause across nodes
    (pure; :func:`elastrun.failure.weight`): ``hang`` when it was declared
    failed; ``broken_collective`` when its error says a peer's connection
    broke (also when it then died of a signal: an abort in its teardown, the
    NCCL watchdog's); ``signal`` when it was killed by a signal with no such
    error (an OOM kill says nothing before it dies); else ``error``."""
    if hang:
        return HANG
    if broke_collective(error_lines):
        return BROKEN_COLLECTIVE
    return SIGNAL if returncode < 0 else ERROR


def describe_exit(returncode: int) -> str:
    """``exit code 1`` or ``signal SIGKILL (9)`` from a Popen return code."""
    if returncode >= 0:
        return f"exit code {returncode}"
    signum = -returncode
    return f"signal {signal_name(signum)} ({signum})"


@frozen
class WorkerFailure:
    """One worker that ended with a non-zero exit code or a signal."""

    rank: int
    local_rank: int
    host: str
    pid: int
    returncode: int
    exit_time: float  # wall clock, for humans
    exit_monotonic: float  # for ordering
    stopped_by_agent: bool = False
    error: ErrorFileInfo | None = None
    stderr_tail: tuple[str, ...] = ()
    stdout_tail: tuple[str, ...] = ()
    # The last lines of both streams, in the order they came (its last output).
    output_tail: tuple[str, ...] = ()
    stdout_log: str | None = None
    stderr_log: str | None = None
    error_file: str | None = None
    role: str = ""  # ROOT_CAUSE | COLLATERAL, set by classify()
    attempt: int = 0
    restart_count: int = 0
    hang: str | None = None  # set when the hang watchdog failed this rank
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def exit_description(self) -> str:
        return describe_exit(self.returncode)

    @property
    def signal_name(self) -> str | None:
        return None if self.returncode >= 0 else signal_name(-self.returncode)

    @property
    def last_words(self) -> str:
        """The last non-blank line on stderr, else on stdout ("" if none)."""
        return _last_line(self.stderr_tail) or _last_line(self.stdout_tail)

    @property
    def kind(self) -> str:
        """How it failed, as evidence of a root cause (:func:`failure_kind`):
        its error is its error file's message, else its last lines of
        stderr (else of stdout)."""
        if self.error is not None and self.error.message:
            said: Sequence[str] = self.error.message.splitlines()
        else:
            said = self.stderr_tail if _last_line(self.stderr_tail) else self.stdout_tail
        return failure_kind(self.returncode, hang=self.hang is not None, error_lines=said)

    def record(self) -> FailureRecord:
        """This failure as the record a node reports (see :mod:`elastrun.failure`)."""
        return FailureRecord(
            host=self.host,
            rank=self.rank,
            local_rank=self.local_rank,
            pid=self.pid,
            exitcode=self.returncode if self.returncode >= 0 else None,
            signal=self.signal_name,
            time=round(self.exit_time, 3),
            role=self.role,
            kind=self.kind,
            stopped_by_agent=self.stopped_by_agent,
            message=self.error.message if self.error else self.last_words,
            traceback=self.error.traceback if self.error else None,
            stderr_tail=self.stderr_tail,
            stderr_log=self.stderr_log,
            error_file=self.error_file,
            attempt=self.attempt,
            restart_count=self.restart_count,
            hang=self.hang,
        )

    def to_json(self) -> dict[str, Any]:
        """JSON-able (the event log's and the store's record of it)."""
        return self.record().to_json()

    def ending(self) -> Ending:
        """As the root-cause rule sees it (``stopped_by_agent`` already
        says whether the agent ended it)."""
        return Ending(
            self.returncode,
            self.exit_monotonic,
            stopped_by_agent=self.stopped_by_agent,
            declared=self.hang is not None,
        )

    def brief(self) -> FailedWorker:
        return FailedWorker(
            rank=self.rank,
            exitcode=self.returncode if self.returncode >= 0 else None,
            signal=self.signal_name,
            role=self.role,
            stopped_by_agent=self.stopped_by_agent,
        )


def failure_record(failures: list[WorkerFailure], host: str) -> FailureRecord:
    """What this node reports for ``failures`` (as classify returns them): its
    root cause (else the first failure), with the traceback and stderr lines
    kept short for the store, and every failed worker in brief."""
    root = next((f for f in failures if f.role == ROOT_CAUSE), None)
    first = root or (failures[0] if failures else None)
    record = FailureRecord(host=host) if first is None else first.record()
    return replace(
        record,
        traceback=record.traceback[-MAX_TRACEBACK_CHARS:] if record.traceback else None,
        stderr_tail=tuple(ln[:MAX_TAIL_LINE_CHARS] for ln in record.stderr_tail[-MAX_TAIL_LINES:]),
        failures=tuple(f.brief() for f in failures),
    )


# What a process prints as it is torn down after its error (a C++ thread still
# joinable when the interpreter exits): never the error itself.
TEARDOWN_NOISE = ("terminate called without an active exception",)


def _last_line(lines: tuple[str, ...]) -> str:
    """The last non-blank line that is not teardown noise ("" if none)."""
    for line in reversed(lines):
        text = line.strip()
        if text and not text.startswith(TEARDOWN_NOISE):
            return text
    return ""


def classify(failures: list[WorkerFailure]) -> list[WorkerFailure]:
    """``failures`` marked by :func:`roles`, in the summary's order: the root
    cause, the other failures the agent did not cause, then those it caused,
    each by time."""
    endings = [f.ending() for f in failures]
    marked = [replace(f, role=r) for f, r in zip(failures, roles(endings), strict=True)]
    order = sorted(
        range(len(marked)),
        key=lambda i: (marked[i].role != ROOT_CAUSE, endings[i].by_agent, endings[i].at, i),
    )
    return [marked[i] for i in order]


def elsewhere(failures: list[WorkerFailure]) -> list[WorkerFailure]:
    """``failures`` when another node's failure came first: each of them
    collateral (its rank failed after the job's root cause)."""
    return [f if f.role != ROOT_CAUSE else replace(f, role=COLLATERAL) for f in failures]


def _count(n: int, noun: str) -> str:
    """``1 line``, ``3 lines``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _fmt_time(wall: float) -> str:
    t = time.localtime(wall)
    return time.strftime("%Y-%m-%d %H:%M:%S", t) + f".{int((wall % 1) * 1000):03d}"


def _title(f: WorkerFailure) -> str:
    if f.role == ROOT_CAUSE:
        title = "ROOT CAUSE"
    elif f.stopped_by_agent:
        title = "collateral (stopped by elastrun)"
    else:
        title = "collateral (failed after the root cause)"
    how = f.exit_description
    if f.hang is not None:
        how = f"hung, stopped by elastrun ({how})"
    return (
        f"[{title}] rank {f.rank} (local rank {f.local_rank}) on {printable(f.host or '?')}, "
        f"pid {f.pid}: {how} at {_fmt_time(f.exit_time)}"
    )


def _block(text: str) -> list[str]:
    """A multi-line text a worker wrote (a message, a traceback), one line
    each, made safe for the terminal (tabs kept, control characters escaped)."""
    return [printable(ln, lines=True) for ln in text.rstrip().splitlines()]


def _root_cause_lines(f: WorkerFailure, tail_lines: int) -> list[str]:
    """What the root cause said: its error file, else its last output lines."""
    lines: list[str] = []
    if f.error is not None:
        if f.error.message:
            first, *more = _block(f.error.message) or [""]
            lines.append(f"  error: {first}")
            lines.extend("    " + ln for ln in more)
        if f.error_file and os.path.isfile(f.error_file):
            lines.append(f"  error file: {f.error_file}")
        if f.error.traceback:
            lines.append("  traceback (from the error file):")
            lines.extend("    " + ln for ln in _block(f.error.traceback))
            return lines
    tail, stream = f.stderr_tail[-tail_lines:], "stderr"
    if not any(ln.strip() for ln in tail):
        tail, stream = f.stdout_tail[-tail_lines:], "stdout (nothing on stderr)"
    elif any(ln.strip() for ln in f.stdout_tail) and f.output_tail:
        # Both streams: its last output, whichever stream it went to.
        tail, stream = f.output_tail[-tail_lines:], "its output (stdout and stderr, in order)"
    if any(ln.strip() for ln in tail):
        lines.append(f"  last {_count(len(tail), 'line')} of {stream}:")
        lines.extend("    " + printable(ln, lines=True) for ln in tail)
    else:
        lines.append("  (no error file, and nothing on stderr or stdout)")
    return lines


def _log_lines(failures: list[WorkerFailure]) -> list[str]:
    """Where the full logs are."""
    lines: list[str] = []
    for f in failures:
        if f.role != ROOT_CAUSE:
            continue
        quiet_stderr = not any(ln.strip() for ln in f.stderr_tail)
        if quiet_stderr and f.stdout_log and any(ln.strip() for ln in f.stdout_tail):
            lines.append(f"full log of rank {f.rank}: {f.stdout_log}")
        elif f.stderr_log:
            lines.append(f"full log of rank {f.rank}: {f.stderr_log}")
    logged = [f.stderr_log for f in failures if f.stderr_log]
    if logged:
        attempt_dir = os.path.dirname(os.path.dirname(logged[0]))
        lines.append(f"logs of every local rank: {attempt_dir}/<local_rank>/stdout.log|stderr.log")
    elif failures:
        lines.append("full logs: the workers' output above (--log-dir keeps them in files)")
    return lines


def _peer_lines(peer: FailureRecord, tail_lines: int) -> list[str]:
    """The job's root cause on another node, from the record it reported."""
    when = f" at {_fmt_time(peer.time)}" if peer.time is not None else ""
    lines = [f"[ROOT CAUSE] on another node: {printable(peer.describe())}{when}"]
    if peer.message:
        first, *more = _block(peer.message) or [""]
        lines.append(f"  error: {first}")
        lines.extend("    " + ln for ln in more)
    if peer.traceback:
        lines.append("  traceback (from its error file):")
        lines.extend("    " + ln for ln in _block(peer.traceback))
    elif any(ln.strip() for ln in peer.stderr_tail):
        tail = peer.stderr_tail[-tail_lines:]
        lines.append(f"  last {_count(len(tail), 'line')} of its stderr:")
        lines.extend("    " + printable(ln, lines=True) for ln in tail)
    if peer.stderr_log:
        lines.append(f"  full log on {printable(peer.host or '?')}: {printable(peer.stderr_log)}")
    return lines


def format_summary(
    failures: list[WorkerFailure],
    header: str,
    tail_lines: int = 20,
    *,
    peer: FailureRecord | None = None,
) -> str:
    """The human summary, root cause first (``failures`` as returned by
    classify; ``peer``: the job's root cause when it is another node's, whose
    record is shown first). What the workers wrote (error files, output
    lines, another node's record) is escaped for the terminal: control
    characters become visible escapes (``\\x1b``), each line stays one line."""
    bar = "=" * 72
    lines = [bar, header, bar]
    if peer is not None:
        lines.extend(_peer_lines(peer, tail_lines))
    if not failures:
        lines.append("(no worker failed on this node)")
    for f in failures:
        lines.append(_title(f))
        if f.role == ROOT_CAUSE:
            lines.extend(_root_cause_lines(f, tail_lines))
            continue
        said = f.error.message if f.error is not None else f.last_words
        if said:
            lines.append(f"  said: {printable(said, limit=300)}")
    lines.extend(_log_lines(failures))
    lines.append(bar)
    return "\n".join(lines)


# ------------------------------------------------------- the lines about a round's end


def summary_title(result: RoundResult, root: FailureRecord | None = None) -> str:
    """The failure summary's title. With a restart left it is the one line
    that says why the round ended (:func:`round_end_line`: the job's root
    cause, ``root``), as every other node prints it; whether the restart
    counts is said once the next round formed (agent/restart_charge.py)."""
    if result.restart_count < result.max_restarts:
        return round_end_line(result, printable(failed_why(root)))
    spent = f"no restarts are left (max restarts {result.max_restarts})"
    if result.group_world_size <= 1:
        # No other node in the group: none can have been lost.
        return f"elastrun: workers failed and {spent}: the job fails"
    return (
        f"elastrun: workers failed and {spent}; the job goes on only if another "
        "node of the group was lost (this failure is then not counted)"
    )


def round_end_line(result: RoundResult, why: str) -> str:
    """The one console line that says why the workers restart, as the round
    ends: before the rendezvous charges the restart (or not), so no count."""
    return f"elastrun: round {result.round} ended: {why}; restarting workers"


def change_line(change: Change, result: RoundResult) -> str:
    """The one console line that says why this round ends."""
    if change.counts_as_restart:
        return round_end_line(result, change_why(change))
    return f"elastrun: re-forming: {change_why(change)}; not counted as a restart"


def failed_why(root: FailureRecord | None) -> str:
    """Why a round whose workers failed here ended, as its lines say it
    (``root``: the job's root cause; None: the agent stopped every failed
    rank itself). Not escaped: the record may be another node's."""
    return root.describe() if root is not None else "workers failed on this node"


def change_why(change: Change) -> str:
    """Why a round ended for ``change``, as its lines say it (not escaped:
    the detail is another node's)."""
    if change.counts_as_restart and not change.detail:
        return f"workers failed on another node ({change.reason})"
    return change.detail or change.reason.replace("_", " ")


def with_report(summary: str, report: str) -> str:
    """The failure summary with the features' report (the stacks) before its
    closing bar."""
    if not report:
        return summary
    head, _, bar = summary.rpartition("\n")
    return f"{head}\n{report}\n{bar}"
