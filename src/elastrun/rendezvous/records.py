"""Building and reading the dynamic rendezvous' records (pure; no I/O).

The shapes of ``round`` and ``rounds/{R}/result`` (see :mod:`.keys` and
docs/rendezvous.md), config agreement, and the master port a joiner offers.
"""

from __future__ import annotations

import contextlib
import random
import socket
from collections.abc import Mapping, Sequence
from typing import Any

from elastrun.errors import RendezvousError
from elastrun.rendezvous import keys as K
from elastrun.rendezvous.api import Change, Member, RoundResult
from elastrun.rendezvous.ranks import Candidate, assign_ranks

__all__ = [
    "close_records",
    "config_diff",
    "first_round",
    "hang_round",
    "next_round_record",
    "pick_master_port",
    "round_change",
    "round_result",
]

Record = dict[str, Any]


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
    run_id: str, job: Mapping[str, Any], mine: Mapping[str, Any]
) -> tuple[str, dict[str, tuple[object, object]]] | None:
    """None when the node agrees with the job; else (message, field diffs).
    ``min_nodes``/``max_nodes`` are reported together as ``nnodes``."""
    diffs = {k: (job.get(k), v) for k, v in mine.items() if job.get(k) != v}
    if not diffs:
        return None
    parts: list[str] = []
    if "min_nodes" in diffs or "max_nodes" in diffs:
        job_n = f"{job.get('min_nodes')}:{job.get('max_nodes')}"
        my_n = f"{mine['min_nodes']}:{mine['max_nodes']}"
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


def first_round(opened_at: float) -> Record:
    """Round 0. ``opened_at`` (wall clock, every ``*_at``) is for people
    reading the records (``elastrun status``); no decision uses it."""
    return {
        "round": 0,
        "state": K.OPEN,
        "restarts": 0,
        "last_failure": None,
        "prev": [],
        "reason": "job_started",
        "detail": "",
        "counts": False,
        "opened_at": opened_at,
    }


def close_records(
    rnd: Record,
    joiners: Sequence[Record],
    max_nodes: int,
    reason: str,
    closed_at: float,
    *,
    max_restarts: int | None = None,
) -> tuple[Record, Record]:
    """(closed round record, result record) for open round ``rnd`` and its
    joiners in join order: the first ``max_nodes`` become members.

    A restart is charged here, when the round it opened closes, not when a
    node asks for it: a worker failure counts only if every member of the
    previous round is back. If one is missing, the failure was collateral of
    losing that node (its peers' collectives broke when it vanished, before
    its lease expired), and a membership change is never counted against the
    restart budget.
    When the charge overspends ``max_restarts``, the record returned is the
    job's FAILED record instead of a closed one."""
    records = list(joiners[:max_nodes])
    prev = {p["node_id"]: int(p["group_rank"]) for p in rnd.get("prev") or []}
    ranks = assign_ranks([Candidate(j["node_id"], j.get("rank_hint")) for j in records], prev)
    records.sort(key=lambda j: ranks[j["node_id"]])
    members = [
        {
            "node_id": j["node_id"],
            "host": j["host"],
            "addr": j["addr"],
            "nproc": int(j["nproc"]),
            "group_rank": ranks[j["node_id"]],
        }
        for j in records
    ]
    master = records[0]
    member_ids = {m["node_id"] for m in members}
    charged = bool(rnd.get("counts")) and prev.keys() <= member_ids
    restarts = int(rnd.get("restarts", 0)) + (1 if charged else 0)
    result = {
        "round": rnd["round"],
        "members": members,
        "master_addr": master["addr"],
        "master_port": int(master["port"]),
        "restarts": restarts,
        "charged": charged,
        "reason": reason,
        "opened_at": rnd.get("opened_at"),
        "closed_at": closed_at,
    }
    closed = {
        **rnd,
        "state": K.CLOSED,
        "members": [m["node_id"] for m in members],
        "restarts": restarts,
        "last_failure": rnd.get("pending_failure") if charged else rnd.get("last_failure"),
    }
    if max_restarts is not None and restarts > max_restarts:
        closed = {**closed, "state": K.FAILED, "restarts": restarts - 1}
    return closed, result


def next_round_record(
    rnd: Record,
    result: Record,
    reason: str,
    detail: str,
    *,
    counts: bool,
    failure: Mapping[str, Any] | None,
    opened_at: float,
) -> Record:
    """The record that opens round R+1 after closed round ``rnd`` (R).

    ``hang_round``: the last round that ended on a declared hang (R when
    ``failure`` is the hang watchdog's, else carried over): the one round
    whose stacks notes the agents and ``elastrun status`` show."""
    hung = counts and failure is not None and bool(failure.get("hang"))
    return {
        "round": int(rnd["round"]) + 1,
        "state": K.OPEN,
        # Charged when this round closes (see close_records), not now.
        "restarts": int(rnd.get("restarts", 0)),
        "last_failure": rnd.get("last_failure"),
        "pending_failure": dict(failure or {}) if counts else None,
        "prev": [
            {"node_id": m["node_id"], "group_rank": m["group_rank"]} for m in result["members"]
        ],
        "reason": reason,
        "detail": detail,
        "counts": counts,
        "opened_at": opened_at,
        "hang_round": int(rnd["round"]) if hung else hang_round(rnd),
    }


def hang_round(rec: Mapping[str, Any] | None) -> int | None:
    """The last round that ended on a declared hang, from a round record."""
    value = None if rec is None else rec.get("hang_round")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def round_result(run_id: str, node_id: str, result: Record, max_restarts: int) -> RoundResult:
    members = tuple(
        Member(m["node_id"], m["host"], m["addr"], int(m["group_rank"]), int(m["nproc"]))
        for m in result["members"]
    )
    me = next(m for m in members if m.node_id == node_id)
    return RoundResult(
        run_id=run_id,
        round=int(result["round"]),
        members=members,
        group_rank=me.group_rank,
        master_addr=result["master_addr"],
        master_port=int(result["master_port"]),
        restart_count=int(result.get("restarts", 0)),
        max_restarts=max_restarts,
        extra={"node_id": node_id, "reason": result.get("reason", "")},
    )


def round_change(rec: Record | None, reason: str = "", detail: str = "") -> Change:
    """Why a running member's round ended, from the job's round record."""
    if reason or rec is None:
        return Change(reason or "new_round", detail)
    r = rec.get("round")
    if rec.get("state") == K.OPEN:
        failure = rec.get("pending_failure")
        return Change(
            str(rec.get("reason") or "new_round"),
            str(rec.get("detail") or f"round {r} opened"),
            bool(rec.get("counts")),
            hang=isinstance(failure, dict) and bool(failure.get("hang")),
        )
    return Change("new_round", f"round {r} is {rec.get('state')} without this node")
