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
    notes/progress_{G}      step times of group rank G's workers (agent/stragglers.py)
    notes/stacks_{R}_{G}    its workers' stacks when round R ended on a hang (agent/hangs.py)

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
MAX_NOTES = 1024  # progress and stacks notes read (one per node and round)
MAX_NOTE_BYTES = 256 * 1024

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


def _notes(kvs: list[KeyValue], prefix: str) -> dict[str, dict[str, Any]]:
    out = {}
    for kv in kvs[:MAX_NOTES]:
        if len(kv.value) > MAX_NOTE_BYTES:
            continue
        try:
            value = K.decode(kv.key, kv.value)
        except (ProtocolError, ValueError):
            continue
        if isinstance(value, dict):
            out[kv.key[len(prefix) :]] = value
    return out


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
    notes: dict[str, dict[str, Any]] | None = None,
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
        "ranks": (ranks := rank_progress(notes or {}, shown)),
        "stragglers": [r["rank"] for r in ranks if r["straggler"]],
        "hang_stacks": hang_stacks(notes or {}),
        "revision": revision,
    }


def _num(value: Any) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return float(value) if ok else None


def rank_progress(
    notes: dict[str, dict[str, Any]], shown: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """Per-rank step times of the round shown, from the agents' progress notes
    (agent/stragglers.py), ordered by rank."""
    if shown is None:
        return []
    out = []
    for name, note in notes.items():
        if not name.startswith("progress_") or note.get("round") != shown.get("round"):
            continue
        for r in note.get("ranks") or ():
            if not isinstance(r, dict) or not isinstance(r.get("rank"), int):
                continue
            out.append(
                {
                    "rank": r["rank"],
                    "host": str(note.get("host") or ""),
                    "step": r.get("step") if isinstance(r.get("step"), int) else None,
                    "step_time_s": _num(r.get("step_time")),
                    "own_time_s": _num(r.get("own_time")),
                    "idle_s": _num(r.get("idle_s")),
                    "phase": r.get("phase") if isinstance(r.get("phase"), str) else None,
                    "straggler": r.get("straggler") is True,
                    "reported_at": _wall(note.get("at")),
                }
            )
    return sorted(out, key=lambda r: r["rank"])


def hang_stacks(notes: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Every rank's stack at the job's last declared hang (agent/hangs.py)."""
    rounds: dict[int, list[Any]] = {}
    for name, note in notes.items():
        r = note.get("round")
        ranks = note.get("ranks")
        if name.startswith("stacks_") and isinstance(r, int) and isinstance(ranks, list):
            rounds.setdefault(r, []).extend(ranks)
    if not rounds:
        return None
    last = max(rounds)
    ranks = [x for x in rounds[last] if isinstance(x, dict) and isinstance(x.get("rank"), int)]
    ranks.sort(key=lambda x: (bool(x.get("in_torch")), x["rank"]))
    return {"round": last, "ranks": ranks}


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
        ops += [Get(k.note("progress_"), True), Get(k.note("stacks_"), True)]
        if r is not None:
            ops += [Get(k.result(r)), Get(k.result(r - 1)), Get(k.joins(r), True)]
            ops += [Get(k.dones(r), True)]
        res = await store.txn([guard], ops)
        if not res.succeeded:
            continue  # the round moved on between the two reads: read again
        config_kvs, round_kvs, node_kvs, waiting_kvs, progress_kvs, stacks_kvs = res.gets[:6]
        if not config_kvs and not round_kvs:
            return None
        result = prev = None
        joins: dict[str, dict[str, Any]] = {}
        dones: set[str] = set()
        if r is not None:
            result_kvs, prev_kvs, join_kvs, done_kvs = res.gets[6:10]
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
            notes=_notes([*progress_kvs, *stacks_kvs], k.note("")),
        )
    raise StoreError(
        f"the round record of job {run_id!r} changed {MAX_TRIES} times while reading it; try again"
    )
