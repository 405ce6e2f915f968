"""One phase's reads and watches (the driver's watch plumbing).

A *phase* is the machine's state and round; what it reads and watches is the
planner's (:func:`.plan.plan_phase`, whose module doc has the table). Setting
one up reads what it needs and opens each watch from the revision after its
read, so no change between the read and the watch is missed; every watch event
lands in the driver's inbox as a :class:`WatchFired` of the phase's id, and
messages of an earlier phase are dropped there. Closing the phase cancels its
drains and closes its watches. A per-node key read that holds no node's record
is left out, as if absent (:meth:`.view.Observer.records`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

from elastrun.errors import RendezvousError, StoreError, WatchCancelled
from elastrun.rendezvous import keys as K
from elastrun.rendezvous import plan as P
from elastrun.rendezvous import rounds
from elastrun.rendezvous.protocol import BarrierDone, Event
from elastrun.rendezvous.records import RoundState
from elastrun.rendezvous.view import Node, Observer, read
from elastrun.store.base import KeyValue, Store, Watch, WatchEvent

__all__ = [
    "FEED",
    "Inbox",
    "LeaseGone",
    "Message",
    "OpenPhase",
    "RoundFeed",
    "WatchFailed",
    "WatchFired",
]


# -- the driver's inbox ---------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class WatchFired:
    """An event of one of phase ``phase_id``'s watches."""

    phase_id: int
    watched: P.Watched
    event: WatchEvent


@dataclass(frozen=True, slots=True)
class WatchFailed:
    """One of phase ``phase_id``'s watches ended with a store error."""

    phase_id: int
    error: StoreError


@dataclass(frozen=True, slots=True)
class LeaseGone:
    """This node's lease ``lease`` was lost (valid in any phase)."""

    lease: int
    reason: str


Message = WatchFired | WatchFailed | LeaseGone
Inbox = asyncio.Queue[Message]


# The phase id of the round feed's messages: every phase takes them.
FEED = 0


class RoundFeed:
    """The watch on ``round`` every phase of a node shares: opened by the
    first phase after its read, kept until the node leaves or the watch
    fails (then the next phase reads and opens it again). ``latest``:
    ``round`` as the feed last had it, and at which revision; its events
    reach the inbox as :class:`WatchFired` of phase :data:`FEED`, and one a
    phase's snapshot already holds is ignored there (:func:`.plan.react`)."""

    def __init__(self) -> None:
        self.latest: tuple[KeyValue | None, int] = (None, 0)
        self._watch: Watch | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def live(self) -> bool:
        return self._watch is not None

    async def open(
        self, store: Store, key: str, latest: tuple[KeyValue | None, int], inbox: Inbox
    ) -> None:
        self.latest = latest
        self._watch = await store.watch(key, start_revision=latest[1] + 1)
        self._task = asyncio.get_running_loop().create_task(self._drain(self._watch, inbox))

    async def _drain(self, watch: Watch, inbox: Inbox) -> None:
        try:
            async for wev in watch:
                put = wev.type == "put"
                self.latest = (wev.kv if put else None, wev.kv.mod_revision)
                inbox.put_nowait(WatchFired(FEED, P.Watched.ROUND, wev))
        except StoreError as exc:
            inbox.put_nowait(WatchFailed(FEED, exc))
        else:  # ended, not by close() (which cancels this first): read again
            inbox.put_nowait(WatchFailed(FEED, WatchCancelled("the watch on round ended")))

    async def close(self) -> None:
        task, watch, self._task, self._watch = self._task, self._watch, None, None
        if task is not None:
            task.cancel()
        if watch is not None:
            with contextlib.suppress(StoreError, OSError):
                await watch.close()


class OpenPhase:
    """The reads and watches of one phase; :meth:`close` always."""

    def __init__(
        self, node: Node, observer: Observer, inbox: Inbox, phase_id: int, feed: RoundFeed
    ) -> None:
        self.node = node
        self.observer = observer
        self.inbox = inbox
        self.phase_id = phase_id
        self.feed = feed
        self._watches: list[Watch] = []
        self._tasks: list[asyncio.Task[None]] = []

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for watch in self._watches:
            with contextlib.suppress(StoreError, OSError):
                await watch.close()

    async def _watch(self, watched: P.Watched, key: str, prefix: bool, rev: int) -> None:
        watch = await self.node.store.watch(key, prefix=prefix, start_revision=rev + 1)
        self._watches.append(watch)
        drain = self._drain(watched, watch)
        self._tasks.append(asyncio.get_running_loop().create_task(drain))

    async def _drain(self, watched: P.Watched, watch: Watch) -> None:
        pid, inbox = self.phase_id, self.inbox
        try:
            async for wev in watch:
                inbox.put_nowait(WatchFired(pid, watched, wev))
        except StoreError as exc:
            inbox.put_nowait(WatchFailed(pid, exc))

    # -- setting a phase up -----------------------------------------------------
    async def open(self, plan: P.PhasePlan) -> list[Event]:
        """Read and watch what ``plan`` says; return the phase's initial events."""
        self.observer.new_view()
        await self._read_round()
        if plan.joins:
            await self._open_joins(plan.round)
        if plan.nodes:
            await self._read_nodes()
        if plan.waiting:
            await self._read_waiting()
        return await self._initial_events(plan)

    async def _read_round(self) -> None:
        """``round`` as the node's round feed has it (no request), or as this
        node's last write found it where that is newer; read (and the feed
        opened) where the feed is not open."""
        store, k, obs, feed = self.node.store, self.node.keys, self.observer, self.feed
        seen, obs.round_seen = obs.round_seen, None
        if feed.live:
            kv, rev = feed.latest
            if seen is not None and seen[1] > rev:
                kv, rev = seen
        elif seen is not None:
            # As this node's last write found it: a snapshot at that write's
            # revision, as good as a read (the watch starts after it).
            kv, rev = seen
        else:
            kvs, rev = await read(store, k.round, False)
            kv = kvs[0] if kvs else None
        if kv is None:
            await self._create_first_round()
            kvs, rev = await read(store, k.round, False)
            kv = kvs[0] if kvs else None
        obs.view.set_round(kv, rev)
        if not feed.live:
            await feed.open(store, k.round, (kv, rev), self.inbox)

    async def _create_first_round(self) -> None:
        node = self.node
        if await node.store.create(node.keys.round, rounds.first_round(time.time()).encode()):
            node.events.emit("round_opened", round=0, reason="job_started", node=node.node_id)

    async def _read_nodes(self) -> None:
        view, k = self.observer.view, self.node.keys
        nodes, nrev = await read(self.node.store, k.nodes, True)
        nodes = self.observer.records(P.Watched.NODES, nodes)
        view.nodes = {K.node_id_of(kv.key): kv for kv in nodes}
        view.nodes_loaded = True
        await self._watch(P.Watched.NODES, k.nodes, True, nrev)

    async def _read_waiting(self) -> None:
        view, k = self.observer.view, self.node.keys
        waiting, wrev = await read(self.node.store, k.waiting_prefix, True)
        waiting = self.observer.records(P.Watched.WAITING, waiting)
        view.waiting = {K.node_id_of(kv.key): kv for kv in waiting}
        await self._watch(P.Watched.WAITING, k.waiting_prefix, True, wrev)

    async def _open_joins(self, r: int) -> None:
        """The decider watches every join and ``nodes/``; a follower only its
        predecessor's join key (see :func:`.plan.join_role`)."""
        if await self._open_follower(r):
            return
        obs, store, k = self.observer, self.node.store, self.node.keys
        view = obs.view
        joins, jrev = await read(store, k.joins(r), True)
        joins = obs.records(P.Watched.JOINS, joins)
        view.joiners = {K.node_id_of(kv.key): kv for kv in joins}
        obs.saw_joiners(r, joins)
        role = P.join_role(self.node.node_id, joins)
        view.decider = isinstance(role, P.Decider)
        if isinstance(role, P.Decider):
            await self._watch(P.Watched.JOINS, k.joins(r), True, jrev)
            await self._read_nodes()
        elif isinstance(role, P.Follower):
            view.predecessor = role.predecessor
            await self._watch(P.Watched.PREDECESSOR, k.join(r, role.predecessor), False, jrev)

    async def _open_follower(self, r: int) -> bool:
        """The join phase of a follower that reads only its own join and its
        predecessor's (O(1) bytes): True if done. False where the full join
        prefix must be read instead (see :func:`.plan.follower_of_newest`)."""
        obs, store, k = self.observer, self.node.store, self.node.keys
        if obs.joined is None or obs.joined[0] != r:
            return False
        # My join key and the join created just before it, at one revision:
        # the same predecessor the full read would find.
        kvs, count, jrev = await store.get_prefix_newest(k.joins(r), obs.joined[1], 2)
        role = P.follower_of_newest(self.node.node_id, kvs)
        if role is None or len(obs.records(P.Watched.JOINS, kvs)) < len(kvs):
            return False  # (a key that holds no join: read every join, leave it out)
        view = obs.view
        view.joiners = {self.node.node_id: kvs[0]}
        view.joined_count = count
        obs.saw_joiners(r, kvs)
        view.predecessor = role.predecessor
        await self._watch(P.Watched.PREDECESSOR, k.join(r, role.predecessor), False, jrev)
        return True

    async def _initial_events(self, plan: P.PhasePlan) -> list[Event]:
        obs, r = self.observer, plan.round
        view = obs.view
        events: list[Event] = []
        round_ev = await obs.round_event()
        if round_ev is not None:
            events.append(round_ev)
        if plan.joins:
            events.append(P.joiners_event(view, self.node.clock.monotonic()))
        # The rest concerns round r; a newer round record ends the phase anyway.
        if view.round is not None and view.round.round != r:
            return events
        if plan.nodes:
            events.extend(await obs.lost_events())
        if plan.waiting:
            s = self.node.settings
            events.extend(
                P.waiting_event(view, r, n, s.max_nodes, unit=s.node_unit) for n in view.waiting
            )
        if view.round is not None and view.round.state is RoundState.CLOSED:
            if plan.barrier:
                events.extend(await self.open_watch(r, barrier=True))
            elif plan.watch_members:
                events.extend(await self.open_watch(r, barrier=False))
        return events

    # -- the members' loss watch and the exit barrier -------------------------------
    async def open_watch(self, r: int, *, barrier: bool) -> list[Event]:
        """Who watches whom among round ``r``'s members: the planner's steps
        (:func:`.plan.barrier_step`), reading one member's presence or done
        key at a time, until it says whom to watch. At the exit barrier
        (``barrier``, after this node's done key) the done keys are counted
        first (O(1) bytes; as many as the members: the members' own counted,
        O(n) bytes, as a stranger's key under the prefix counts too) and the
        watcher watches them too; while the members train, the same watcher
        watches ``nodes/`` alone."""
        obs, store, k = self.observer, self.node.store, self.node.keys
        view = obs.view
        members, size = view.known(r), view.size(r)
        present: dict[str, bool] = {}
        done: dict[str, bool] = {}
        revs: dict[str, int] = {}
        count = 0  # no done keys while the members train
        if barrier:
            seen, obs.barrier_seen = obs.barrier_seen, None
            if seen is not None and seen.round == r:  # this node's done txn read them
                count = seen.count
                present.update(seen.present)
                revs.update(dict.fromkeys(seen.present, seen.revision))
            else:
                _, count, _ = await store.get_prefix_newest(k.dones(r), 0, 1)
            if size and count >= size:  # as many done keys as members: are they theirs?
                count = await obs.members_done(r)
                members = view.known(r)
        for _ in range(2 * size + 2):  # each step learns one fact, or ends
            step = P.barrier_step(members, self.node.node_id, count, present, done, size=size)
            if isinstance(step, P.BeWatcher) and r not in view.results:
                # Past the members known (group rank 0): read them all.
                members = (await obs.get_result(r)).members
            elif isinstance(step, P.CheckPresence):
                kvs, revs[step.node_id] = await read(store, k.node(step.node_id), False)
                present[step.node_id] = bool(obs.records(P.Watched.NODES, kvs))
            elif isinstance(step, P.CheckDone):
                done[step.node_id] = await obs.finished(step.node_id)
            elif isinstance(step, P.WatchWatcher):
                obs.view.watcher = step.node_id
                rev = revs[step.node_id]
                await self._watch(P.Watched.WATCHER, k.node(step.node_id), False, rev)
                return []
            elif isinstance(step, P.LostAtBarrier):
                return [await obs.lost_event(step.member)]
            elif isinstance(step, BarrierDone):
                return [step]
            elif barrier:
                return await self._watch_barrier(r)
            else:
                return await self._watch_members()
        raise RendezvousError(f"round {r}: the exit barrier's set-up did not settle")

    async def _watch_members(self) -> list[Event]:
        """This node is the round's watcher while the members train: every
        presence key (a member gone without a done key is lost)."""
        await self._read_nodes()
        return await self.observer.lost_events()

    async def _watch_barrier(self, r: int) -> list[Event]:
        """This node is the barrier's watcher: the done keys and ``nodes/``."""
        obs, k = self.observer, self.node.keys
        dones, drev = await read(self.node.store, k.dones(r), True)
        obs.view.done = {K.node_id_of(kv.key) for kv in dones}
        await self._watch(P.Watched.DONE, k.dones(r), True, drev)
        await self._read_nodes()
        events = await obs.lost_events()
        if P.all_done(obs.view, r):
            events.append(BarrierDone())
        return events
