"""One phase's reads and watches (the driver's watch plumbing).

A *phase* is the machine's state and round (see ``PHASES``). Setting one up
reads what it needs and opens each watch from the revision after its read, so
no change between the read and the watch is missed; every watch event lands in
the driver's inbox tagged with the phase's id, and events of an earlier phase
are dropped there. Closing the phase cancels its drains and closes its watches.

What each phase reads and watches:

=========== ================================================================
phase       reads, then watches
=========== ================================================================
seek        ``round`` (creating round 0 if absent)
join        ``round``; the round's joins (a follower on the embedded store:
            only its own and its predecessor's); the decider also the joins
            prefix and ``nodes/``, the others only their predecessor's join key
wait        ``round``, ``nodes/``
member      ``round``, ``nodes/``, ``waiting/``
complete    ``round``; the count of the round's done keys (O(1) bytes); then
            the barrier's watcher (the first member in rank order whose
            presence key exists; normally rank 0) the done keys and
            ``nodes/``, every other member only the watcher's presence key
            (see :meth:`Phase.open_barrier`)
=========== ================================================================

Every phase but ``complete`` costs each member O(n) bytes; ``complete`` costs
O(1) for all but the barrier's watcher (O(n) store traffic and watch events
per round in all, where every member reading and watching ``nodes/`` and the
done keys was O(n^2)).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from elastrun.errors import StoreError
from elastrun.rendezvous import keys as K
from elastrun.rendezvous import records as R
from elastrun.rendezvous.rules import Ev, Event, Rules, State
from elastrun.rendezvous.view import NewestReader, Node, Observer, read
from elastrun.store.base import Watch

__all__ = ["PHASES", "Inbox", "Phase", "phase_of"]

PHASES = {
    State.SEEKING: "seek",
    State.JOINING: "join",
    State.DECIDING: "join",
    State.WAITING: "wait",
    State.MEMBER: "member",
    State.COMPLETING: "complete",
}

# (phase id, tag, payload): a watch event, "error" (a StoreError), or
# "lease_lost" (phase id -1: valid in any phase).
Inbox = asyncio.Queue[tuple[int, str, Any]]


def phase_of(rules: Rules) -> tuple[str, int] | None:
    """The phase (name, round) of the machine's state; None where none waits."""
    name = PHASES.get(rules.state)
    return None if name is None else (name, rules.ctx.round)


class Phase:
    """The reads and watches of one phase; :meth:`close` always."""

    def __init__(self, node: Node, observer: Observer, inbox: Inbox, phase_id: int) -> None:
        self.node = node
        self.observer = observer
        self.inbox = inbox
        self.phase_id = phase_id
        self._watches: list[Watch] = []
        self._tasks: list[asyncio.Task[None]] = []

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for watch in self._watches:
            with contextlib.suppress(StoreError, OSError):
                await watch.close()

    async def _watch(self, tag: str, key: str, prefix: bool, rev: int) -> None:
        watch = await self.node.store.watch(key, prefix=prefix, start_revision=rev + 1)
        self._watches.append(watch)
        self._tasks.append(asyncio.get_running_loop().create_task(self._drain(tag, watch)))

    async def _drain(self, tag: str, watch: Watch) -> None:
        pid, inbox = self.phase_id, self.inbox
        try:
            async for wev in watch:
                inbox.put_nowait((pid, tag, wev))
        except StoreError as exc:
            inbox.put_nowait((pid, "error", exc))

    async def _create_first_round(self) -> None:
        node = self.node
        if await node.store.create(node.keys.round, K.encode(R.first_round(time.time()))):
            node.events.emit("round_opened", round=0, reason="job_started", node=node.node_id)

    async def _read_nodes(self) -> None:
        view, k = self.observer.view, self.node.keys
        nodes, nrev = await read(self.node.store, k.nodes, True)
        view.nodes = {K.node_id_of(kv.key): kv for kv in nodes}
        view.nodes_loaded = True
        await self._watch("nodes", k.nodes, True, nrev)

    async def _open_follower(self, r: int) -> bool:
        """The join phase of a follower, reading only its predecessor's join
        (O(1) bytes, where the store can: the embedded store): True if done.
        False where the full join prefix must be read instead (the decider,
        or this node's join is not the newest it finds: the general case)."""
        obs, store, k = self.observer, self.node.store, self.node.keys
        if obs.joined is None or obs.joined[0] != r or not isinstance(store, NewestReader):
            return False
        # My join key and the join created just before it, at one revision:
        # the same predecessor the full read would find.
        kvs, count, jrev = await store.get_prefix_newest(k.joins(r), obs.joined[1], 2)
        ids = [K.node_id_of(kv.key) for kv in kvs]
        if len(ids) < 2 or ids[0] != self.node.node_id:
            return False
        view = obs.view
        view.joiners = {ids[0]: kvs[0]}
        view.joined_count = count
        obs.saw_joiners(r, kvs)
        view.predecessor = ids[1]
        await self._watch("pred", k.join(r, ids[1]), False, jrev)
        return True

    async def open(self, phase: tuple[str, int]) -> list[Event]:
        """Read and watch what ``phase`` needs; return its initial events."""
        name, r = phase
        k, obs, store, me = self.node.keys, self.observer, self.node.store, self.node.node_id
        view = obs.new_view()
        kvs, rev = await read(store, k.round, False)
        if not kvs:
            await self._create_first_round()
            kvs, rev = await read(store, k.round, False)
        obs.set_round(kvs[0] if kvs else None)
        await self._watch("round", k.round, False, rev)
        rnd = int(view.round["round"]) if view.round else r
        if name == "join" and not await self._open_follower(r):
            joins, jrev = await read(store, k.joins(r), True)
            view.joiners = {K.node_id_of(kv.key): kv for kv in joins}
            obs.saw_joiners(r, joins)
            order = sorted(joins, key=lambda kv: kv.create_revision)
            ids = [K.node_id_of(kv.key) for kv in order]
            view.decider = bool(ids) and ids[0] == me
            if view.decider:
                await self._watch("join", k.joins(r), True, jrev)
                await self._read_nodes()
            elif me in ids:
                pred = ids[ids.index(me) - 1]
                view.predecessor = pred
                await self._watch("pred", k.join(r, pred), False, jrev)
        if name in ("wait", "member"):
            await self._read_nodes()
        if name == "member":
            waiting, wrev = await read(store, k.waiting_prefix, True)
            view.waiting = {K.node_id_of(kv.key): kv for kv in waiting}
            await self._watch("waiting", k.waiting_prefix, True, wrev)
        events: list[Event] = []
        round_ev = await obs.round_event()
        if round_ev is not None:
            events.append(round_ev)
        if name == "join":
            events.append(obs.joiners_event())
        if name in ("wait", "member") and rnd == r:
            events.extend(await obs.lost_events())
        if name == "member" and rnd == r:
            events.extend(obs.waiting_event(n) for n in view.waiting)
        if name == "complete" and rnd == r and (view.round or {}).get("state") == K.CLOSED:
            events.extend(await self.open_barrier(r))
        return events

    async def open_barrier(self, r: int) -> list[Event]:
        """The exit barrier of round ``r``, after this node's done key (the
        protocol: the module doc of :mod:`.rules`). Every member counts the
        done keys; the one whose count is the round's size (the last to
        finish, in revision order) is done. Otherwise it finds the barrier's
        watcher: the first member in rank order whose presence key exists
        (members before it that are gone must have a done key, else one is
        lost). The watcher reads and watches the done keys and ``nodes/``;
        every other member watches only the watcher's presence key."""
        obs, store, k, me = self.observer, self.node.store, self.node.keys, self.node.node_id
        view, now = obs.view, self.node.clock.monotonic()
        members = obs.members()
        # Read after this node's own done key: O(1) bytes (a count).
        _, count, _ = await store.get_prefix_newest(k.dones(r), 0, 1)
        if members and count >= len(members):
            return [Event(Ev.BARRIER_DONE, now=now)]
        for m in members:
            nid = m["node_id"]
            if nid == me:
                break
            kvs, rev = await read(store, k.node(nid), False)
            if kvs:
                view.watcher = nid
                await self._watch("watcher", k.node(nid), False, rev)
                return []
            if not await obs.finished(nid):
                return [obs.lost_event(m, "lease expired or revoked")]
        # This node is the barrier's watcher.
        dones, drev = await read(store, k.dones(r), True)
        view.done = {K.node_id_of(kv.key) for kv in dones}
        await self._watch("done", k.dones(r), True, drev)
        await self._read_nodes()
        events = await obs.lost_events()
        if obs.all_done():
            events.append(Event(Ev.BARRIER_DONE, now=now))
        return events
