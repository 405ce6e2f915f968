"""One node's store I/O around the driver's state: what it reads and what it writes.

The driver (:mod:`.dynamic`) keeps what this node knows in one place, the
:class:`Observer`: the phase's :class:`~.plan.View` and what this node's own
writes found (``round_seen``: ``round`` as a txn of this node compared or read
it, a snapshot the next phase starts from; ``joined``: this node's last join;
``barrier_seen``: what its done txn read). Two parts work on it:

* the reads (:class:`Observer`): the few reads that turning the view into rule
  events needs -- a closed round's result, whether a member that is gone put
  its done key -- and what the planner (:mod:`.plan`, pure) says the view
  means:

  * the round record -> ``RoundOpen`` / ``RoundClosed`` / ``RoundFinished`` /
    ``RoundFailed``;
  * joins and presence keys -> ``JoinersChanged`` (the decider's input);
  * running members' change detection: a member's presence gone without its
    done key -> ``MemberLost``; a waiting node -> ``NodeWaiting``;
  * the exit barrier: every member of the round done (``BarrierDone``); for
    the barrier's watcher, a done key or a presence key gone; for the others,
    the watcher's presence gone (lost, or left: pick the watcher again).

  A per-node key that holds no node's record is left out as if absent, with
  one line (:mod:`.damage`); a damaged round result is the job's verdict
  (:class:`~elastrun.errors.RecordDamaged`).
* the writes (:class:`Executor`): the rules' actions (one class each,
  :mod:`.protocol`), matched on their class. Every write to the job's
  ``round`` record is a compare-and-set against the revision this node last
  saw; whether it won or lost, the outcome comes back through the phase's
  watch on ``round`` as an ordinary event. Actions that end a call
  (``ReturnResult``, ``ReturnChange``, ``Return``, ``Raise``) produce an
  :class:`Outcome`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import assert_never

from elastrun.clock import Clock
from elastrun.endpoint import Endpoint
from elastrun.errors import RendezvousError, RendezvousTimeout, StoreError
from elastrun.event_kinds import (
    JobMarkedFailed,
    JobMarkedFinished,
    NodeJoined,
    NodeLost,
    NodeWaiting,
    RoundClosed,
    RoundJoined,
    RoundOpened,
    SparePromoted,
)
from elastrun.events import EventSink
from elastrun.failure import FailureRecord
from elastrun.frozen import frozen
from elastrun.rendezvous import keys as K
from elastrun.rendezvous import notes as N
from elastrun.rendezvous import plan as P
from elastrun.rendezvous import results as R
from elastrun.rendezvous import rounds
from elastrun.rendezvous.api import Change, Member, RendezvousSettings, RoundResult
from elastrun.rendezvous.barrier_plan import BarrierSeen
from elastrun.rendezvous.damage import JunkLog, NodeKind, agreed
from elastrun.rendezvous.keys import KeysMemo
from elastrun.rendezvous.protocol import (
    Action,
    Arm,
    Cancel,
    CloseRound,
    Event,
    Join,
    Leave,
    MarkFinished,
    OpenRound,
    PutDone,
    Raise,
    ReadRound,
    RenewLease,
    Return,
    ReturnChange,
    ReturnResult,
    Revoke,
    Timer,
    Wait,
)
from elastrun.rendezvous.records import (
    DONE,
    JoinRecord,
    MemberRecord,
    NodeInfo,
    PresenceRecord,
    ResultRecord,
    RoundRecord,
    RoundState,
    WaitingRecord,
)
from elastrun.rendezvous.reports import call_error, spare, waiting_reason
from elastrun.rendezvous.results import (
    Head,
    ResultHeader,
    ResultShard,
    shard_count,
    shard_of,
    stored_form,
)
from elastrun.rendezvous.rules import Rules
from elastrun.rendezvous.sizes import promotions
from elastrun.store.base import Compare, Count, Delete, Get, KeyValue, Op, Put, Store, WatchEvent
from elastrun.store.keepalive import LeaseKeeper

__all__ = [
    "DecodedResult",
    "Executor",
    "Node",
    "Observer",
    "Outcome",
    "decode_part",
    "decode_whole",
    "read",
]


@frozen
class Node:
    """This node's identity and handles, shared by the driver's parts."""

    store: Store
    settings: RendezvousSettings
    keys: K.Keys
    node_id: str
    host: str
    addr: str
    clock: Clock
    events: EventSink
    pid: int

    def info(self) -> NodeInfo:
        """This node, as its presence and join records describe it."""
        s = self.settings
        return NodeInfo(
            node_id=self.node_id,
            host=self.host,
            addr=self.addr,
            nproc=s.nproc,
            rank_hint=s.node_rank_hint,
            pid=self.pid,
            role=s.role,
        )


async def read(store: Store, key: str, prefix: bool) -> tuple[list[KeyValue], int]:
    """The key (or prefix) and the store revision of the read (watch from rev + 1)."""
    res = await store.txn([], [Get(key, prefix)])
    return res.gets[0], res.revision


@frozen
class DecodedResult:
    """A round's result as read: the checked record, its members as
    :class:`~.api.Member` values and each member's group rank; ``extra``:
    the keys under its shards' prefix that are none of its shards (left out)."""

    record: ResultRecord
    members: tuple[Member, ...]
    ranks: dict[str, int]
    extra: tuple[KeyValue, ...] = ()


def _decoded(record: ResultRecord) -> DecodedResult:
    members = tuple(
        Member(m.node_id, m.host, m.addr, m.group_rank, m.nproc, m.role) for m in record.members
    )
    return DecodedResult(record, members, {m.node_id: m.group_rank for m in members})


def _whole(kvs: tuple[KeyValue, ...]) -> DecodedResult:
    record, extra = R.decode_result(kvs[0], kvs[1:])
    return dataclasses.replace(_decoded(record), extra=tuple(extra))


def _part(kvs: tuple[KeyValue, ...]) -> tuple[ResultHeader, ResultShard]:
    header = ResultHeader.decode(kvs[0].key, kvs[0].value)
    return header, ResultShard.decode(kvs[1].key, kvs[1].value, header)


# A round's whole result (its header, then every shard), decoded and checked,
# with its members; and a header with one shard: once per process for the
# same bytes. A damaged one is the job's verdict (RecordDamaged).
decode_whole = KeysMemo(agreed(_whole, "round result"), size=2)  # O(n): this round, the last
decode_part = KeysMemo(agreed(_part, "round result"), size=2 * 64)  # a round's shards, the next
decode_header = agreed(ResultHeader.decode, "round result")


class Observer:
    """What this node knows -- the driver's state: the phase's view, and what
    its own writes found (``round_seen``, ``joined``, ``barrier_seen``: set
    by the :class:`Executor` and the registration, taken by the next phase)
    -- and the reads that turn it, and what watches tell, into rule events."""

    def __init__(self, node: Node, rules: Rules) -> None:
        self.node = node
        self.rules = rules
        self.view = P.View()
        # Set when the phase must be set up again (my predecessor left).
        self.resnap = False
        # Everyone seen joining, (round, node id) -> host: the join-timeout message.
        self.joiner_hosts: dict[tuple[int, str], str] = {}
        # (round, store revision) of this node's last successful join.
        self.joined: tuple[int, int] | None = None
        # The last round's result this node read (by round).
        self.decoded: dict[int, DecodedResult] = {}
        # ``round`` as a write of this node's found it (a txn that compared
        # it unchanged, or read it), and that txn's revision: a snapshot the
        # next phase takes instead of reading ``round`` again (once).
        self.round_seen: tuple[KeyValue, int] | None = None
        # What this node's done txn read for the exit barrier (once).
        self.barrier_seen: BarrierSeen | None = None
        # Per-node keys left out (they hold no node's record): their lines.
        self.junk = JunkLog(node.events, node.node_id)

    # -- per-node keys: those that hold no node's record are left out ----------
    def _kinds(self) -> dict[P.Watched, tuple[str, NodeKind]]:
        k, r = self.node.keys, self.round
        nodes, joins = (k.nodes, PresenceRecord), (k.joins(r), JoinRecord)
        return {
            P.Watched.NODES: nodes,
            P.Watched.WATCHER: nodes,
            P.Watched.JOINS: joins,
            P.Watched.PREDECESSOR: joins,
            P.Watched.WAITING: (k.waiting_prefix, WaitingRecord),
        }

    def records(self, watched: P.Watched, kvs: Iterable[KeyValue]) -> list[KeyValue]:
        """The keys of ``kvs`` (read for ``watched``) that hold a node's
        record; each other is left out, with its line."""
        prefix, kind = self._kinds()[watched]
        return self.junk.keep(prefix, kvs, kind)

    def new_view(self) -> P.View:
        """A fresh view for a new phase (round results are kept: immutable;
        those of this round and the one before, so a long job's rounds do not
        pile up: O(n) each)."""
        old, since = self.view, self.round - 1
        self.view = P.View(
            heads={r: h for r, h in old.heads.items() if r >= since},
            results={r: x for r, x in old.results.items() if r >= since},
        )
        return self.view

    @property
    def round(self) -> int:
        return self.rules.ctx.round

    # -- the round's result -------------------------------------------------
    def _no_result(self, r: int) -> RendezvousError:
        return RendezvousError(f"round {r} is closed but has no result record")

    async def get_head(self, r: int) -> Head:
        """Round ``r``'s header and this node's place in it (O(1) bytes: its
        own shard; one read where the shard count is the job's)."""
        view = self.view
        if r in view.heads:
            return view.heads[r]
        store, k, me = self.node.store, self.node.keys, self.node.node_id
        shards = shard_count(self.node.settings.max_nodes)
        res = await store.txn([], [Get(k.result(r)), Get(k.shard(r, shard_of(me, shards)))])
        header_kvs, shard_kvs = res.gets
        if not header_kvs:
            raise self._no_result(r)
        header = decode_header(header_kvs[0].key, header_kvs[0].value)
        if header.shards != shards:  # not this job's count: its own shard
            one = await store.get(k.shard(r, shard_of(me, header.shards)))
            shard_kvs = [one] if one is not None else []
        if not shard_kvs:
            raise RendezvousError(f"round {r}'s result has no shard for this node ({me})")
        header, shard = decode_part((header_kvs[0], shard_kvs[0]))
        view.heads[r] = Head.find(header, shard, me)
        return view.heads[r]

    async def get_result(self, r: int) -> ResultRecord:
        """Round ``r``'s whole result (O(n) bytes: every shard, in one read)."""
        return (await self.get_decoded(r)).record

    async def get_decoded(self, r: int) -> DecodedResult:
        """Round ``r``'s whole result with its members (read once per node,
        decoded once per process)."""
        view = self.view
        decoded = self.decoded.get(r)
        if decoded is not None and view.results.get(r) is decoded.record:
            return decoded
        if r in view.results:  # this node's own close
            decoded = _decoded(view.results[r])
        else:
            k = self.node.keys
            res = await self.node.store.txn([], [Get(k.result(r)), Get(k.shards(r), prefix=True)])
            header_kvs, shard_kvs = res.gets
            if not header_kvs:
                raise self._no_result(r)
            decoded = decode_whole((header_kvs[0], *shard_kvs))
            view.results[r] = decoded.record
            for kv in decoded.extra:
                self.junk.left_out(kv, f"store key {kv.key} is not a shard of round {r}'s result")
        if r not in view.heads:
            shards = shard_count(self.node.settings.max_nodes)
            view.heads[r] = Head.of(decoded.record, self.node.node_id, shards)
        self.decoded = {r: decoded}
        return decoded

    async def round_event(self) -> Event | None:
        view = self.view
        needed = P.result_needed(view)
        if needed is not None:
            if P.whole_needed(view):
                await self.get_result(needed)
            else:
                await self.get_head(needed)
        node = self.node
        s = node.settings
        return P.round_event(
            view,
            node.node_id,
            node.host,
            s.max_nodes,
            unit=s.node_unit,
            now=node.clock.monotonic(),
        )

    # -- joiners (for the join-timeout message) ---------------------------------
    def saw_joiners(self, r: int, kvs: Iterable[KeyValue]) -> None:
        for kv in kvs:
            host = JoinRecord.decode(kv.key, kv.value).node.host
            self.joiner_hosts[(r, K.node_id_of(kv.key))] = host

    async def note_joiners(self, r: int) -> None:
        """Remember who joined round ``r`` (for the join-timeout message): the
        joiners this node saw, and those in the store now."""
        with contextlib.suppress(StoreError):
            joins, _ = await read(self.node.store, self.node.keys.joins(r), True)
            self.saw_joiners(r, self.records(P.Watched.JOINS, joins))

    # -- members: losses and the exit barrier ------------------------------------
    async def finished(self, node_id: str) -> bool:
        """Whether a member put its done key for this round (it left after
        its workers succeeded: not a loss)."""
        if node_id in self.view.done:
            return True
        key = self.node.keys.done(self.round, node_id)
        if await self.node.store.get(key) is not None:
            self.view.done.add(node_id)
            return True
        return False

    async def members_done(self, r: int) -> int:
        """How many members of round ``r`` put their done key (every done key
        and every member read: O(n) bytes). A key under the done prefix that
        names no member is left out, with its line (anyone may put one there:
        counted, it would pass the barrier before the members are done)."""
        prefix = self.node.keys.dones(r)
        dones, _ = await read(self.node.store, prefix, True)
        members = {m.node_id for m in (await self.get_result(r)).members}
        for kv in dones:
            name = kv.key[len(prefix) :]
            if name in members:
                self.view.done.add(name)
            else:
                self.junk.left_out(kv, f"store key {kv.key} is no done key of a member")
        return len(self.view.done & members)

    async def lost_event(self, member: MemberRecord) -> Event:
        """``member`` is gone: lost, or it left the job on purpose (its
        ``left`` key: its agent stopped)."""
        left = await self.node.store.get(self.node.keys.left(member.node_id)) is not None
        return P.lost_event(member, left=left)

    async def lost_events(self) -> list[Event]:
        if self.round in self.view.heads:
            await self.get_result(self.round)  # who is absent: every member
        absent = P.absent_members(self.view, self.round)
        return [await self.lost_event(m) for m in absent if not await self.finished(m.node_id)]

    # -- watch events ------------------------------------------------------------
    async def translate(self, watched: P.Watched, wev: WatchEvent) -> list[Event]:
        """Rule events for one event of the phase's watch on ``watched``."""
        r, now = self.round, self.node.clock.monotonic()
        s = self.node.settings
        if wev.type == "put" and watched in self._kinds() and not self.records(watched, [wev.kv]):
            wev = WatchEvent("delete", wev.kv)  # it holds no node's record: as if absent
        reaction = P.react(
            self.view, watched, wev, r=r, now=now, max_nodes=s.max_nodes, unit=s.node_unit
        )
        if watched is P.Watched.JOINS and wev.type == "put":
            self.saw_joiners(r, [wev.kv])
        if isinstance(reaction, list):
            return reaction
        if isinstance(reaction, P.RoundChanged):
            ev = await self.round_event()
            return [] if ev is None else [ev]
        if isinstance(reaction, P.Resnap):
            self.resnap = True
            return []
        if not await self.finished(reaction.member.node_id):
            return [await self.lost_event(reaction.member)]
        if reaction.resnap:
            self.resnap = True  # the barrier's watcher left: pick it again
        return []


@dataclass
class Outcome:
    result: RoundResult | None = None
    change: Change | None = None
    error: BaseException | None = None


# Tries of one write on ``round`` whose compare other nodes' writes keep
# failing while the round stays where it was (:meth:`Executor._on_round`).
ROUND_WRITE_TRIES = 64


class Executor:
    """Carries the rules' actions out for one node (its writes)."""

    def __init__(
        self,
        node: Node,
        observer: Observer,
        keeper: LeaseKeeper,
        timers: dict[Timer, float],
        renew: Callable[[float | None, str | None], Awaitable[None]],
    ) -> None:
        self.node = node
        self.observer = observer
        self.keeper = keeper
        self.timers = timers  # the driver's armed deadlines (absolute, monotonic)
        # A new lease and the presence key again, within a window (None: the
        # rejoin window) named by a limit (:meth:`.register.Registration.regain_lease`).
        self.renew = renew
        self.failure: FailureRecord | None = None  # the last failure reported
        # The master port this node offers, picked again for each round: a
        # process of an earlier round (a survivor of in-process restarts,
        # a rank of a node that lost its lease) never reaches a later
        # round's TCPStore at the address it knew.
        self.port = 0
        self.port_round = -1
        self.notice: Callable[[str], None] | None = None  # a line for the operator
        self.waited_as_spare = False  # this node's last wait was as a spare
        self.done_round: int | None = None  # the last round this node put its done key in

    @property
    def _waiting_key(self) -> str:
        return self.node.keys.waiting(self.node.node_id)

    async def execute(self, a: Action) -> Outcome | None:
        """Carry ``a`` out; an :class:`Outcome` where it ends the call."""
        match a:
            case ReturnResult() | ReturnChange() | Return() | Raise():
                return await self._end(a)
            case Arm():
                self.timers[a.timer] = a.deadline
            case Cancel():
                self.timers.pop(a.timer, None)
            case ReadRound():
                pass  # the SEEKING phase reads the round record
            case Join():
                await self._join(a)
            case Leave():
                await self._leave(a)
            case Wait():
                await self._wait(a)
            case CloseRound():
                await self._close_round(a)
            case OpenRound():
                await self._open_round(a)
            case PutDone():
                await self._put_done(a)
            case MarkFinished():
                await self._mark_finished(a)
            case RenewLease():
                await self._renew_lease()
            case Revoke():
                await self._revoke()
            case _:
                assert_never(a)
        return None

    async def _end(self, a: ReturnResult | ReturnChange | Return | Raise) -> Outcome:
        """How an action that ends the call ends it."""
        match a:
            case ReturnResult():
                return await self._return_result(a)
            case ReturnChange():
                view = self.observer.view
                return Outcome(change=rounds.round_change(view.round, a.reason, a.detail))
            case Return():
                return Outcome()
            case Raise():
                return await self._raise(a)
            case _:
                assert_never(a)

    async def _leave(self, a: Leave) -> None:
        node = self.node
        await self.observer.note_joiners(a.round)
        await node.store.txn(
            [], [Delete(node.keys.join(a.round, node.node_id)), Delete(self._waiting_key)]
        )

    async def _wait(self, a: Wait) -> None:
        node = self.node
        rec = WaitingRecord(node.node_id, node.host, a.round)
        await node.store.put(self._waiting_key, rec.encode(), self.keeper.lease)
        self.waited_as_spare = self._spare(a.round)
        node.events.emit(
            NodeWaiting(
                round=a.round,
                node=node.node_id,
                host=node.host,
                reason=waiting_reason(node.settings, a.round, self.observer.view.size(a.round)),
                spare=self._spare(a.round),
            )
        )

    async def _put_done(self, a: PutDone) -> None:
        node, k, r, obs = self.node, self.node.keys, a.round, self.observer
        # In the same txn, what the barrier's set-up needs first (a snapshot
        # at its revision): round, for the barrier's phase to start from; the
        # done keys counted, this one's among them (so the last member to
        # put its done key, and only it, finds them all); and whether group
        # rank 0, the barrier's watcher while it lives, is present.
        peek = [m.node_id for m in obs.view.known(r)[:1] if m.node_id != node.node_id]
        ops: list[Op] = [Put(k.done(r, node.node_id), DONE), Get(k.round), Count(k.dones(r))]
        res = await node.store.txn([], [*ops, *(Get(k.node(n)) for n in peek)])
        self.done_round = r
        if not res.succeeded or len(res.gets) != 1 + len(peek) or not res.counts:
            return
        if res.gets[0]:
            obs.round_seen = (res.gets[0][0], res.revision)
        present = {n: bool(kvs) for n, kvs in zip(peek, res.gets[1:], strict=True)}
        obs.barrier_seen = BarrierSeen(r, res.revision, res.counts[0], present)

    async def _renew_lease(self) -> None:
        # At the exit barrier, no longer than the barrier's own deadline.
        barrier = self.timers.get(Timer.BARRIER)
        left = None if barrier is None else max(0.0, barrier - self.node.clock.monotonic())
        await self.renew(left, None if left is None else "the exit barrier")

    async def _revoke(self) -> None:
        # Leaving: bounded by close_timeout; past it the lease expires by
        # itself within lease_ttl and the others see the leave then. First
        # the left key (no lease: it outlives the presence key), so that the
        # others say this node left, not that it was lost (best effort).
        node, timeout = self.node, self.node.settings.close_timeout
        # A member that put its done key in the last round it joined is
        # counted as finished, not lost: no left key needed.
        joined, done = self.observer.joined, self.done_round
        finished = joined is not None and done is not None and done >= joined[0]
        if self.keeper.alive and not finished:
            with contextlib.suppress(StoreError, TimeoutError):
                await asyncio.wait_for(node.store.put(node.keys.left(node.node_id), b"1"), timeout)
        await self.keeper.stop(revoke=True, timeout=timeout)

    async def _return_result(self, a: ReturnResult) -> Outcome:
        node = self.node
        result = await self._round_result(a.round)
        rec = self.observer.view.round
        prev = {p.node_id: p.group_rank for p in rec.prev} if rec and rec.round == a.round else {}
        node.events.emit(
            RoundJoined(
                round=result.round,
                node=node.node_id,
                group_rank=result.group_rank,
                previous_group_rank=prev.get(node.node_id),
                group_world_size=result.group_world_size,
                world_size=result.world_size,
                members=result.group_world_size,
                master=str(Endpoint(result.master_addr, result.master_port)),
                restart_count=result.restart_count,
            )
        )
        await self._report_promotion(a.round, rec)
        self.waited_as_spare = False
        return Outcome(result=result)

    async def _report_promotion(self, r: int, rec: RoundRecord | None) -> None:
        """This node was not a member of the round before ``r``: say whose
        place it took (the event log; the console too when it waited as a
        spare and took the rank of a member that left the group)."""
        node = self.node
        if rec is None or rec.round != r or r not in self.observer.view.heads:
            return
        if not rec.prev or any(p.node_id == node.node_id for p in rec.prev):
            return  # a first round, or this node was a member before: not promoted
        stored = await self.observer.get_result(r)  # whose rank it took: every member
        for nid, rank, lost in _promotions(rec, stored.members):
            if nid != node.node_id:
                continue
            node.events.emit(SparePromoted(round=r, node=nid, group_rank=rank, replaces=lost))
            if lost is not None and self.waited_as_spare and self.notice is not None:
                # Node ids are checked ([A-Za-z0-9._-]): nothing to escape.
                self.notice(
                    f"elastrun: round {r}: this spare trains now, as group rank {rank}, "
                    f"in place of node {lost}, which left the group"
                )

    async def _raise(self, a: Raise) -> Outcome:
        """The error a call raises for ``a``: its message says why (a
        timeout's, who joined: read again first)."""
        obs = self.observer
        if a.error is RendezvousTimeout:
            await obs.note_joiners(a.round)
        error = call_error(a, self.node.settings, obs.view.round, obs.round, obs.joiner_hosts)
        return Outcome(error=error)

    async def _join(self, a: Join) -> None:
        node, r = self.node, a.round
        if self.observer.view.round_kv is None:
            return
        if not self.port or self.port_round != r:
            last = self.port
            addr = node.settings.addr
            for _ in range(3):  # another port than the last round's
                if _is_ip(addr):  # a bind, at once: no name to resolve
                    self.port = rounds.pick_master_port(addr)
                else:
                    self.port = await asyncio.to_thread(rounds.pick_master_port, addr)
                if self.port != last:
                    break
            self.port_round = r
        rec = JoinRecord(node.info(), port=self.port)

        async def join(kv: KeyValue, _: RoundRecord) -> bool:
            res = await node.store.txn(
                [Compare.unchanged(node.keys.round, kv.mod_revision)],
                [
                    Put(node.keys.join(r, node.node_id), rec.encode(), self.keeper.lease),
                    Delete(self._waiting_key),
                ],
            )
            if res.succeeded:
                # round is unchanged at this revision (compared): the next
                # phase need not read it again.
                self.observer.round_seen = (kv, res.revision)
                self.observer.joined = (r, res.revision)
            return res.succeeded

        if await self._on_round(r, RoundState.OPEN, join):
            node.events.emit(NodeJoined(round=r, node=node.node_id, host=node.host))

    async def _on_round(
        self,
        r: int,
        state: RoundState,
        write: Callable[[KeyValue, RoundRecord], Awaitable[bool]],
    ) -> bool:
        """``write`` (a compare on ``round`` at the given record) while ``round``
        is round ``r`` in ``state``; True once it succeeded. Other nodes write
        ``round`` without moving it on (a root-cause report, a fault mark): a
        compare that such a write failed is read again and tried again, else a
        join or a close would be lost and the round would wait on a node that
        thinks it did its part. Bounded: each retry follows another node's
        successful write. Where the round moved on, False: the round feed
        brings the change to the rules (the view is left as it is)."""
        view = self.observer.view
        kv, rec = view.round_kv, view.round
        for _ in range(ROUND_WRITE_TRIES):
            if kv is None or rec is None or rec.round != r or rec.state is not state:
                return False
            if await write(kv, rec):
                return True
            kvs, rev = await read(self.node.store, self.node.keys.round, False)
            kv = kvs[0] if kvs else None
            rec = None if kv is None else P.decode_round(kv.key, kv.value)
            if rec is not None and rec.round == r and rec.state is state:
                # Only what it holds changed: the view takes it (the feed's
                # event of that revision, when it comes, is then ignored).
                view.set_round(kv, rev)
        return False

    async def _close_round(self, a: CloseRound) -> None:
        node, view, r = self.node, self.observer.view, a.round
        order = sorted(view.joiners.values(), key=lambda kv: kv.create_revision)
        joiners = [JoinRecord.decode(j.key, j.value) for j in order]
        settings = node.settings
        shards = shard_count(settings.max_nodes)
        made: list[tuple[RoundRecord, ResultRecord]] = []

        async def close(kv: KeyValue, rec: RoundRecord) -> bool:
            closed, result = rounds.close_records(
                rec,
                joiners,
                settings.max_nodes,
                a.reason,
                time.time(),
                max_restarts=settings.max_restarts,
                unit=settings.node_unit,
            )
            made.append((closed, result))
            header, parts = stored_form(result, shards)
            res = await node.store.txn(
                [Compare.unchanged(node.keys.round, kv.mod_revision)],
                [
                    Put(node.keys.round, closed.encode()),
                    Put(node.keys.result(r), header.encode()),
                    *(Put(node.keys.shard(r, p.shard), p.encode()) for p in parts),
                ],
            )
            return res.succeeded

        if not await self._on_round(r, RoundState.OPEN, close):
            return
        closed, result = made[-1]
        members = result.members
        chosen = {m.node_id for m in members}
        if closed.state is RoundState.FAILED:
            node.events.emit(JobMarkedFailed(round=r, reason="restart budget exhausted"))
        else:
            view.results[r] = result
            view.heads[r] = Head.of(result, node.node_id, shards)
            node.events.emit(
                RoundClosed(
                    round=r,
                    reason=a.reason,
                    members=[m.host for m in members],
                    ranks={m.node_id: m.group_rank for m in members},
                    promoted=[
                        {"node": nid, "group_rank": rank, "replaces": lost}
                        for nid, rank, lost in _promotions(view.round, members)
                    ],
                    spares=[j.node.node_id for j in joiners if j.node.node_id not in chosen],
                )
            )

    async def _cas_round(self, kv: KeyValue, new: RoundRecord) -> bool:
        keys, store = self.node.keys, self.node.store
        return await store.compare_and_set(keys.round, kv.mod_revision, new.encode())

    async def _open(self, kv: KeyValue, new: RoundRecord, *, hang: bool) -> bool:
        """Open the next round. A round that ended on a hang replaces the
        stacks notes kept so far (the previous hang's, and any other note
        under that prefix): its members' notes are written after it opens."""
        if not hang:
            return await self._cas_round(kv, new)
        keys = self.node.keys
        res = await self.node.store.txn(
            [Compare.unchanged(keys.round, kv.mod_revision)],
            [Put(keys.round, new.encode()), Delete(keys.note(N.STACKS_PREFIX), prefix=True)],
        )
        return res.succeeded

    async def _open_round(self, a: OpenRound) -> None:
        rec = self.observer.view.round
        if rec is None or rec.round != a.round or rec.state is not RoundState.CLOSED:
            return
        result = await self.observer.get_result(a.round)

        async def open_next(kv: KeyValue, rec: RoundRecord) -> bool:
            new = rounds.next_round_record(
                rec,
                result,
                a.reason,
                a.detail,
                counts=a.counts,
                failure=self.failure,
                opened_at=time.time(),
                reporter=self.node.node_id,
            )
            return await self._open(kv, new, hang=new.hang_round == a.round)

        if await self._on_round(a.round, RoundState.CLOSED, open_next):
            events, me = self.node.events, self.node.node_id
            if a.reason == "member_lost":
                events.emit(NodeLost(round=a.round, detail=a.detail, by=me))
            events.emit(RoundOpened(round=a.round + 1, reason=a.reason, detail=a.detail, by=me))

    async def _mark_finished(self, a: MarkFinished) -> None:
        async def finish(kv: KeyValue, rec: RoundRecord) -> bool:
            return await self._cas_round(kv, dataclasses.replace(rec, state=RoundState.FINISHED))

        if await self._on_round(a.round, RoundState.CLOSED, finish):
            self.node.events.emit(JobMarkedFinished(round=a.round))

    def _spare(self, r: int) -> bool:
        return spare(self.node.settings, self.observer.view.size(r))

    async def _round_result(self, r: int) -> RoundResult:
        """Round ``r``'s result as this member sees it: every member where
        this node read them all (its members built once per process:
        :func:`decode_whole`), else its own place in the round."""
        s, view = self.node.settings, self.observer.view
        if r in view.results:
            decoded = await self.observer.get_decoded(r)
            result = decoded.record
            return RoundResult(
                run_id=s.run_id,
                round=result.round,
                members=decoded.members,
                group_rank=decoded.ranks[self.node.node_id],
                master_addr=result.master_addr,
                master_port=result.master_port,
                restart_count=result.restarts,
                max_restarts=s.max_restarts,
                reason=result.reason,
                charged=result.charged,
            )
        head = await self.observer.get_head(r)
        return rounds.partial_result(s.run_id, head, s.max_restarts)


def _promotions(
    rnd: RoundRecord | None, members: Sequence[MemberRecord]
) -> list[tuple[str, int, str | None]]:
    """The members of closed round ``rnd`` that were not members of the round
    before it: (node id, group rank, the lost member whose rank it took)."""
    if rnd is None:
        return []
    prev = {p.node_id: p.group_rank for p in rnd.prev}
    return promotions(prev, {m.node_id: m.group_rank for m in members})


def _is_ip(addr: str) -> bool:
    """Whether ``addr`` is an IP address (binding it resolves no name)."""
    try:
        ipaddress.ip_address(addr)
    except ValueError:
        return False
    return True
