"""What one node knows of the store, and how that becomes rule events.

The driver (:mod:`.dynamic`) keeps one :class:`View` per phase: the job's
``round`` record, the round's joiners, the presence / waiting / done keys it
read or was told of by a watch. :class:`Observer` turns that knowledge (at
phase set-up, and on each watch event) into :class:`~.rules.Event` values:

* the round record -> ``ROUND_OPEN`` / ``ROUND_CLOSED`` / ``ROUND_FINISHED`` /
  ``ROUND_FAILED``;
* joins and presence keys -> ``JOINERS_CHANGED`` (the decider's input);
* running members' change detection: a member's presence gone without its done
  key -> ``MEMBER_LOST``; a waiting node -> ``NODE_WAITING``;
* the exit barrier: every member of the round done (``BARRIER_DONE``); for the
  barrier's watcher, a done key or a presence key gone; for the others, the
  watcher's presence gone (lost, or left: pick the watcher again).

It does the few reads that translation needs (a round's result, a member's
done key) and never writes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from elastrun.clock import Clock
from elastrun.errors import RendezvousError, StoreError
from elastrun.events import EventSink
from elastrun.rendezvous import keys as K
from elastrun.rendezvous.api import RendezvousSettings
from elastrun.rendezvous.rules import Ev, Event, Rules
from elastrun.store.base import Get, KeyValue, Store, WatchEvent

__all__ = ["NewestReader", "Node", "Observer", "View", "read"]


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


@dataclass
class View:
    """What this node knows of the store in the current phase."""

    round_kv: KeyValue | None = None
    round: dict[str, Any] | None = None
    results: dict[int, dict[str, Any]] = field(default_factory=dict)
    joiners: dict[str, KeyValue] = field(default_factory=dict)
    nodes: dict[str, KeyValue] = field(default_factory=dict)
    nodes_loaded: bool = False
    waiting: dict[str, KeyValue] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)
    predecessor: str | None = None
    # The exit barrier's watcher whose presence this node watches (None: this
    # node is the watcher, or not at the barrier): see Phase.open_barrier.
    watcher: str | None = None
    decider: bool = False
    # How many joined, where only a follower's predecessor was read (not
    # every join): see Phase.open.
    joined_count: int | None = None


@runtime_checkable
class NewestReader(Protocol):
    """A store that reads a prefix's most recently created keys up to a
    revision in one small request (the embedded store's client)."""

    async def get_prefix_newest(
        self, prefix: str, max_create_revision: int, limit: int = 1
    ) -> tuple[list[KeyValue], int, int]: ...


async def read(store: Store, key: str, prefix: bool) -> tuple[list[KeyValue], int]:
    """The key (or prefix) and the store revision of the read (watch from rev + 1)."""
    res = await store.txn([], [Get(key, prefix)])
    return res.gets[0], res.revision


class Observer:
    """Turns what this node reads and is told by watches into rule events."""

    def __init__(self, node: Node, rules: Rules) -> None:
        self.node = node
        self.rules = rules
        self.view = View()
        # Set when the phase must be set up again (my predecessor left).
        self.resnap = False
        # Everyone seen joining, (round, node id) -> host: the join-timeout message.
        self.joiner_hosts: dict[tuple[int, str], str] = {}
        # (round, store revision) of this node's last successful join.
        self.joined: tuple[int, int] | None = None

    def new_view(self) -> View:
        """A fresh view for a new phase (round results are kept: immutable)."""
        self.view = View(results=self.view.results)
        return self.view

    # -- the round record ----------------------------------------------------
    def set_round(self, kv: KeyValue | None) -> None:
        self.view.round_kv = kv
        self.view.round = None if kv is None else K.decode(kv.key, kv.value)

    async def get_result(self, r: int) -> dict[str, Any]:
        view = self.view
        if r not in view.results:
            kv = await self.node.store.get(self.node.keys.result(r))
            if kv is None:
                raise RendezvousError(f"round {r} is closed but has no result record")
            view.results[r] = K.decode(kv.key, kv.value)
        return view.results[r]

    async def round_event(self) -> Event | None:
        rec = self.view.round
        if rec is None:
            return None
        r, state = int(rec["round"]), rec["state"]
        now = self.node.clock.monotonic()
        if state == K.OPEN:
            return Event(Ev.ROUND_OPEN, now=now, round=r)
        if state == K.FINISHED:
            return Event(Ev.ROUND_FINISHED, now=now, round=r)
        if state == K.FAILED:
            return Event(Ev.ROUND_FAILED, now=now, round=r)
        result = await self.get_result(r)
        members = [m["node_id"] for m in result["members"]]
        lost = ""
        if self.view.nodes_loaded:
            gone = [m for m in members if m not in self.view.nodes]
            lost = f"node {gone[0]} lost (no presence in the store)" if gone else ""
        node = self.node
        return Event(
            Ev.ROUND_CLOSED,
            now=now,
            round=r,
            member=node.node_id in members,
            room=len(members) < node.settings.max_nodes,
            lost=lost,
            detail=f"node {node.host} ({node.node_id}) waits to join",
        )

    # -- joiners (the decider's input) ----------------------------------------
    def joiners_event(self) -> Event:
        view = self.view
        prev = (view.round or {}).get("prev") or []
        all_joined = (
            bool(prev)
            and view.nodes_loaded
            and all(nid in view.joiners for nid in view.nodes)
            and not view.waiting
        )
        count = len(view.joiners) if view.joined_count is None else view.joined_count
        return Event(
            Ev.JOINERS_CHANGED,
            now=self.node.clock.monotonic(),
            round=self.rules.ctx.round,
            count=count,
            decider=view.decider,
            all_joined=all_joined,
        )

    def saw_joiners(self, r: int, kvs: Iterable[KeyValue]) -> None:
        for kv in kvs:
            host = str(K.decode(kv.key, kv.value)["host"])
            self.joiner_hosts[(r, K.node_id_of(kv.key))] = host

    async def note_joiners(self, r: int) -> None:
        """Remember who joined round ``r`` (for the join-timeout message): the
        joiners this node saw, and those in the store now."""
        with contextlib.suppress(StoreError):
            self.saw_joiners(r, (await read(self.node.store, self.node.keys.joins(r), True))[0])

    # -- running members: losses, waiting nodes, the exit barrier --------------
    def members(self) -> list[dict[str, Any]]:
        result = self.view.results.get(self.rules.ctx.round)
        return list(result["members"]) if result else []

    async def finished(self, node_id: str) -> bool:
        """Whether a member put its done key for this round (it left after
        its workers succeeded: not a loss)."""
        if node_id in self.view.done:
            return True
        key = self.node.keys.done(self.rules.ctx.round, node_id)
        if await self.node.store.get(key) is not None:
            self.view.done.add(node_id)
            return True
        return False

    async def lost_events(self) -> list[Event]:
        out = []
        for m in self.members():
            nid = m["node_id"]
            if nid not in self.view.nodes and not await self.finished(nid):
                out.append(self.lost_event(m, "lease expired or revoked"))
        return out

    def lost_event(self, member: dict[str, Any], how: str) -> Event:
        detail = f"node {member['host']} ({member['node_id']}) lost: {how}"
        return Event(Ev.MEMBER_LOST, now=self.node.clock.monotonic(), detail=detail)

    def waiting_event(self, node_id: str) -> Event:
        room = len(self.members()) < self.node.settings.max_nodes
        kv = self.view.waiting.get(node_id)
        host = K.decode(kv.key, kv.value).get("host", node_id) if kv else node_id
        detail = f"node {host} ({node_id}) waits to join"
        return Event(Ev.NODE_WAITING, now=self.node.clock.monotonic(), room=room, detail=detail)

    def all_done(self) -> bool:
        members = self.members()
        return bool(members) and all(m["node_id"] in self.view.done for m in members)

    def member(self, node_id: str) -> dict[str, Any] | None:
        return next((m for m in self.members() if m["node_id"] == node_id), None)

    # -- watch events ------------------------------------------------------------
    async def translate(self, tag: str, wev: WatchEvent) -> list[Event]:
        """Rule events for one event of the phase's watch named ``tag``."""
        view, nid, put = self.view, K.node_id_of(wev.kv.key), wev.type == "put"
        if tag == "round":
            self.set_round(wev.kv if put else None)
            ev = await self.round_event()
            return [] if ev is None else [ev]
        if tag == "pred":
            if not put:
                self.resnap = True  # my predecessor left: am I the decider now?
            return []
        if tag == "join":
            if put:
                view.joiners[nid] = wev.kv
                self.saw_joiners(self.rules.ctx.round, [wev.kv])
            else:
                view.joiners.pop(nid, None)
            return [self.joiners_event()]
        if tag == "nodes":
            if put:
                view.nodes[nid] = wev.kv
                return [self.joiners_event()] if view.decider else []
            view.nodes.pop(nid, None)
            if view.decider:
                return [self.joiners_event()]
            for m in self.members():
                if m["node_id"] == nid and not await self.finished(nid):
                    return [self.lost_event(m, "lease expired or revoked")]
            return []
        if tag == "done":  # the barrier's watcher: a member finished
            if put and nid not in view.done:
                view.done.add(nid)
                if self.all_done():
                    return [Event(Ev.BARRIER_DONE, now=self.node.clock.monotonic())]
            return []
        if tag == "watcher":  # the barrier's watcher's presence
            member = self.member(nid)
            if put or member is None:
                return []
            if await self.finished(nid):
                self.resnap = True  # it left the barrier: pick the watcher again
                return []
            return [self.lost_event(member, "lease expired or revoked")]
        if tag == "waiting":
            if put:
                view.waiting[nid] = wev.kv
                return [self.waiting_event(nid)]
            view.waiting.pop(nid, None)
        return []
