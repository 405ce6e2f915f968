"""Building the dynamic rendezvous' records from one another (pure; no I/O).

How a round opens, closes and charges its restart, from the typed records of
:mod:`.records`: the first round, the close (members, ranks, the charge),
the next round after a close, the :class:`~.api.RoundResult` and
:class:`~.api.Change` the agent sees; config agreement; and the master port a
joiner offers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import socket
from collections.abc import Sequence

from elastrun.errors import RendezvousError
from elastrun.failure import FailureRecord
from elastrun.frozen import frozen
from elastrun.rendezvous.api import Change, GroupShape, Member, RoundResult
from elastrun.rendezvous.ranks import Candidate, assign_ranks
from elastrun.rendezvous.records import (
    TAKEOVER_REASON,
    AgreedSettings,
    JoinRecord,
    MemberRecord,
    PrevMember,
    ResultRecord,
    RoundRecord,
    RoundState,
)
from elastrun.rendezvous.results import Head
from elastrun.rendezvous.sizes import WorldSizes, choose_members

__all__ = [
    "Carry",
    "close_records",
    "config_diff",
    "first_round",
    "next_round_record",
    "partial_result",
    "pick_master_port",
    "round_change",
    "round_result",
    "takeover_round",
]


def pick_master_port(addr: str = "") -> int:
    """A TCP port free on this host, preferably outside the kernel's ephemeral
    range (so outgoing connections cannot take it before the workers bind)."""
    low = 32768
    with (
        contextlib.suppress(OSError, ValueError),
        open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f,
    ):
        low = int(f.read().split()[0])
    candidates = [random.randint(20000, low - 1) for _ in range(8)] if low > 20100 else []
    for port in [*candidates, 0]:
        for host in (addr, ""):
            try:
                family = socket.AF_INET6 if ":" in host else socket.AF_INET
                with socket.socket(family, socket.SOCK_STREAM) as s:
                    s.bind((host, port))
                    return int(s.getsockname()[1])
            except OSError:
                continue
    raise RendezvousError("could not find a free TCP port for MASTER_PORT on this host")


def config_diff(
    run_id: str, job: AgreedSettings, mine: AgreedSettings
) -> tuple[str, dict[str, tuple[object, object]]] | None:
    """None when the node agrees with the job; else (message, field diffs).
    ``min_nodes``/``max_nodes`` are reported together as ``nnodes``."""
    diffs: dict[str, tuple[object, object]] = {}
    for f in dataclasses.fields(AgreedSettings):
        theirs, ours = getattr(job, f.name), getattr(mine, f.name)
        if theirs != ours:
            diffs[f.name] = (theirs, ours)
    if not diffs:
        return None
    parts: list[str] = []
    if "min_nodes" in diffs or "max_nodes" in diffs:
        job_n = f"{job.min_nodes}:{job.max_nodes}"
        my_n = f"{mine.min_nodes}:{mine.max_nodes}"
        parts.append(f"nnodes: job has {job_n}, this node has {my_n}")
    for name, (theirs, ours) in diffs.items():
        if name not in ("min_nodes", "max_nodes"):
            parts.append(f"{name}: job has {theirs!r}, this node has {ours!r}")
    message = (
        f"this node's settings differ from those of job {run_id!r}: "
        + "; ".join(parts)
        + ". Start every node of a job with the same settings (or use a new --rdzv-id)."
    )
    return message, diffs


def first_round(opened_at: float) -> RoundRecord:
    """Round 0. ``opened_at`` (wall clock, every ``*_at``) is for people
    reading the records (``elastrun status``); no decision uses it."""
    return RoundRecord(round=0, state=RoundState.OPEN, reason="job_started", opened_at=opened_at)


def close_records(
    rnd: RoundRecord,
    joiners: Sequence[JoinRecord],
    max_nodes: int,
    reason: str,
    closed_at: float,
    *,
    max_restarts: int | None = None,
    unit: int = 1,
) -> tuple[RoundRecord, ResultRecord]:
    """(closed round record, result record) for open round ``rnd`` and its
    joiners in join order. The members are as many as the largest allowed
    world size (a multiple of ``unit``, at most ``max_nodes``) the joiners
    reach, chosen by :func:`.sizes.choose_members` (the previous round's
    members first); the others wait as spares. Ranks are sticky
    (:mod:`.ranks`): a survivor keeps its group rank, a spare that replaces a
    lost member takes that member's rank.

    A restart is charged here, when the round it opened closes, not when a
    node asks for it: a worker failure counts only if every member of the
    previous round is back. If one is missing, the failure was collateral of
    losing that node (its peers' collectives broke when it vanished, before
    its lease expired), and a membership change is never counted against the
    restart budget.
    When the charge overspends ``max_restarts``, the record returned is the
    job's FAILED record instead of a closed one."""
    prev = {p.node_id: p.group_rank for p in rnd.prev}
    # The decider closes only once the smallest allowed size joined; the
    # fallback (no allowed size) keeps a round closable whatever it is given.
    size = WorldSizes(1, max_nodes, unit).fit(len(joiners)) or min(len(joiners), max_nodes)
    ids = {i: j.node.node_id for i, j in enumerate(joiners)}
    records = choose_members(joiners, ids, prev, size)
    ranks = assign_ranks([Candidate(j.node.node_id, j.node.rank_hint) for j in records], prev)
    records.sort(key=lambda j: ranks[j.node.node_id])
    nodes = [j.node for j in records]
    members = tuple(
        MemberRecord(n.node_id, n.host, n.addr, n.nproc, ranks[n.node_id], n.role) for n in nodes
    )
    master = records[0]
    charged = rnd.counts and prev.keys() <= {m.node_id for m in members}
    restarts = rnd.restarts + (1 if charged else 0)
    result = ResultRecord(
        round=rnd.round,
        members=members,
        master_addr=master.node.addr,
        master_port=master.port,
        restarts=restarts,
        charged=charged,
        reason=reason,
        opened_at=rnd.opened_at,
        closed_at=closed_at,
    )
    closed = dataclasses.replace(
        rnd,
        state=RoundState.CLOSED,
        restarts=restarts,
        last_failure=rnd.pending_failure if charged else rnd.last_failure,
    )
    if max_restarts is not None and restarts > max_restarts:
        closed = dataclasses.replace(closed, state=RoundState.FAILED, restarts=restarts - 1)
    return closed, result


def next_round_record(
    rnd: RoundRecord,
    result: ResultRecord,
    reason: str,
    detail: str,
    *,
    counts: bool,
    failure: FailureRecord | None,
    opened_at: float,
    reporter: str | None = None,
) -> RoundRecord:
    """The record that opens round R+1 after closed round ``rnd`` (R).

    ``hang_round``: the last round that ended on a declared hang (R when
    ``failure`` is the hang watchdog's, else carried over): the one round
    whose stacks notes the agents and ``elastrun status`` show.
    ``reporter``: the node whose ``failure`` this is (the first of the
    round's reporters)."""
    hung = counts and failure is not None and bool(failure.hang)
    return RoundRecord(
        round=rnd.round + 1,
        state=RoundState.OPEN,
        # Charged when this round closes (see close_records), not now.
        restarts=rnd.restarts,
        last_failure=rnd.last_failure,
        pending_failure=failure if counts else None,
        prev=tuple(PrevMember(m.node_id, m.group_rank) for m in result.members),
        reason=reason,
        detail=detail,
        counts=counts,
        opened_at=opened_at,
        hang_round=rnd.round if hung else rnd.hang_round,
        reporters=(reporter,) if counts and failure is not None and reporter else (),
    )


@frozen
class Carry:
    """What a node carries into the store of a new host after a takeover
    (docs/failover.md): its last closed round, the job's restarts used then,
    and that round's members with their group ranks (sticky ranks)."""

    round: int
    restarts: int
    prev: tuple[PrevMember, ...]

    @classmethod
    def of(cls, result: RoundResult) -> Carry:
        prev = tuple(PrevMember(m.node_id, m.group_rank) for m in result.members)
        return cls(result.round, result.restart_count, prev)


def takeover_round(
    carry: Carry, found: RoundRecord | None, detail: str, opened_at: float
) -> RoundRecord:
    """The round a node opens in a new host's store: after its last round,
    never before what the store holds, with the restarts carried (the most
    of the two). A membership change: not charged."""
    restarts = max(carry.restarts, found.restarts if found is not None else 0)
    return RoundRecord(
        round=max(carry.round, found.round if found is not None else -1) + 1,
        state=RoundState.OPEN,
        restarts=restarts,
        last_failure=found.last_failure if found is not None else None,
        prev=carry.prev,
        reason=TAKEOVER_REASON,
        detail=detail,
        opened_at=opened_at,
    )


def round_result(run_id: str, node_id: str, result: ResultRecord, max_restarts: int) -> RoundResult:
    """Round ``result`` as member ``node_id`` sees it."""
    members = tuple(
        Member(m.node_id, m.host, m.addr, m.group_rank, m.nproc, m.role) for m in result.members
    )
    me = next(m for m in members if m.node_id == node_id)
    return RoundResult(
        run_id=run_id,
        round=result.round,
        members=members,
        group_rank=me.group_rank,
        master_addr=result.master_addr,
        master_port=result.master_port,
        restart_count=result.restarts,
        max_restarts=max_restarts,
        reason=result.reason,
        charged=result.charged,
    )


def partial_result(run_id: str, head: Head, max_restarts: int) -> RoundResult:
    """Round ``head``'s result as its member sees it from its own place
    (:attr:`~.api.RoundResult.shape`: the round's sizes)."""
    h, seat = head.header, head.mine
    if seat is None:
        raise RendezvousError(f"round {h.round}'s result does not name this node")
    m = seat.member
    return RoundResult(
        run_id=run_id,
        round=h.round,
        members=(Member(m.node_id, m.host, m.addr, m.group_rank, m.nproc, m.role),),
        group_rank=m.group_rank,
        master_addr=h.master_addr,
        master_port=h.master_port,
        restart_count=h.restarts,
        max_restarts=max_restarts,
        reason=h.reason,
        charged=h.charged,
        shape=GroupShape(h.size, h.world_size, seat.rank_base, seat.role_base, seat.role_size),
    )


def round_change(rec: RoundRecord | None, reason: str = "", detail: str = "") -> Change:
    """Why a running member's round ended, from the job's round record."""
    if reason or rec is None:
        return Change(reason or "new_round", detail)
    if rec.state is RoundState.OPEN:
        return Change(
            rec.reason or "new_round",
            rec.detail or f"round {rec.round} opened",
            rec.counts,
            hang=rec.hung,
        )
    return Change("new_round", f"round {rec.round} is {rec.state.value} without this node")
