"""Typed events of the catalogue for the timeline's tests, with the fields
the page does not draw filled in; and the line the event log holds for one."""

from __future__ import annotations

from typing import Any

from elastrun.event_kinds import (
    Event,
    FaultVerdict,
    JobFailed,
    JobFinished,
    NodeHealthFailed,
    NodeLost,
    NodeQuarantined,
    QuarantineRefused,
    RanksKept,
    Restart,
    RootCauseElsewhere,
    RoundOpened,
    SparePromoted,
    StandbyUsed,
    StoreHostLost,
    StoreTakeover,
    WorkerExited,
    WorkersStarted,
)
from elastrun.failure import FailureRecord
from elastrun.status.timeline import LoggedEvent


def opened(r: int, reason: str = "job_started") -> RoundOpened:
    return RoundOpened(round=r, reason=reason)


def started(r: int, world: int, restarts: int = 0) -> WorkersStarted:
    """Round ``r``'s workers started, the job having used ``restarts``."""
    return WorkersStarted(r, 0, restarts, [1], [0], [0], [False], world, 0, "h:1")


def exited(r: int, rank: int, exitcode: int | None = 1, cause: str = "root_cause") -> WorkerExited:
    return WorkerExited(r, 0, rank, 0, 4242, exitcode, None, cause, False)


def restart(r: int, count: int, reason: str = "worker_failed", counted: bool = True) -> Restart:
    return Restart(round=r, count=count, reason=reason, counted=counted)


def elsewhere(r: int) -> RootCauseElsewhere:
    return RootCauseElsewhere(r, 0, FailureRecord(), FailureRecord())


def lost(r: int, detail: str, by: str) -> NodeLost:
    return NodeLost(round=r, detail=detail, by=by)


def promoted(r: int, node: str, group_rank: int, replaces: str | None) -> SparePromoted:
    return SparePromoted(round=r, node=node, group_rank=group_rank, replaces=replaces)


def kept(r: int, ranks: list[int], pids: list[int], replaced: list[int]) -> RanksKept:
    return RanksKept(round=r, attempt=r, kept=ranks, kept_pids=pids, started=replaced)


def standby_used(r: int, rank: int, pid: int) -> StandbyUsed:
    return StandbyUsed(round=r, attempt=r, rank=rank, local_rank=rank, pid=pid, waited_s=1.0)


def took_over(term: int, address: str) -> StoreTakeover:
    return StoreTakeover(term, address, f"{address} hosts the store from term {term}")


def host_lost(term: int, address: str) -> StoreHostLost:
    return StoreHostLost(term, address, f"its host {address}: connection refused")


def finished() -> JobFinished:
    return JobFinished(exit_code=0, reason="workers_succeeded")


def failed(reason: str) -> JobFailed:
    return JobFailed(exit_code=1, reason=reason)


def verdict(r: int, summary: str, node: str = "h") -> FaultVerdict:
    return FaultVerdict(r, "node_fault", node, "RuntimeError: x", [r], summary, "quarantine")


def quarantined(host: str, until: float, reason: str) -> NodeQuarantined:
    return NodeQuarantined(quarantined_host=host, until=until, reason=reason, recorded=True)


def refused(host: str, until: float) -> QuarantineRefused:
    return QuarantineRefused(quarantined_host=host, until=until, reason="node fault")


def health_failed(command: str, when: str, reason: str) -> NodeHealthFailed:
    return NodeHealthFailed(command=command, when=when, reason=reason, output="")


def line(ts: float, event: Event, node_id: str = "", host: str = "h") -> dict[str, Any]:
    """The event as an agent's event log holds it (the sink's fields added)."""
    common = {"v": 1, "ts": ts, "kind": event.KIND, "source": "agent", "run_id": "j"}
    return {**common, "host": host, "node_id": node_id, **event.to_json()}


def logged(ts: float, event: Event, node_id: str = "", host: str = "h") -> LoggedEvent:
    return LoggedEvent(ts, event, node_id, host, "j")
