"""A job's summary as ``elastrun status`` shows it: typed, one shape for the
table (:func:`elastrun.status.show.render_table`) and ``--json``
(:meth:`Summary.to_json`, schema ``v``: ``SUMMARY_VERSION``, keys documented
in docs/events.md: keys may be added within a version, never removed or
changed).

Every string here may come from the store, which anyone who reaches it may
have written: the table escapes each for the terminal; ``--json`` is JSON.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from elastrun.failure import FailureRecord
from elastrun.frozen import frozen
from elastrun.goodput import Goodput
from elastrun.rendezvous import notes as N
from elastrun.rendezvous.fault_history import HealthFailure, JudgedFault
from elastrun.rendezvous.quarantine import QuarantineRecord
from elastrun.rendezvous.records import RoundState

__all__ = [
    "FAILURE_FIELDS",
    "JOB_STATES",
    "SUMMARY_VERSION",
    "TERMINAL_STATES",
    "HangStacks",
    "JoinedNode",
    "MemberRow",
    "RankRow",
    "Summary",
    "WaitingNode",
]

SUMMARY_VERSION = 1
JOB_STATES = ("joining", "running", "restarting", "finished", "failed")
TERMINAL_STATES = frozenset({"finished", "failed"})
# The fields of the last failure record that ``--json`` shows.
FAILURE_FIELDS = (
    "rank",
    "local_rank",
    "host",
    "pid",
    "exitcode",
    "signal",
    "time",
    "reason",
    "message",
    "attempt",
    "restart_count",
    "stderr_log",
)


@frozen
class MemberRow:
    """A member of the round shown, and what became of it."""

    group_rank: int
    host: str
    addr: str
    nproc: int
    node_id: str
    status: str  # alive | done | lost | gone
    role: str = ""  # its workers' --role ("" in results of older versions)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@frozen
class JoinedNode:
    """A node that joined the open round."""

    host: str
    node_id: str
    nproc: int

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@frozen
class WaitingNode:
    """A node that waits for the next round."""

    host: str
    node_id: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@frozen
class RankRow:
    """One rank's last reported progress (from its node's progress note)."""

    rank: int
    host: str
    step: int | None
    step_time_s: float | None
    own_time_s: float | None
    idle_s: float | None
    phase: str | None
    straggler: bool
    reported_at: float
    pid: int | None = None
    kept: bool | None = None  # its process kept from the last round (an in-process restart)
    # step is the script's own (heartbeat(step)); False: the process's optimizer steps
    reported: bool | None = None
    standby: bool | None = None  # its process was a standby's (set up before it had a rank)

    @classmethod
    def of(cls, p: N.RankProgress, note: N.ProgressNote) -> RankRow:
        return cls(
            rank=p.rank,
            host=note.host,
            step=p.step,
            step_time_s=p.step_time,
            own_time_s=p.own_time,
            idle_s=p.idle_s,
            phase=p.phase,
            straggler=False,
            reported_at=note.at,
            pid=p.pid,
            kept=p.kept,
            reported=p.reported,
            standby=p.standby,
        )

    def flagged(self, straggler: bool) -> RankRow:
        return dataclasses.replace(self, straggler=straggler)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@frozen
class HangStacks:
    """Where every rank sat when round ``round`` ended on a hang, ranks
    stuck in code of their own first."""

    round: int
    ranks: tuple[N.RankStack, ...]

    def to_json(self) -> dict[str, Any]:
        return {"round": self.round, "ranks": [r.to_json() for r in self.ranks]}


@frozen
class StoreHosts:
    """A store with candidate hosts (docs/failover.md): who hosts it, in
    which term, who stands by, and what the others answered."""

    term: int
    host: str
    standbys: tuple[str, ...]
    others: tuple[str, ...]  # "ADDR (fenced|refused|silent)"

    def describe(self) -> str:
        line = f"hosted by {self.host} (term {self.term}); standing by: "
        line += ", ".join(self.standbys) or "none"
        return line + "".join(f"; {other}" for other in self.others)

    def to_json(self) -> dict[str, Any]:
        return {
            "term": self.term,
            "host": self.host,
            "standbys": list(self.standbys),
            "others": list(self.others),
        }


@frozen
class Summary:
    """The job, as read from its records and notes (docs/events.md has each
    key of :meth:`to_json`)."""

    run_id: str
    state: str  # one of JOB_STATES
    round: int | None
    round_state: RoundState | None
    round_reason: str | None
    round_detail: str | None
    round_opened_at: float | None
    round_closed_at: float | None
    state_for_s: float | None
    members_round: int | None
    members: tuple[MemberRow, ...]
    master: str | None
    joined: tuple[JoinedNode, ...]
    waiting: tuple[WaitingNode, ...]
    nodes_present: int
    min_nodes: int | None
    max_nodes: int | None
    # --node-unit (1 when the job has none); spares: the waiting nodes that
    # cannot enlarge the running world (they replace a lost member).
    node_unit: int
    spares: tuple[WaitingNode, ...]
    restarts: int
    max_restarts: int | None
    last_failure: FailureRecord | None
    restart_pending: bool
    ranks: tuple[RankRow, ...]
    hang_stacks: HangStacks | None
    revision: int
    store_hosts: StoreHosts | None = None  # candidate hosts only
    goodput: Goodput | None = None  # group rank 0's agent's figures (its note)
    # Fault attribution (rendezvous/quarantine.py, fault_history.py): the
    # nodes kept out of the job (expired records too), and the script fault
    # that stopped it.
    quarantined: tuple[QuarantineRecord, ...] = ()
    fault_stopped: str | None = None
    # The last verdicts that were not transient (with what was done), and
    # the nodes whose health check failed (fault_history.py), oldest first.
    verdicts: tuple[JudgedFault, ...] = ()
    health_failures: tuple[HealthFailure, ...] = ()

    @property
    def world_size(self) -> int:
        return sum(m.nproc for m in self.members)

    @property
    def stragglers(self) -> list[int]:
        return [r.rank for r in self.ranks if r.straggler]

    def to_json(self) -> dict[str, Any]:
        failure = None
        if self.last_failure is not None:
            record = self.last_failure.to_json()
            failure = {name: record.get(name) for name in FAILURE_FIELDS}
        return {
            "v": SUMMARY_VERSION,
            "run_id": self.run_id,
            "state": self.state,
            "round": self.round,
            "round_state": self.round_state.value if self.round_state is not None else None,
            "round_reason": self.round_reason,
            "round_detail": self.round_detail,
            "round_opened_at": self.round_opened_at,
            "round_closed_at": self.round_closed_at,
            "state_for_s": self.state_for_s,
            "members_round": self.members_round,
            "members": [m.to_json() for m in self.members],
            "world_size": self.world_size,
            "master": self.master,
            "joined": [j.to_json() for j in self.joined],
            "waiting": [w.to_json() for w in self.waiting],
            "nodes_present": self.nodes_present,
            "min_nodes": self.min_nodes,
            "max_nodes": self.max_nodes,
            "node_unit": self.node_unit,
            "spares": [w.to_json() for w in self.spares],
            "restarts": self.restarts,
            "max_restarts": self.max_restarts,
            "last_failure": failure,
            "restart_pending": self.restart_pending,
            "ranks": [r.to_json() for r in self.ranks],
            "stragglers": self.stragglers,
            "hang_stacks": self.hang_stacks.to_json() if self.hang_stacks is not None else None,
            "revision": self.revision,
            "store_hosts": self.store_hosts.to_json() if self.store_hosts is not None else None,
            "goodput": self.goodput.to_json() if self.goodput is not None else None,
            "quarantined": [_quarantine_json(q) for q in self.quarantined],
            "fault_stopped": self.fault_stopped,
            "fault_verdicts": [v.to_json() for v in self.verdicts],
            "health_failures": [h.to_json() for h in self.health_failures],
        }

    def quiet(self) -> Summary:
        """Itself without what changes by itself (the duration, the revision):
        two summaries that differ only there show the same job."""
        return dataclasses.replace(self, state_for_s=None, revision=0)


def _quarantine_json(q: QuarantineRecord) -> dict[str, Any]:
    out = q.to_json()
    del out["v"]
    out["active"] = q.active(time.time())
    return out
