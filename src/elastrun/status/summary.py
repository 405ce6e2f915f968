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
    notes/stragglers        group rank 0's straggler verdicts for the round
    notes/stacks_{R}_{G}    its workers' stacks when round R ended on a hang (agent/hangs.py)

The records by key (config, round, the round results shown) are read in one
transaction (one store revision), guarded by the ``round`` record's revision
so that the round and its result agree. The per-node records (``nodes/``,
``waiting/``, the round's joins and dones) are prefix reads, which the
embedded store's client reads in pages under the store's answer limit.

Notes are never read by prefix: each note shown is read by its own key, one
at a time (``NOTE_READS`` in flight), and only the notes the records call
for: ``progress_{G}`` of each member of the round shown, ``stragglers``, and
``stacks_{H}_{G}`` of each member of round H, the last round the round
record says ended on a hang (``hang_round``). So however many bytes of notes
the store holds (an attacker's junk included), status reads at most one
note per member and round shown, each within the note limit. Each is
untrusted (:mod:`elastrun.rendezvous.notes`): decoded within the bounds,
checked against its schema, and kept only when it is about that round and
comes from the member at that group rank, with that member's ranks. A rank
is flagged a straggler only when the ``stragglers`` note of the round shown
names it and its own progress note agrees (its own time above
``SLOW_RATIO`` times the median of the ranks shown). A bad record under a
per-node prefix is left out; a bad ``config``, ``round`` or result record is
a ProtocolError.

The summary is a JSON object with stable keys (schema ``v``:
``SUMMARY_VERSION``), documented in docs/events.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import Iterable
from typing import Any, TypeVar

from elastrun.endpoint import Endpoint
from elastrun.errors import ProtocolError, StoreError
from elastrun.names import RunId
from elastrun.rendezvous import keys as K
from elastrun.rendezvous import notes as N
from elastrun.rendezvous.records import hang_round
from elastrun.store.base import Compare, Get, KeyValue, Store
from elastrun.untrusted import UntrustedData

__all__ = ["JOB_STATES", "SUMMARY_VERSION", "TERMINAL_STATES", "read_summary", "summarize"]

SUMMARY_VERSION = 1
JOB_STATES = ("joining", "running", "restarting", "finished", "failed")
TERMINAL_STATES = frozenset({"finished", "failed"})
MAX_TRIES = 20  # the round record changed between our two reads this often: give up
MAX_NOTES = 4096  # notes read by key (one per member of the rounds shown, and one)
NOTE_READS = 16  # note reads in flight

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
    """The per-node records under a prefix; one that does not decode is left out."""
    out = {}
    for kv in kvs:
        with contextlib.suppress(ProtocolError):
            out[K.node_id_of(kv.key)] = K.decode(kv.key, kv.value)
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
    hang_result: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Pure: the records of one job -> its summary (stable keys). ``now``
    (wall clock; default: the current time) dates ``state_for_s``;
    ``hang_result``: the result record of the round's ``hang_round``."""
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
        "hang_stacks": hang_stacks(notes or {}, hang_result),
        "revision": revision,
    }


def _seats(result: dict[str, Any] | None) -> dict[int, N.Seat]:
    """The members of a round, from its result record (none if malformed)."""
    members = (result or {}).get("members")
    if not isinstance(members, list):
        return {}
    try:
        return N.seats((str(m["node_id"]), int(m["group_rank"]), int(m["nproc"])) for m in members)
    except (TypeError, KeyError, ValueError):
        return {}


_Note = TypeVar("_Note", N.ProgressNote, N.StacksNote)


def _member_note(
    notes: dict[str, dict[str, Any]], name: str, kind: type[_Note], round_: int, seat: N.Seat
) -> _Note | None:
    """The note ``name`` when it is a ``kind`` of round ``round_`` from ``seat``;
    None when absent or refused."""
    raw = notes.get(name)
    if raw is None:
        return None
    try:
        return kind.from_json(raw).check(round_, seat)
    except UntrustedData:
        return None


def _stragglers(notes: dict[str, dict[str, Any]], round_: int) -> set[int]:
    """The ranks the ``stragglers`` note of round ``round_`` names."""
    raw = notes.get(N.STRAGGLERS)
    try:
        verdict = None if raw is None else N.StragglersNote.from_json(raw)
    except UntrustedData:
        return set()
    if verdict is None or verdict.round != round_:
        return set()
    return {s.rank for s in verdict.stragglers}


def rank_progress(
    notes: dict[str, dict[str, Any]], shown: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """Per-rank step times of the round shown, from its members' progress
    notes (agent/stragglers.py), ordered by rank; stragglers flagged."""
    if shown is None or not isinstance(shown.get("round"), int):
        return []
    r = shown["round"]
    out: list[dict[str, Any]] = []
    for seat in _seats(shown).values():
        note = _member_note(notes, N.progress_name(seat.group_rank), N.ProgressNote, r, seat)
        if note is None:
            continue
        for p in note.ranks:
            out.append(
                {
                    "rank": p.rank,
                    "host": note.host,
                    "step": p.step,
                    "step_time_s": p.step_time,
                    "own_time_s": p.own_time,
                    "idle_s": p.idle_s,
                    "phase": p.phase,
                    "straggler": False,
                    "reported_at": note.at,
                }
            )
    out.sort(key=lambda row: row["rank"])
    flag(out, _stragglers(notes, r))
    return out


def flag(rows: list[dict[str, Any]], named: set[int]) -> None:
    """Flag the rows of the ranks ``named`` whose own time is above
    ``SLOW_RATIO`` times the median own time of all rows (the stragglers
    note's verdict, checked against the members' own notes)."""
    times = [row["own_time_s"] for row in rows if row["own_time_s"]]
    if len(times) < 2:
        return
    median = statistics.median(times)
    for row in rows:
        own = row["own_time_s"]
        row["straggler"] = row["rank"] in named and own is not None and own > N.SLOW_RATIO * median


def hang_stacks(
    notes: dict[str, dict[str, Any]], hang_result: dict[str, Any] | None
) -> dict[str, Any] | None:
    """Every rank's stack when round ``hang_result`` ended on a hang (the round
    record's ``hang_round``), from that round's members' notes (agent/hangs.py)."""
    if hang_result is None or not isinstance(hang_result.get("round"), int):
        return None
    h = hang_result["round"]
    ranks: list[dict[str, Any]] = []
    for seat in _seats(hang_result).values():
        note = _member_note(notes, N.stacks_name(h, seat.group_rank), N.StacksNote, h, seat)
        ranks += [s.to_json() for s in note.ranks] if note is not None else []
    if not ranks:
        return None
    ranks.sort(key=lambda x: (bool(x["in_torch"]), x["rank"]))
    return {"round": h, "ranks": ranks}


def note_names(shown: dict[str, Any] | None, hang_result: dict[str, Any] | None) -> list[str]:
    """The notes the summary shows: those the round records call for."""
    names = [N.progress_name(g) for g in _seats(shown)] + [N.STRAGGLERS]
    if hang_result is not None and isinstance(hang_result.get("round"), int):
        names += [N.stacks_name(hang_result["round"], g) for g in _seats(hang_result)]
    return names[:MAX_NOTES]


async def read_notes(store: Store, keys: K.Keys, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The notes ``names``, each read by its key (``NOTE_READS`` in flight);
    those absent or not decodable within the note limits are left out."""
    gate = asyncio.Semaphore(NOTE_READS)
    out: dict[str, dict[str, Any]] = {}

    async def one(name: str) -> None:
        async with gate:
            kv = await store.get(keys.note(name))
        if kv is not None:
            with contextlib.suppress(UntrustedData):
                out[name] = N.decode(name, kv.value)

    await asyncio.gather(*(one(n) for n in names))
    return out


async def _under(store: Store, prefix: str) -> list[KeyValue]:
    kvs, _ = await store.get_prefix(prefix)
    return kvs


async def read_summary(store: Store, run_id: RunId) -> dict[str, Any] | None:
    """The job's summary, or None when the store holds no job ``run_id``.
    Raises StoreError (ProtocolError for bad records)."""
    k = K.Keys(run_id)
    for _ in range(MAX_TRIES):
        round_kv = await store.get(k.round)
        h = None
        if round_kv is None:
            guard = Compare.absent(k.round)
            r = None
        else:
            guard = Compare.unchanged(k.round, round_kv.mod_revision)
            rec = K.decode(round_kv.key, round_kv.value)
            r, h = int(rec["round"]), hang_round(rec)
        ops = [Get(k.config), Get(k.round)]
        if r is not None:
            ops += [Get(k.result(r)), Get(k.result(r - 1))]
        if h is not None:
            ops += [Get(k.result(h))]
        res = await store.txn([guard], ops)
        if not res.succeeded:
            continue  # the round moved on between the two reads: read again
        config_kvs, round_kvs = res.gets[:2]
        if not config_kvs and not round_kvs:
            return None
        result = prev = hang_result = None
        joins: dict[str, dict[str, Any]] = {}
        dones: set[str] = set()
        if r is not None:
            result, prev = _one(res.gets[2]), _one(res.gets[3]) if r > 0 else None
            hang_result = _one(res.gets[4]) if h is not None else None
            joins = _records(await _under(store, k.joins(r)))
            dones = {K.node_id_of(kv.key) for kv in await _under(store, k.dones(r))}
        round_rec = _one(round_kvs)
        is_open = round_rec is not None and round_rec.get("state") == K.OPEN
        names = note_names(prev if is_open else result, hang_result)
        return summarize(
            run_id,
            config=_one(config_kvs),
            round_rec=round_rec,
            result=result,
            prev_result=prev,
            joins=joins,
            dones=dones,
            nodes=_records(await _under(store, k.nodes)),
            waiting=_records(await _under(store, k.waiting_prefix)),
            revision=res.revision,
            notes=await read_notes(store, k, names),
            hang_result=hang_result,
        )
    raise StoreError(
        f"the round record of job {run_id!r} changed {MAX_TRIES} times while reading it; try again"
    )
