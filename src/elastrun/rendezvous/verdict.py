"""The verdict on the job's failures: a node fault, a script fault, or transient (pure).

The rule reads the job's history of root causes (:mod:`.fault_history`: one
entry per failed round, the same on every node) and looks at its last
``limit`` entries (``--fault-limit``, default 2):

* **script fault**: the same failure (exception type and message, or exit
  code, or signal) of the same rank, a failure of the script's own
  (:data:`~elastrun.failure.ERROR`: an exception or a non-zero exit), at
  about the same step (at most :data:`STEP_TOLERANCE` apart) when every
  entry's step is known, else on more than one node (the rank moved and the
  failure followed it);
* **node fault**: every one of them a failure of a rank of one node by
  itself (``own``: not a collective a peer broke, not ranks the agent
  stopped), of the same class (the same kind and the same exception type,
  signal or exit code; the message may differ), and not a script fault;
* anything else, including fewer than ``limit`` entries: **transient**.

Why a script fault wins over a node fault when both could hold (one node,
one rank, the same exception at the same step): a failing node does not
fail at the same step with the same Python exception; a deterministic bug
does. The converse case, a step not known (no progress reported), stays a
node fault until the rank moves: the node is excluded, a spare (or another
node) takes the rank, and the bug, following the rank, is a script fault at
its next failure. The cost of that mistake is one quarantined node, bounded
in time; the cost of the other (stopping a job for a node fault) is the job.

Safety (docs/reliability.md, *Fault attribution*): a node is judged faulty
only when the job's root cause, which the rounds' members agreed on
(:mod:`.root_cause`, preferring a rank that failed by itself over one whose
collective broke), was a failure of its own in each of the last ``limit``
failed rounds. A collateral failure (a peer's crash broke this node's
collective; the agent stopped its ranks) is never ``own``, and any such
entry, or any other node's entry, among the last ``limit`` breaks the run.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from elastrun.failure import ERROR
from elastrun.frozen import frozen
from elastrun.rendezvous.fault_history import FaultEntry

__all__ = ["DEFAULT_LIMIT", "STEP_TOLERANCE", "Verdict", "VerdictKind", "judge"]

DEFAULT_LIMIT = 2  # identical failures that make a verdict
# Steps apart that are "about the same step". A rank's step is exact (its
# progress file is written as its script raises: its heartbeat(step), else the
# optimizer steps or batches since it started), and a deterministic bug fails
# at the very same one after each start from the same checkpoint; a failing
# node seldom does, and a step apart is a node's failure, not a script's.
STEP_TOLERANCE = 0


class VerdictKind(enum.StrEnum):
    NODE = "node_fault"
    SCRIPT = "script_fault"
    TRANSIENT = "transient"


@frozen
class Verdict:
    """What the rule found, with what names it: the node (a node fault), the
    rank, the step and the failure (a script fault), and the failed rounds."""

    kind: VerdictKind
    host: str = ""
    rank: int | None = None
    step: int | None = None
    what: str = ""  # the failure: "ValueError: bad batch", "killed by SIGBUS"
    rounds: tuple[int, ...] = ()

    def summary(self) -> str:
        """One line every node prints for this verdict (the text may come
        from the store: escape it where it reaches a terminal)."""
        n = len(self.rounds)
        if self.kind is VerdictKind.SCRIPT:
            at = f"step {self.step}" if self.step is not None else "the same step"
            hosts = "" if not self.host else f" (last on {self.host})"
            return (
                f"script fault: {self.what} in rank {self.rank} at {at}, "
                f"{n} identical failures{hosts}"
            )
        if self.kind is VerdictKind.NODE:
            return f"node fault: node {self.host} failed {n} times in a row ({self.what})"
        return "transient failure"


def _signature(e: FaultEntry) -> tuple[object, ...]:
    return (e.kind, e.exception, e.message, e.exitcode, e.signal)


def _failure_class(e: FaultEntry) -> tuple[object, ...]:
    return (e.kind, e.exception, e.exitcode, e.signal)


def _same_place(last: Sequence[FaultEntry]) -> bool:
    """At about the same step when every step is known; else on more than
    one node (the rank moved, the failure followed it)."""
    steps = [e.step for e in last]
    known = [s for s in steps if s is not None]
    if len(known) == len(steps):
        return max(known) - min(known) <= STEP_TOLERANCE
    return len({e.host for e in last}) > 1


def judge(history: Sequence[FaultEntry], limit: int = DEFAULT_LIMIT) -> Verdict:
    """The verdict on the failed rounds ``history`` (oldest first), from its
    last ``limit`` entries (``limit`` < 1: always transient)."""
    if limit < 1 or len(history) < limit:
        return Verdict(VerdictKind.TRANSIENT)
    last = list(history[-limit:])
    first = last[0]
    rounds = tuple(e.round for e in last)
    if not all(e.own for e in last):
        return Verdict(VerdictKind.TRANSIENT, rounds=rounds)
    what = last[-1].what()
    same = all(_signature(e) == _signature(first) for e in last)
    if (
        same
        and first.kind == ERROR
        and first.rank is not None
        and all(e.rank == first.rank for e in last)
        and _same_place(last)
    ):
        return Verdict(
            VerdictKind.SCRIPT,
            host=last[-1].host,
            rank=first.rank,
            step=last[-1].step,
            what=what,
            rounds=rounds,
        )
    if all(e.host == first.host for e in last) and all(
        _failure_class(e) == _failure_class(first) for e in last
    ):
        return Verdict(VerdictKind.NODE, host=first.host, what=what, rounds=rounds)
    return Verdict(VerdictKind.TRANSIENT, rounds=rounds)
