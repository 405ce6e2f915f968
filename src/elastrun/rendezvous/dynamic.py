"""The dynamic (store-backed) rendezvous: the driver of :mod:`.rules`.

The driver does the store I/O; the decisions are the rules' (:mod:`.rules`)
and the planner's (:mod:`.plan`), both pure. For each *phase* (the machine's
state and round) it reads what the planner says that phase needs, opens
watches from the revision after each read (:mod:`.phases`), does the reads the
planner's answers need to become rule events (:mod:`.view`), and executes the
actions the rules return (:mod:`.actions`). Waits are on the inbox (watch
events, a lost lease) and on the nearest deadline, through the injected clock;
nothing polls. While ``next_round()`` waits, it reports what for
(:mod:`.progress`). See docs/rendezvous.md for the protocol.

This module is the pump: the :class:`~.api.Rendezvous` calls, registration and
config agreement, and the loop that feeds events to the rules until one of
their actions ends the call.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import os
import re
import socket

from elastrun.clock import SYSTEM_CLOCK, Clock, wait_until
from elastrun.errors import (
    RendezvousClosed,
    RendezvousError,
    RevisionCompacted,
    StoreError,
    StoreReset,
    WatchCancelled,
)
from elastrun.events import EventSink, NullSink
from elastrun.failure import FailureRecord, first_failure
from elastrun.rendezvous import keys as K
from elastrun.rendezvous import root_cause, rounds
from elastrun.rendezvous.actions import Executor, Outcome
from elastrun.rendezvous.api import (
    Change,
    Rendezvous,
    RendezvousHooks,
    RendezvousSettings,
    RoundResult,
)
from elastrun.rendezvous.note_access import NoteAccess
from elastrun.rendezvous.phases import (
    FEED,
    Inbox,
    LeaseGone,
    Message,
    OpenPhase,
    RoundFeed,
    WatchFailed,
    WatchFired,
)
from elastrun.rendezvous.plan import PhasePlan, plan_phase
from elastrun.rendezvous.progress import ProgressReporter, waiting_status
from elastrun.rendezvous.records import RoundRecord, RoundState
from elastrun.rendezvous.register import Registration
from elastrun.rendezvous.rules import (
    TIMER_EVENTS,
    Context,
    Event,
    LeaseLost,
    NextRound,
    Rules,
    Shutdown,
    State,
    Timer,
    WorkersFailed,
    WorkersSucceeded,
)
from elastrun.rendezvous.takeover import register_after_takeover
from elastrun.rendezvous.view import Node, Observer
from elastrun.store.base import Store
from elastrun.store.keepalive import LeaseKeeper

__all__ = ["DynamicRendezvous", "create_dynamic_rendezvous"]


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


class DynamicRendezvous(NoteAccess, Rendezvous):
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
        node = Node(store, settings, self.keys, self.node_id, host, self.addr, clock, self.events)
        self._node = node
        self._timers: dict[Timer, float] = {}
        self._observer = Observer(node, self.rules)
        self._executor = Executor(node, self._observer, self.keeper, self._timers)
        self._registration = Registration(node, self._observer, self._executor.presence)
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
        self.events.emit("restart_requested", node=self.node_id, failure=failure.to_json())
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
        self.events.emit("node_left", node=self.node_id, host=self.host)
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
            # job whatever it finds (never starts a new one, see .reuse),
            # while the store is unreachable for at most join_timeout.
            await self._executor.regain_lease(self._registration.check_config)
            return
        await self.keeper.start()
        if self.carry is not None:
            await register_after_takeover(
                self.store,
                self.settings,
                self.carry,
                self._executor.presence,
                self._registration.agree,
            )
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
            "watch_reread",
            node=self.node_id,
            phase=plan.phase.value,
            round=plan.round,
            reason=str(exc),
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
