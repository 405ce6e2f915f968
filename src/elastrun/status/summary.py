"""A job's summary, derived from the dynamic rendezvous' records in its store.

Nothing here is written by ``elastrun status``: the summary is read from the
records the rendezvous keeps anyway (see :mod:`elastrun.rendezvous.keys`)::

    config                  min/max nodes, max restarts (the agreed settings)
    round                   current round number, state, restarts, last failure
    rounds/{R}/result       members of round R: host, address, group rank, nproc, role
    rounds/{R}/join/...     who joined the open round R
    rounds/{R}/done/...     members whose workers succeeded (exit barrier)
    nodes/...               presence (on each node's lease)
    waiting/...             nodes waiting for the next round
    notes/progress_{G}      step times of group rank G's workers (agent/stragglers.py)
    notes/stragglers        group rank 0's straggler verdicts for the round
    notes/stacks_{R}_{G}    its workers' stacks when round R ended on a hang (agent/hangs.py)
    quarantine/...          nodes kept out for a node fault (rendezvous/quarantine.py)
    faults                  the job's fault history (rendezvous/fault_history.py): the script
                            fault that stopped it, the last verdicts, failed health checks

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
untrusted, and read by the rendezvous' typed read
(:func:`~elastrun.rendezvous.note_access.find_note`): decoded within the bounds,
checked against its schema, and kept only when it is about that round and
comes from the member at that group rank, with that member's ranks. A rank
is flagged a straggler only when the ``stragglers`` note of the round shown
names it and its own progress note agrees (its own time above
``SLOW_RATIO`` times the median of the ranks shown). A bad record under a
per-node prefix is left out; a bad ``config``, ``round`` or result record is
a ProtocolError (the records' checks: :mod:`elastrun.rendezvous.records`).

The summary is a :class:`~.model.Summary`, which the table and ``--json``
(a JSON object with stable keys, schema ``v``: ``SUMMARY_VERSION``,
documented in docs/events.md) both print.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import statistics
import time
from collections.abc import Collection, Mapping
from typing import TypeVar

from elastrun.endpoint import Endpoint
from elastrun.errors import ProtocolError, StoreError
from elastrun.frozen import frozen
from elastrun.names import RunId
from elastrun.rendezvous import fault_history, quarantine
from elastrun.rendezvous import keys as K
from elastrun.rendezvous import notes as N
from elastrun.rendezvous.note_access import find_note
from elastrun.rendezvous.records import (
    AgreedSettings,
    ConfigRecord,
    JoinRecord,
    PresenceRecord,
    ResultRecord,
    RoundRecord,
    RoundState,
    WaitingRecord,
)
from elastrun.rendezvous.results import decode_whole
from elastrun.rendezvous.sizes import WorldSizes
from elastrun.status.model import (
    JOB_STATES,
    SUMMARY_VERSION,
    TERMINAL_STATES,
    HangStacks,
    JoinedNode,
    MemberRow,
    RankRow,
    Summary,
    WaitingNode,
)
from elastrun.store.base import Compare, Get, KeyValue, Store

__all__ = [
    "JOB_STATES",
    "SUMMARY_VERSION",
    "TERMINAL_STATES",
    "ShownNotes",
    "Summary",
    "read_summary",
    "summarize",
]

MAX_TRIES = 20  # the round record changed between our two reads this often: give up
MAX_NOTES = 4096  # notes read by key (one per member of the rounds shown, and one)
NOTE_READS = 16  # note reads in flight

_Rec = TypeVar("_Rec", JoinRecord, PresenceRecord, WaitingRecord)


def _records(kvs: list[KeyValue], kind: type[_Rec]) -> dict[str, _Rec]:
    """The per-node records under a prefix; one that is not a ``kind`` is left out."""
    out = {}
    for kv in kvs:
        with contextlib.suppress(ProtocolError):
            out[K.node_id_of(kv.key)] = kind.decode(kv.key, kv.value)
    return out


def job_state(rec: RoundRecord | None) -> str:
    """The job's state from its round record (one of ``JOB_STATES``)."""
    if rec is None:
        return "joining"
    if rec.state is RoundState.OPEN:
        return "restarting" if rec.prev else "joining"
    if rec.state is RoundState.CLOSED:
        return "running"
    return "finished" if rec.state is RoundState.FINISHED else "failed"


def _members(
    shown: ResultRecord | None, *, is_open: bool, state: str, dones: Collection[str],
    nodes: Collection[str],
) -> tuple[MemberRow, ...]:  # fmt: skip
    rows = []
    for m in shown.members if shown is not None else ():
        if not is_open and m.node_id in dones:
            status = "done"
        elif m.node_id in nodes:
            status = "alive"
        else:
            status = "lost" if state in ("running", "restarting") else "gone"
        rows.append(MemberRow(m.group_rank, m.host, m.addr, m.nproc, m.node_id, status, m.role))
    return tuple(sorted(rows, key=lambda m: m.group_rank))


def summarize(
    run_id: str,
    *,
    config: ConfigRecord | None,
    round_rec: RoundRecord | None,
    result: ResultRecord | None,
    prev_result: ResultRecord | None,
    joins: Mapping[str, JoinRecord],
    dones: Collection[str],
    nodes: Collection[str],
    waiting: Mapping[str, WaitingRecord],
    revision: int,
    now: float | None = None,
    notes: ShownNotes | None = None,
) -> Summary:
    """Pure: the records of one job -> its summary. ``nodes``: the node ids
    with a presence record; ``notes``: the notes shown, read typed and
    checked (:func:`read_notes`); ``now`` (wall clock; default: the current
    time) dates ``state_for_s``."""
    state = job_state(round_rec)
    is_open = round_rec is not None and round_rec.state is RoundState.OPEN
    opened_at = round_rec.opened_at if round_rec is not None else None
    closed_at = result.closed_at if result is not None and not is_open else None
    since = {"joining": opened_at, "restarting": opened_at, "running": closed_at}.get(state)
    now = time.time() if now is None else now
    # The members shown: the current round's when it is closed, else the last
    # closed round's (the group that is being re-formed).
    shown = prev_result if is_open else result
    members = _members(shown, is_open=is_open, state=state, dones=dones, nodes=nodes)
    settings = config.settings if config is not None else None
    waiters = tuple(
        sorted(
            (WaitingNode(w.host, nid) for nid, w in waiting.items()),
            key=lambda w: (w.host, w.node_id),
        )
    )
    failure = None
    if round_rec is not None:
        # A failure awaiting its charge (decided when the round it opened
        # closes: see rendezvous.rounds.close_records) is the newest one.
        failure = round_rec.pending_failure or round_rec.last_failure
    return Summary(
        run_id=run_id,
        state=state,
        round=round_rec.round if round_rec is not None else None,
        round_state=round_rec.state if round_rec is not None else None,
        round_reason=round_rec.reason if round_rec is not None else None,
        round_detail=(round_rec.detail or None) if round_rec is not None else None,
        round_opened_at=opened_at,
        round_closed_at=closed_at,
        state_for_s=None if since is None else round(max(0.0, now - since), 3),
        members_round=shown.round if shown is not None else None,
        members=members,
        master=_master(shown),
        joined=tuple(
            sorted(
                (JoinedNode(j.node.host, nid, j.node.nproc) for nid, j in joins.items()),
                key=lambda j: (j.host, j.node_id),
            )
        )
        if is_open
        else (),
        waiting=waiters,
        nodes_present=len(nodes),
        min_nodes=settings.min_nodes if settings is not None else None,
        max_nodes=settings.max_nodes if settings is not None else None,
        node_unit=settings.node_unit if settings is not None else 1,
        spares=_spares(waiters, settings, result if state == "running" else None),
        restarts=round_rec.restarts if round_rec is not None else 0,
        max_restarts=settings.max_restarts if settings is not None else None,
        last_failure=failure,
        # Only an open round has a charge still to decide: a closed record
        # keeps the failure that opened it, already counted (or not, when a
        # node was lost) in "restarts".
        restart_pending=is_open and round_rec is not None and round_rec.pending_failure is not None,
        ranks=rank_progress(notes or ShownNotes()),
        hang_stacks=hang_stacks(notes or ShownNotes()),
        revision=revision,
        goodput=notes.goodput.figures if notes is not None and notes.goodput else None,
    )


def _spares(
    waiters: tuple[WaitingNode, ...], settings: AgreedSettings | None, running: ResultRecord | None
) -> tuple[WaitingNode, ...]:
    """The waiting nodes that are spares: beside a running round they cannot
    enlarge (``--nnodes``, ``--node-unit``: :class:`WorldSizes`)."""
    if settings is None or running is None or not waiters:
        return ()
    sizes = WorldSizes(settings.min_nodes, settings.max_nodes, settings.node_unit)
    return () if sizes.room(len(running.members), len(waiters)) else waiters


def _master(shown: ResultRecord | None) -> str | None:
    if shown is None or not shown.master_addr:
        return None
    return str(Endpoint(shown.master_addr, shown.master_port))


def _seats(result: ResultRecord | None) -> dict[int, N.Seat]:
    """The members of a round, from its result record."""
    if result is None:
        return {}
    return N.seats((m.node_id, m.group_rank, m.nproc) for m in result.members)


@frozen
class ShownNotes:
    """The notes a summary shows, each read typed and checked
    (:func:`~elastrun.rendezvous.note_access.find_note`): the progress notes
    of the round shown from its members, its ``stragglers`` verdict, and the
    stacks notes of the round that last ended on a hang from its members."""

    progress: tuple[N.ProgressNote, ...] = ()
    stragglers: N.StragglersNote | None = None
    stacks: tuple[N.StacksNote, ...] = ()
    goodput: N.GoodputNote | None = None  # group rank 0's agent's figures


def rank_progress(notes: ShownNotes) -> tuple[RankRow, ...]:
    """Per-rank step times of the round shown, from its members' progress
    notes (agent/stragglers.py), ordered by rank; stragglers flagged."""
    rows = [RankRow.of(p, note) for note in notes.progress for p in note.ranks]
    rows.sort(key=lambda row: row.rank)
    verdict = notes.stragglers
    return flag(rows, set() if verdict is None else {s.rank for s in verdict.stragglers})


def flag(rows: list[RankRow], named: set[int]) -> tuple[RankRow, ...]:
    """The rows, those of the ranks ``named`` whose own time is above
    ``SLOW_RATIO`` times the median own time of all rows flagged (the
    stragglers note's verdict, checked against the members' own notes)."""
    times = [row.own_time_s for row in rows if row.own_time_s]
    if len(times) < 2:
        return tuple(rows)
    median = statistics.median(times)
    return tuple(
        row.flagged(
            row.rank in named
            and row.own_time_s is not None
            and row.own_time_s > N.SLOW_RATIO * median
        )
        for row in rows
    )


def hang_stacks(notes: ShownNotes) -> HangStacks | None:
    """Every rank's stack when the round the round record names (its
    ``hang_round``) ended on a hang, from that round's members' notes
    (agent/hangs.py)."""
    ranks = [r for note in notes.stacks for r in note.ranks]
    if not ranks:
        return None
    ranks.sort(key=lambda x: (x.in_torch, x.rank))
    return HangStacks(notes.stacks[0].round, tuple(ranks))


async def read_notes(
    store: Store, keys: K.Keys, shown: ResultRecord | None, hang_result: ResultRecord | None
) -> ShownNotes:
    """The notes the records call for (at most ``MAX_NOTES``), each read by its
    key (``NOTE_READS`` in flight), typed and checked: of the round ``shown``,
    its members' progress and its stragglers verdict; of ``hang_result``'s
    round, its members' stacks. Those absent, not decodable within the note
    limits, or refused are left out. Raises StoreError."""
    gate = asyncio.Semaphore(NOTE_READS)

    async def one(kind: type[N.NoteT], round_: int, seat: N.Seat | None) -> N.NoteT | None:
        async with gate:
            found = await find_note(store, keys, kind, round_, seat)
        return found if isinstance(found, kind) else None

    async def each(kind: type[N.NoteT], round_: int, seats: list[N.Seat]) -> tuple[N.NoteT, ...]:
        found = await asyncio.gather(*(one(kind, round_, seat) for seat in seats))
        return tuple(n for n in found if n is not None)

    async def nothing() -> None:
        return None

    room = MAX_NOTES
    shown_seats = list(_seats(shown).values())[:room]
    room -= len(shown_seats)
    verdict = one(N.StragglersNote, shown.round, None) if shown and room > 0 else nothing()
    room -= 1
    goodput = one(N.GoodputNote, shown.round, None) if shown and room > 0 else nothing()
    room -= 1
    hang_seats = list(_seats(hang_result).values())[: max(0, room)]
    progress, stragglers, stacks, figures = await asyncio.gather(
        each(N.ProgressNote, shown.round if shown else 0, shown_seats),
        verdict,
        each(N.StacksNote, hang_result.round if hang_result else 0, hang_seats),
        goodput,
    )
    return ShownNotes(progress, stragglers, stacks, figures)


async def _under(store: Store, prefix: str) -> list[KeyValue]:
    kvs, _ = await store.get_prefix(prefix)
    return kvs


_Top = TypeVar("_Top", ConfigRecord, RoundRecord)


def _one(kind: type[_Top], kvs: list[KeyValue]) -> _Top | None:
    return kind.decode(kvs[0].key, kvs[0].value) if kvs else None


def _result_ops(k: K.Keys, r: int) -> list[Get]:
    """A round's result: its header and every shard (rendezvous/results.py)."""
    return [Get(k.result(r)), Get(k.shards(r), prefix=True)]


def _result(gets: list[list[KeyValue]]) -> ResultRecord | None:
    """The whole result read by :func:`_result_ops` (None: no such round)."""
    header_kvs, shard_kvs = gets
    if not header_kvs:
        return None
    return decode_whole(header_kvs[0], shard_kvs)


async def read_summary(store: Store, run_id: RunId) -> Summary | None:
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
            rec = RoundRecord.decode(round_kv.key, round_kv.value)
            r, h = rec.round, rec.hang_round
        ops = [Get(k.config), Get(k.round)]
        if r is not None:
            ops += _result_ops(k, r) + _result_ops(k, r - 1)
        if h is not None:
            ops += _result_ops(k, h)
        res = await store.txn([guard], ops)
        if not res.succeeded:
            continue  # the round moved on between the two reads: read again
        config_kvs, round_kvs = res.gets[:2]
        if not config_kvs and not round_kvs:
            return None
        result = prev = hang_result = None
        joins: dict[str, JoinRecord] = {}
        dones: set[str] = set()
        if r is not None:
            result = _result(res.gets[2:4])
            prev = _result(res.gets[4:6]) if r > 0 else None
            hang_result = _result(res.gets[6:8]) if h is not None else None
            joins = _records(await _under(store, k.joins(r)), JoinRecord)
            dones = {K.node_id_of(kv.key) for kv in await _under(store, k.dones(r))}
        round_rec = _one(RoundRecord, round_kvs)
        is_open = round_rec is not None and round_rec.state is RoundState.OPEN
        summary = summarize(
            run_id,
            config=_one(ConfigRecord, config_kvs),
            round_rec=round_rec,
            result=result,
            prev_result=prev,
            joins=joins,
            dones=dones,
            nodes=_records(await _under(store, k.nodes), PresenceRecord).keys(),
            waiting=_records(await _under(store, k.waiting_prefix), WaitingRecord),
            revision=res.revision,
            notes=await read_notes(store, k, prev if is_open else result, hang_result),
        )
        history = await fault_history.read(store, k)
        return dataclasses.replace(
            summary,
            quarantined=tuple(await quarantine.listed(store, k)),
            fault_stopped=history.stopped or None,
            verdicts=history.verdicts,
            health_failures=history.health,
        )
    raise StoreError(
        f"the round record of job {run_id!r} changed {MAX_TRIES} times while reading it; try again"
    )
