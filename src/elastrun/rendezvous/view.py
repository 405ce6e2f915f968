"""The reads behind the planner's decisions (the driver's eyes).

The driver keeps one :class:`~.plan.View` per phase. :class:`Observer` does
the few reads that turning it into rule events needs -- a closed round's
result, whether a member that is gone put its done key -- and asks the
planner (:mod:`.plan`, pure) what the view means:

* the round record -> ``RoundOpen`` / ``RoundClosed`` / ``RoundFinished`` /
  ``RoundFailed``;
* joins and presence keys -> ``JoinersChanged`` (the decider's input);
* running members' change detection: a member's presence gone without its done
  key -> ``MemberLost``; a waiting node -> ``NodeWaiting``;
* the exit barrier: every member of the round done (``BarrierDone``); for the
  barrier's watcher, a done key or a presence key gone; for the others, the
  watcher's presence gone (lost, or left: pick the watcher again).

A per-node key that holds no node's record is left out as if absent, with one
line (:mod:`.damage`); a damaged round result is the job's verdict
(:class:`~elastrun.errors.RecordDamaged`). It never writes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from elastrun.clock import Clock
from elastrun.errors import RendezvousError, StoreError
from elastrun.events import EventSink
from elastrun.rendezvous import keys as K
from elastrun.rendezvous import plan as P
from elastrun.rendezvous import results as R
from elastrun.rendezvous.api import Member, RendezvousSettings
from elastrun.rendezvous.damage import JunkLog, NodeKind, agreed
from elastrun.rendezvous.memo import KeysMemo
from elastrun.rendezvous.protocol import Event
from elastrun.rendezvous.records import (
    JoinRecord,
    MemberRecord,
    PresenceRecord,
    ResultRecord,
    WaitingRecord,
)
from elastrun.rendezvous.results import Head, ResultHeader, ResultShard, shard_count, shard_of
from elastrun.rendezvous.rules import Rules
from elastrun.store.base import Get, KeyValue, Store, WatchEvent

__all__ = ["DecodedResult", "Node", "Observer", "decode_part", "decode_whole", "read"]


@dataclass(frozen=True)
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


async def read(store: Store, key: str, prefix: bool) -> tuple[list[KeyValue], int]:
    """The key (or prefix) and the store revision of the read (watch from rev + 1)."""
    res = await store.txn([], [Get(key, prefix)])
    return res.gets[0], res.revision


@dataclass(frozen=True)
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
        Member(m.node_id, m.host, m.addr, m.group_rank, m.nproc) for m in record.members
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
    """Turns what this node reads and is told by watches into rule events."""

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
        self.barrier_seen: P.BarrierSeen | None = None
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
