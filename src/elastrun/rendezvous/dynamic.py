"""The dynamic (store-backed) rendezvous: the driver of :mod:`.rules`, and its phases.

The driver does the store I/O; the decisions are the rules' (:mod:`.rules`)
and the planner's (:mod:`.plan`), both pure. For each *phase* (the machine's
state and round) it reads what the planner says that phase needs, opens
watches from the revision after each read (:class:`OpenPhase`, below), does
the reads the planner's answers need to become rule events and executes the
actions the rules return (:mod:`.node_io`: the observer and the executor
around this node's state). Waits are on the inbox (watch events, a lost
lease) and on the nearest deadline, through the injected clock; nothing
polls. While ``next_round()`` waits, it reports what for (:mod:`.reports`).
Registration is :mod:`.register`'s. See docs/rendezvous.md for the protocol.

This module is the pump -- the :class:`~.api.Rendezvous` calls and the loop
that feeds events to the rules until one of their actions ends the call --
and its phases.

Phases
------
A *phase* is the machine's state and round; what it reads and watches is the
planner's (:func:`.plan.plan_phase`, whose module doc has the table). Setting
one up reads what it needs and opens each watch from the revision after its
read, so no change between the read and the watch is missed; every watch event
lands in the driver's inbox as a :class:`WatchFired` of the phase's id, and
messages of an earlier phase are dropped there. Closing the phase cancels its
drains and closes its watches. A per-node key read that holds no node's record
is left out, as if absent (:meth:`.node_io.Observer.records`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import os
import re
import socket
import time

from elastrun.clock import SYSTEM_CLOCK, Clock, wait_until
from elastrun.errors import (
    RendezvousClosed,
    RendezvousError,
    RevisionCompacted,
    StoreError,
    StoreReset,
    WatchCancelled,
)
from elastrun.event_kinds import NodeLeft, RestartRequested, RoundOpened, WatchReread
from elastrun.events import EventSink, NullSink
from elastrun.failure import FailureRecord, first_failure
from elastrun.frozen import frozen
from elastrun.rendezvous import barrier_plan as B
from elastrun.rendezvous import keys as K
from elastrun.rendezvous import plan as P
from elastrun.rendezvous import root_cause, rounds
from elastrun.rendezvous.api import (
    Change,
    Rendezvous,
    RendezvousHooks,
    RendezvousSettings,
    RoundResult,
)
from elastrun.rendezvous.fault_access import FaultAccess
from elastrun.rendezvous.node_io import Executor, Node, Observer, Outcome, read
from elastrun.rendezvous.note_access import NoteAccess
from elastrun.rendezvous.plan import PhasePlan, plan_phase
from elastrun.rendezvous.protocol import (
    TIMER_EVENTS,
    BarrierDone,
    Context,
    Event,
    LeaseLost,
    NextRound,
    Shutdown,
    State,
    Timer,
    WorkersFailed,
    WorkersSucceeded,
)
from elastrun.rendezvous.records import RoundRecord, RoundState
from elastrun.rendezvous.register import Registration
from elastrun.rendezvous.reports import ProgressReporter, waiting_status
from elastrun.rendezvous.rules import Rules
from elastrun.store.base import KeyValue, Store, Watch, WatchEvent
from elastrun.store.keepalive import LeaseKeeper

__all__ = [
    "FEED",
    "DynamicRendezvous",
    "Inbox",
    "LeaseGone",
    "Message",
    "OpenPhase",
    "RoundFeed",
    "WatchFailed",
    "WatchFired",
    "create_dynamic_rendezvous",
]


# A phase whose watches keep being compacted before they deliver anything is
# re-read at most this many times in a row before the error is raised.
MAX_REREADS = 20


def rereadable(exc: StoreError) -> bool:
    """A watch error that reading the phase again recovers from: its history
    was compacted, or the store ended it (it fell behind). Not a store that
    lost everything (StoreReset)."""
    return isinstance(exc, RevisionCompacted | WatchCancelled) and not isinstance(exc, StoreReset)


def _safe_id(text: str) -> str:
    """A node id (:data:`.keys.NODE_ID`) made of ``text``: its last 128
    characters (the random suffix kept), each outside the grammar a ``_``."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", text[-128:]) or "node"


class DynamicRendezvous(NoteAccess, FaultAccess, Rendezvous):
    """One node's handle on a job's dynamic rendezvous in a :class:`Store`."""

    def __init__(
        self,
        store: Store,
        settings: RendezvousSettings,
        *,
        events: EventSink | None = None,
        clock: Clock = SYSTEM_CLOCK,
        node_id: str | None = None,
        carry: rounds.Carry | None = None,
    ) -> None:
        self.store = store
        # After a takeover of the store's host: this node's last round, which
        # it carries into the new host's store (docs/failover.md).
        self.carry = carry
        self.settings = settings
        self.events: EventSink = events if events is not None else NullSink()
        self.clock = clock
        host = settings.host or socket.gethostname()
        self.host = host
        self.addr = settings.addr or host
        self.node_id = _safe_id(node_id or f"{host}-{os.getpid()}-{os.urandom(3).hex()}")
        self.keys = K.Keys(settings.run_id)
        self.rules = Rules(
            Context(
                # The decider's bounds are the smallest and largest allowed
                # world sizes (--node-unit); a round closes at the largest
                # allowed size its joiners reach (rounds.close_records).
                min_nodes=settings.sizes().smallest or settings.min_nodes,
                max_nodes=settings.sizes().largest or settings.max_nodes,
                max_restarts=settings.max_restarts,
                join_timeout=settings.join_timeout,
                last_call_timeout=settings.last_call_timeout,
                exit_barrier_timeout=settings.exit_barrier_timeout,
                spares_wait=settings.node_unit > 1,
            )
        )
        self.keeper = LeaseKeeper(store, settings.lease_ttl, clock=clock, on_lost=self._lease_lost)
        self.keeper.on_lease = self._lease_changed
        node = Node(
            store, settings, self.keys, self.node_id, host, self.addr, clock, self.events,
            os.getpid(),
        )  # fmt: skip
        self._node = node
        self._timers: dict[Timer, float] = {}
        self._observer = Observer(node, self.rules)
        self._registration = Registration(node, self._observer, self.keeper)
        self._executor = Executor(
            node, self._observer, self.keeper, self._timers, self._registration.regain_lease
        )
        self._reporter = ProgressReporter(self.events, self.node_id, lambda: self.hooks.progress)
        self._registered = False
        self._failed_round: int | None = None  # the round whose failure this node reported
        self._inbox: Inbox | None = None
        self._feed_of_round = RoundFeed()  # the watch on round, shared by the phases
        self._phase_id = 0
        self._rereads = 0  # phases re-read in a row after a compacted watch

    # -- the Rendezvous interface ------------------------------------------
    async def next_round(self) -> RoundResult:
        if self.rules.state is State.LEFT:
            raise RendezvousClosed("this node has left the job (shutdown was called)")
        if self.rules.state not in (State.FINISHED, State.FAILED):
            await self._register()
        out = await self._run(NextRound(self.clock.monotonic()))
        assert out.result is not None
        return out.result

    async def full_result(self, result: RoundResult) -> RoundResult:
        if result.complete:
            return result
        decoded = await self._observer.get_decoded(result.round)
        return dataclasses.replace(result, members=decoded.members, shape=None)

    async def joining_running_job(self) -> bool:
        try:
            kv = await self.store.get(self.keys.round)
            rec = None if kv is None else RoundRecord.decode(kv.key, kv.value)
            if rec is not None and rec.state is RoundState.CLOSED:
                head = await self._observer.get_head(rec.round)  # this node's place: O(1) bytes
                return head.mine is None
        except (StoreError, RendezvousError):
            return False  # next_round() reads it again and reports what is wrong
        if rec is None or rec.state is not RoundState.OPEN:
            return False
        # A round opened in a job that trained (a failure, a node lost): the
        # others restart now. When they reach the smallest world without this
        # node even if one of them is gone (the node this one may replace),
        # they train on without it, so it waits for its warm interpreter
        # rather than hold their restart for its imports.
        others = [p for p in rec.prev if p.node_id != self.node_id]
        smallest = self.settings.sizes().smallest or self.settings.min_nodes
        return len(others) - 1 >= max(1, smallest)

    async def wait_for_change(self) -> Change:
        if self.rules.state is not State.MEMBER:
            return rounds.round_change(self._observer.view.round, "")
        out = await self._run(None)
        assert out.change is not None
        return out.change

    async def request_restart(self, failure: FailureRecord) -> None:
        self._executor.failure = failure
        self.events.emit(RestartRequested(node=self.node_id, failure=failure))
        # The new round's detail: what every member prints for this restart.
        detail = failure.describe()
        member_round = self.rules.ctx.round
        if self.rules.state is State.MEMBER:
            # Fed once the member phase read the round record (which opening
            # the next round compares against).
            await self._run(None, WorkersFailed(detail))
        elif self.rules.state in (State.IDLE, State.FAILED):
            await self._feed(WorkersFailed(detail))
        else:
            return
        # Whoever opened the next round, this node's failure joins the
        # others' reports there: the round keeps the first (root_cause.py).
        self._failed_round = member_round
        with contextlib.suppress(StoreError, RendezvousError, TimeoutError):
            async with asyncio.timeout(root_cause.REPORT_TIMEOUT):
                await root_cause.report(self.store, self.keys, self.node_id, member_round, failure)

    async def job_failure(self, failure: FailureRecord, timeout: float) -> FailureRecord:
        if self._failed_round is None:
            return failure
        found = await root_cause.settle(
            self.store,
            self.keys,
            self.node_id,
            self._failed_round,
            timeout=timeout,
        )
        # The round's, as every node reads it (this node's own report is in
        # it); this node's only where the store had none of it.
        return first_failure(found.failure, failure) or failure

    async def complete(self) -> None:
        if self.rules.state is not State.MEMBER:
            return
        # Straight to the barrier: no member phase first (its O(n) reads of
        # ``nodes/`` and ``waiting/`` by every member were O(n^2) in all).
        await self._run(WorkersSucceeded(self.clock.monotonic()))

    async def shutdown(self) -> None:
        """Leave: revoke the lease, bounded by ``close_timeout``."""
        if self.rules.state is State.LEFT:
            return
        self.events.emit(NodeLeft(node=self.node_id, host=self.host))
        try:
            await self._feed(Shutdown())
        finally:
            await self._feed_of_round.close()

    # -- registration ----------------------------------------------------------
    async def _register(self) -> None:
        if self._registered and self.keeper.alive:
            return
        if self._registered:
            # A member whose lease was lost registers again: it rejoins its
            # job whatever it finds (never starts a new one: see .register),
            # while the store is unreachable for at most join_timeout.
            await self._registration.regain_lease(check=self._registration.check_config)
            return
        await self._registration.first_lease()
        if self.carry is not None:
            await self._registration.after_takeover(self.carry)
        else:
            await self._registration.first()
        self._registered = True

    def attach(self, hooks: RendezvousHooks) -> None:
        self.hooks = hooks
        self._executor.notice = hooks.notice
        self._registration.notice = hooks.notice
        self._observer.junk.say = hooks.notice
        if self.keeper.alive:  # held already: said now, as it would have been
            self._lease_changed(self.keeper.lease)

    def _lease_changed(self, lease: int) -> None:
        listener = self.hooks.lease_listener
        if listener is not None:
            listener(self.store.revoke_spec(lease) if lease else None)

    def _lease_lost(self, reason: str) -> None:
        if self._inbox is not None:
            self._inbox.put_nowait(LeaseGone(self.keeper.lease, reason))

    # -- the pump ----------------------------------------------------------------
    async def _run(self, first: Event | None, extra: Event | None = None) -> Outcome:
        """Feed ``first``, then set phases up and feed what they read and
        watch (``extra`` once the first phase is read) until an action ends
        the call."""
        if self._inbox is None:
            self._inbox = asyncio.Queue()
        try:
            out = None if first is None else await self._feed(first)
            while out is None:
                out, extra = await self._run_phase(extra)
            if out.error is not None:
                raise out.error
            return out
        finally:
            self._reporter.update(None)

    def _plan(self) -> PhasePlan:
        plan = plan_phase(self.rules.state, self.rules.ctx.round)
        if plan is None:
            raise RendezvousError(f"rendezvous in state {self.rules.state.name}: no phase")
        return plan

    async def _run_phase(self, extra: Event | None) -> tuple[Outcome | None, Event | None]:
        """One phase: read and watch, feed its events, wait until the phase
        moves on. Returns the outcome that ends the call (None: go on), and
        ``extra`` where it is still to be fed."""
        assert self._inbox is not None
        plan = self._plan()
        self._phase_id += 1
        self._observer.resnap = False
        phase = OpenPhase(
            self._node, self._observer, self._inbox, self._phase_id, self._feed_of_round
        )
        try:
            try:
                initial = await phase.open(plan)
            except StoreError as exc:
                self._reread(plan, exc)
                return None, extra
            self._rereads = 0
            if extra is not None:
                initial.append(extra)
            out = await self._process(plan, initial)
            if out is None:
                out = await self._wait_loop(plan)
            return out, None
        finally:
            await phase.close()

    def _phase_moved(self, plan: PhasePlan) -> bool:
        return self._plan_now() != plan or self._observer.resnap

    def _plan_now(self) -> PhasePlan | None:
        return plan_phase(self.rules.state, self.rules.ctx.round)

    async def _process(self, plan: PhasePlan, events: list[Event]) -> Outcome | None:
        for ev in events:
            out = await self._feed(ev)
            if out is not None:
                return out
            if self._phase_moved(plan):
                return None
        return None

    async def _wait_loop(self, plan: PhasePlan) -> Outcome | None:
        """Wait for the inbox or the nearest deadline, and feed what comes,
        until the phase moves on (None) or an action ends the call."""
        assert self._inbox is not None
        while not self._phase_moved(plan):
            self._report()
            timer, deadline = min(
                self._timers.items(), key=lambda kv: kv[1], default=(None, math.inf)
            )
            try:
                message = await wait_until(self._inbox.get(), deadline, self.clock)
            except TimeoutError:
                assert timer is not None  # an infinite deadline never passes
                del self._timers[timer]
                out = await self._feed(TIMER_EVENTS[timer])
            else:
                out = await self._receive(plan, message)
            if out is not None:
                return out
        return None

    def _report(self) -> None:
        """What this node waits for (reported only when it changed)."""
        now, view = self.clock.monotonic(), self._observer.view
        self._reporter.update(waiting_status(self.rules, self._timers, view, self.settings, now))

    async def _receive(self, plan: PhasePlan, message: Message) -> Outcome | None:
        """Feed what one inbox message means."""
        match message:
            case LeaseGone(lease, reason):
                if lease != self.keeper.lease:
                    return None  # about a lease already replaced
                return await self._feed(LeaseLost(f"this node's {reason}"))
            case WatchFired(phase_id, watched, wev) if phase_id in (self._phase_id, FEED):
                return await self._process(plan, await self._observer.translate(watched, wev))
            case WatchFailed(phase_id, exc) if phase_id in (self._phase_id, FEED):
                if phase_id == FEED:
                    await self._feed_of_round.close()
                self._reread(plan, exc)
                self._observer.resnap = True  # read, then watch again
        return None  # (or from the watches of an earlier phase)

    def _reread(self, plan: PhasePlan, exc: StoreError) -> None:
        """A watch of the phase lost history it needs (compacted, or cut off
        by the store for falling behind): the phase is read and watched again,
        at most MAX_REREADS times in a row. Any other error is raised."""
        self._rereads += 1
        if not rereadable(exc) or self._rereads > MAX_REREADS:
            raise exc
        self.events.emit(
            WatchReread(
                node=self.node_id, phase=plan.phase.value, round=plan.round, reason=str(exc)
            )
        )

    async def _feed(self, event: Event) -> Outcome | None:
        for action in self.rules.handle(event):
            out = await self._executor.execute(action)
            if out is not None:
                return out
        return None


def create_dynamic_rendezvous(
    store: Store,
    settings: RendezvousSettings,
    *,
    events: EventSink | None = None,
    clock: Clock = SYSTEM_CLOCK,
    node_id: str | None = None,
) -> DynamicRendezvous:
    """Build a node's dynamic rendezvous handle (the launcher's entry point)."""
    return DynamicRendezvous(store, settings, events=events, clock=clock, node_id=node_id)


# -- the phases: the driver's inbox ---------------------------------------------------------------
@frozen(slots=True)
class WatchFired:
    """An event of one of phase ``phase_id``'s watches."""

    phase_id: int
    watched: P.Watched
    event: WatchEvent


@frozen(slots=True)
class WatchFailed:
    """One of phase ``phase_id``'s watches ended with a store error."""

    phase_id: int
    error: StoreError


@frozen(slots=True)
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
            node.events.emit(RoundOpened(round=0, reason="job_started", node=node.node_id))

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
            step = B.barrier_step(members, self.node.node_id, count, present, done, size=size)
            if isinstance(step, B.BeWatcher) and r not in view.results:
                # Past the members known (group rank 0): read them all.
                members = (await obs.get_result(r)).members
            elif isinstance(step, B.CheckPresence):
                kvs, revs[step.node_id] = await read(store, k.node(step.node_id), False)
                present[step.node_id] = bool(obs.records(P.Watched.NODES, kvs))
            elif isinstance(step, B.CheckDone):
                done[step.node_id] = await obs.finished(step.node_id)
            elif isinstance(step, B.WatchWatcher):
                obs.view.watcher = step.node_id
                rev = revs[step.node_id]
                await self._watch(P.Watched.WATCHER, k.node(step.node_id), False, rev)
                return []
            elif isinstance(step, B.LostAtBarrier):
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
