"""A job's summary, derived from the dynamic rendezvous' records in its store.

Nothing here is written by ``elastrun status``: the summary is read from the
records the rendezvous keeps anyway (see :mod:`elastrun.rendezvous.keys`)::

    config                  min/max nodes, max restarts (the agreed settings)
    round                   current round number, state, restarts, last failure
    rounds/{R}/result       members of round R: host, address, group rank, nproc
    rounds/{R}/join/...     who joined the open round R
    rounds/{R}/done/...     members whose workers succeeded (exit barrier)
    nodes/...               presence (on each node's lease)
    waiting/...             nodes waiting for the next round

Everything is read in one transaction (one store revision), guarded by the
``round`` record's revision so that the round and its result agree. The
summary is a JSON object with stable keys (schema ``v``: ``SUMMARY_VERSION``),
documented in docs/events.md.
"""

from __future__ import annotations

import time
from typing import Any

from elastrun.endpoint import Endpoint
from elastrun.errors import ProtocolError, StoreError
from elastrun.rendezvous import keys as K
from elastrun.store.base import Compare, Get, KeyValue, Store

__all__ = ["JOB_STATES", "SUMMARY_VERSION", "TERMINAL_STATES", "read_summary", "summarize"]

SUMMARY_VERSION = 1
JOB_STATES = ("joining", "running", "restarting", "finished", "failed")
TERMINAL_STATES = frozenset({"finished", "failed"})
MAX_TRIES = 20  # the round record changed between our two reads this often: give up

_FAILURE_FIELDS = (
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


def _records(kvs: list[KeyValue]) -> dict[str, dict[str, Any]]:
    return {K.node_id_of(kv.key): K.decode(kv.key, kv.value) for kv in kvs}


def _one(kvs: list[KeyValue]) -> dict[str, Any] | None:
    return K.decode(kvs[0].key, kvs[0].value) if kvs else None


def job_state(rec: dict[str, Any] | None) -> str:
    """The job's state from its round record (one of ``JOB_STATES``)."""
    if rec is None:
        return "joining"
    state = rec.get("state")
    if state == K.OPEN:
        return "restarting" if rec.get("prev") else "joining"
    if state == K.CLOSED:
        return "running"
    if state == K.FINISHED:
        return "finished"
    if state == K.FAILED:
        return "failed"
    raise ProtocolError(f"the job's round record has an unknown state {state!r}")


def _wall(value: Any) -> float | None:
    """A record's wall-clock time (absent in records of older nodes)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _failure(raw: Any) -> dict[str, Any] | None:
    if not isinstance(raw, dict):
        return None
    return {name: raw.get(name) for name in _FAILURE_FIELDS}


def summarize(
    run_id: str,
    *,
    config: dict[str, Any] | None,
    round_rec: dict[str, Any] | None,
    result: dict[str, Any] | None,
    prev_result: dict[str, Any] | None,
    joins: dict[str, dict[str, Any]],
    dones: set[str],
    nodes: dict[str, dict[str, Any]],
    waiting: dict[str, dict[str, Any]],
    revision: int,
    now: float | None = None,
) -> dict[str, Any]:
    """Pure: the records of one job -> its summary (stable keys). ``now``
    (wall clock; default: the current time) dates ``state_for_s``."""
    settings = (config or {}).get("settings") or {}
    state = job_state(round_rec)
    rnd = int(round_rec["round"]) if round_rec is not None else None
    is_open = round_rec is not None and round_rec.get("state") == K.OPEN
    opened_at = _wall(round_rec.get("opened_at")) if round_rec is not None else None
    closed_at = _wall(result.get("closed_at")) if result is not None and not is_open else None
    since = {"joining": opened_at, "restarting": opened_at, "running": closed_at}.get(state)
    now = time.time() if now is None else now
    # The members shown: the current round's when it is closed, else the last
    # closed round's (the group that is being re-formed).
    shown = prev_result if is_open else result
    members: list[dict[str, Any]] = []
    for m in (shown or {}).get("members") or []:
        nid = str(m["node_id"])
        if not is_open and nid in dones:
            status = "done"
        elif nid in nodes:
            status = "alive"
        else:
            status = "lost" if state in ("running", "restarting") else "gone"
        members.append(
            {
                "group_rank": int(m["group_rank"]),
                "host": m.get("host"),
                "addr": m.get("addr"),
                "nproc": int(m.get("nproc", 0)),
                "node_id": nid,
                "status": status,
            }
        )
    members.sort(key=lambda m: m["group_rank"])
    master = None
    if shown is not None and shown.get("master_addr"):
        addr, port = str(shown["master_addr"]), shown.get("master_port")
        master = str(Endpoint(addr, port)) if isinstance(port, int) else addr
    return {
        "v": SUMMARY_VERSION,
        "run_id": run_id,
        "state": state,
        "round": rnd,
        "round_state": round_rec.get("state") if round_rec is not None else None,
        "round_reason": round_rec.get("reason") if round_rec is not None else None,
        "round_detail": (round_rec.get("detail") or None) if round_rec is not None else None,
        "round_opened_at": opened_at,
        "round_closed_at": closed_at,
        "state_for_s": None if since is None else round(max(0.0, now - since), 3),
        "members_round": int(shown["round"]) if shown is not None else None,
        "members": members,
        "world_size": sum(m["nproc"] for m in members),
        "master": master,
        "joined": sorted(
            (
                {"host": j.get("host"), "node_id": nid, "nproc": j.get("nproc")}
                for nid, j in joins.items()
            ),
            key=lambda j: (str(j["host"]), j["node_id"]),
        )
        if is_open
        else [],
        "waiting": sorted(
            ({"host": w.get("host"), "node_id": nid} for nid, w in waiting.items()),
            key=lambda w: (str(w["host"]), w["node_id"]),
        ),
        "nodes_present": len(nodes),
        "min_nodes": settings.get("min_nodes"),
        "max_nodes": settings.get("max_nodes"),
        "restarts": int(round_rec.get("restarts", 0)) if round_rec is not None else 0,
        "max_restarts": settings.get("max_restarts"),
        # A failure awaiting its charge (decided when the round it opened
        # closes: see rendezvous.records.close_records) is the newest one.
        "last_failure": _failure(round_rec.get("pending_failure") or round_rec.get("last_failure"))
        if round_rec
        else None,
        # Only an open round has a charge still to decide: a closed record
        # keeps the failure that opened it, already counted (or not, when a
        # node was lost) in "restarts".
        "restart_pending": bool(is_open and round_rec and round_rec.get("pending_failure")),
        "revision": revision,
    }


async def read_summary(store: Store, run_id: str) -> dict[str, Any] | None:
    """The job's summary at one store revision, or None when the store holds
    no job ``run_id``. Raises StoreError (ProtocolError for bad records)."""
    k = K.Keys(run_id)
    for _ in range(MAX_TRIES):
        round_kv = await store.get(k.round)
        if round_kv is None:
            guard = Compare.absent(k.round)
            r = None
        else:
            guard = Compare.unchanged(k.round, round_kv.mod_revision)
            r = int(K.decode(round_kv.key, round_kv.value)["round"])
        ops = [Get(k.config), Get(k.round), Get(k.nodes, True), Get(k.waiting_prefix, True)]
        if r is not None:
            ops += [Get(k.result(r)), Get(k.result(r - 1)), Get(k.joins(r), True)]
            ops += [Get(k.dones(r), True)]
        res = await store.txn([guard], ops)
        if not res.succeeded:
            continue  # the round moved on between the two reads: read again
        config_kvs, round_kvs, node_kvs, waiting_kvs = res.gets[:4]
        if not config_kvs and not round_kvs:
            return None
        result = prev = None
        joins: dict[str, dict[str, Any]] = {}
        dones: set[str] = set()
        if r is not None:
            result_kvs, prev_kvs, join_kvs, done_kvs = res.gets[4:8]
            result, prev = _one(result_kvs), _one(prev_kvs) if r > 0 else None
            joins = _records(join_kvs)
            dones = {K.node_id_of(kv.key) for kv in done_kvs}
        return summarize(
            run_id,
            config=_one(config_kvs),
            round_rec=_one(round_kvs),
            result=result,
            prev_result=prev,
            joins=joins,
            dones=dones,
            nodes=_records(node_kvs),
            waiting=_records(waiting_kvs),
            revision=res.revision,
        )
    raise StoreError(
        f"the round record of job {run_id!r} changed {MAX_TRIES} times while reading it; try again"
    )
