"""The dynamic (store-backed) rendezvous: the driver of :mod:`.rules`.

The driver does the store I/O. For each *phase* (the machine's state and
round) it reads what that phase needs, opens watches from the revision after
each read, turns what it reads and what the watches deliver into rule events,
and executes the actions the rules return. Waits are on watches and on the
nearest deadline; nothing polls. See docs/rendezvous.md for the protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elastrun.clock import SYSTEM_CLOCK, Clock
from elastrun.errors import (
    ConfigMismatch,
    RendezvousClosed,
    RendezvousError,
    RendezvousTimeout,
    RestartBudgetExhausted,
    StoreError,
)
from elastrun.events import EventSink, NullSink
from elastrun.rendezvous import keys as K
from elastrun.rendezvous import records as R
from elastrun.rendezvous.api import (
    Change,
    Rendezvous,
    RendezvousSettings,
    RoundResult,
)
from elastrun.rendezvous.rules import Act, Action, Context, Ev, Event, Rules, State, Timer
from elastrun.store.base import Compare, Delete, Get, KeyValue, Put, Store, Watch, WatchEvent
from elastrun.store.keepalive import LeaseKeeper

__all__ = ["DynamicRendezvous", "create_dynamic_rendezvous"]

_PHASES = {
    State.SEEKING: "seek",
    State.JOINING: "join",
    State.DECIDING: "join",
    State.WAITING: "wait",
    State.MEMBER: "member",
    State.COMPLETING: "complete",
}


def _safe_id(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", text) or "node"


@dataclass
class _View:
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
    decider: bool = False


@dataclass
class _Outcome:
    result: RoundResult | None = None
    change: Change | None = None
    error: BaseException | None = None


class DynamicRendezvous(Rendezvous):
    """One node's handle on a job's dynamic rendezvous in a :class:`Store`."""

    def __init__(
        self,
        store: Store,
        settings: RendezvousSettings,
        *,
        events: EventSink | None = None,
        clock: Clock = SYSTEM_CLOCK,
        node_id: str | None = None,
    ) -> None:
        self.store = store
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
                min_nodes=settings.min_nodes,
                max_nodes=settings.max_nodes,
                max_restarts=settings.max_restarts,
                join_timeout=settings.join_timeout,
                last_call_timeout=settings.last_call_timeout,
                exit_barrier_timeout=settings.exit_barrier_timeout,
            )
        )
        self.keeper = LeaseKeeper(store, settings.lease_ttl, clock=clock, on_lost=self._lease_lost)
        self._registered = False
        self._timers: dict[Timer, float] = {}
        self._inbox: asyncio.Queue[tuple[int, str, Any]] | None = None
        self._phase_id = 0
        self._resnap = False
        self._view = _View()
        self._result: RoundResult | None = None
        self._failure: dict[str, Any] | None = None
        self._port = 0
        self._joiner_hosts: dict[tuple[int, str], str] = {}  # everyone seen joining

    # -- the Rendezvous interface ------------------------------------------
    async def next_round(self) -> RoundResult:
        if self.rules.state is State.LEFT:
            raise RendezvousClosed("this node has left the job (shutdown was called)")
        if self.rules.state not in (State.FINISHED, State.FAILED):
            await self._register()
        out = await self._run(Event(Ev.NEXT_ROUND, now=self.clock.monotonic()))
        assert out.result is not None
        return out.result

    async def wait_for_change(self) -> Change:
        if self.rules.state is not State.MEMBER:
            return R.round_change(self._view.round, "")
        out = await self._run(None)
        assert out.change is not None
        return out.change

    async def request_restart(self, failure: dict[str, Any]) -> None:
        self._failure = dict(failure)
        self.events.emit("restart_requested", node=self.node_id, failure=self._failure)

        def workers_failed(view: _View) -> Event:
            restarts = int((view.round or {}).get("restarts", 0))
            return Event(Ev.WORKERS_FAILED, now=self.clock.monotonic(), restarts=restarts)

        if self.rules.state is State.MEMBER:
            await self._run(None, workers_failed)
        elif self.rules.state in (State.IDLE, State.FAILED):
            await self._feed(workers_failed(self._view))

    async def complete(self) -> None:
        if self.rules.state is not State.MEMBER:
            return
        await self._run(None, lambda v: Event(Ev.WORKERS_SUCCEEDED, now=self.clock.monotonic()))

    async def shutdown(self) -> None:
        if self.rules.state is State.LEFT:
            return
        self.events.emit("node_left", node=self.node_id, host=self.host)
        await self._feed(Event(Ev.SHUTDOWN))

    # -- registration ----------------------------------------------------------
    async def _register(self) -> None:
        if self._registered and self.keeper.alive:
            return
        await self._check_config()
        await self.keeper.start()
        await self._put_presence()
        self._registered = True

    async def _put_presence(self) -> None:
        record = {
            "node_id": self.node_id,
            "host": self.host,
            "addr": self.addr,
            "nproc": self.settings.nproc,
            "rank_hint": self.settings.node_rank_hint,
            "pid": os.getpid(),
            "since": time.time(),
        }
        await self.store.put(self.keys.node(self.node_id), K.encode(record), self.keeper.lease)

    async def _check_config(self) -> None:
        mine = self.settings.agreed()
        key = self.keys.config
        if await self.store.create(key, K.encode({"settings": mine})):
            return
        kv = await self.store.get(key)
        if kv is None:  # deleted in between: try again once
            await self.store.create(key, K.encode({"settings": mine}))
            return
        job = K.decode(key, kv.value).get("settings", {})
        mismatch = R.config_diff(self.settings.run_id, job, mine)
        if mismatch is not None:
            message, diffs = mismatch
            self.events.emit("config_mismatch", node=self.node_id, message=message)
            raise ConfigMismatch(message, diffs)

    def _lease_lost(self, reason: str) -> None:
        if self._inbox is not None:
            self._inbox.put_nowait((-1, "lease_lost", (self.keeper.lease, reason)))

    # -- the pump ----------------------------------------------------------------
    def _phase(self) -> tuple[str, int] | None:
        name = _PHASES.get(self.rules.state)
        return None if name is None else (name, self.rules.ctx.round)

    async def _run(
        self, first: Event | None, extra: Callable[[_View], Event] | None = None
    ) -> _Outcome:
        if self._inbox is None:
            self._inbox = asyncio.Queue()
        if first is not None:
            out = await self._feed(first)
            if out is not None:
                return self._finish(out)
        while True:
            phase = self._phase()
            if phase is None:
                raise RendezvousError(f"rendezvous in state {self.rules.state.name}: no phase")
            self._phase_id += 1
            self._resnap = False
            watches: list[Watch] = []
            tasks: list[asyncio.Task[None]] = []
            try:
                initial = await self._setup(phase, watches, tasks)
                if extra is not None:
                    initial.append(extra)
                    extra = None
                out = await self._process(phase, initial)
                if out is None:
                    out = await self._wait_loop(phase)
                if out is not None:
                    return self._finish(out)
            finally:
                for task in tasks:
                    task.cancel()
                for watch in watches:
                    with contextlib.suppress(StoreError, OSError):
                        await watch.close()

    def _finish(self, out: _Outcome) -> _Outcome:
        if out.error is not None:
            raise out.error
        return out

    async def _process(
        self, phase: tuple[str, int], items: list[Event | Callable[[_View], Event]]
    ) -> _Outcome | None:
        for item in items:
            ev = item if isinstance(item, Event) else item(self._view)
            out = await self._feed(ev)
            if out is not None:
                return out
            if self._phase() != phase or self._resnap:
                return None
        return None

    async def _wait_loop(self, phase: tuple[str, int]) -> _Outcome | None:
        assert self._inbox is not None
        while self._phase() == phase and not self._resnap:
            timer, deadline = min(
                self._timers.items(), key=lambda kv: kv[1], default=(None, math.inf)
            )
            timeout = None if math.isinf(deadline) else max(0.0, deadline - self.clock.monotonic())
            try:
                pid, tag, payload = await asyncio.wait_for(self._inbox.get(), timeout)
            except TimeoutError:
                if timer is None:
                    continue
                del self._timers[timer]
                ev_type = {
                    Timer.JOIN: Ev.JOIN_TIMEOUT,
                    Timer.LAST_CALL: Ev.LAST_CALL_EXPIRED,
                    Timer.BARRIER: Ev.BARRIER_TIMEOUT,
                }[timer]
                out = await self._feed(Event(ev_type, now=self.clock.monotonic()))
                if out is not None:
                    return out
                continue
            if tag == "lease_lost":
                lease, reason = payload
                if lease != self.keeper.lease:
                    continue  # about a lease already replaced
                out = await self._feed(Event(Ev.LEASE_LOST, detail=f"this node's {reason}"))
            elif pid != self._phase_id:
                continue  # from the watches of an earlier phase
            elif tag == "error":
                raise payload
            else:
                events = await self._translate(tag, payload)
                out = await self._process(phase, list(events))
            if out is not None:
                return out
        return None

    # -- phase set-up: reads, then watches from the revision after each read ----
    async def _read(self, key: str, prefix: bool) -> tuple[list[KeyValue], int]:
        res = await self.store.txn([], [Get(key, prefix)])
        return res.gets[0], res.revision

    async def _watch(
        self, tag: str, key: str, prefix: bool, rev: int, watches: list[Watch], *, tasks: list[Any]
    ) -> None:
        watch = await self.store.watch(key, prefix=prefix, start_revision=rev + 1)
        watches.append(watch)
        tasks.append(asyncio.get_running_loop().create_task(self._drain(tag, watch)))

    async def _drain(self, tag: str, watch: Watch) -> None:
        pid, inbox = self._phase_id, self._inbox
        assert inbox is not None
        try:
            async for wev in watch:
                inbox.put_nowait((pid, tag, wev))
        except StoreError as exc:
            inbox.put_nowait((pid, "error", exc))

    async def _setup(
        self, phase: tuple[str, int], watches: list[Watch], tasks: list[Any]
    ) -> list[Event | Callable[[_View], Event]]:
        name, r = phase
        k = self.keys
        view = _View(results=self._view.results)
        self._view = view
        kvs, rev = await self._read(k.round, False)
        if not kvs:
            await self._create_first_round()
            kvs, rev = await self._read(k.round, False)
        self._set_round(kvs[0] if kvs else None)
        await self._watch("round", k.round, False, rev, watches, tasks=tasks)
        rnd = int(view.round["round"]) if view.round else r
        events: list[Event | Callable[[_View], Event]] = []
        if name == "join":
            joins, jrev = await self._read(k.joins(r), True)
            view.joiners = {K.node_id_of(kv.key): kv for kv in joins}
            self._saw_joiners(r, joins)
            order = sorted(joins, key=lambda kv: kv.create_revision)
            ids = [K.node_id_of(kv.key) for kv in order]
            view.decider = bool(ids) and ids[0] == self.node_id
            if view.decider:
                await self._watch("join", k.joins(r), True, jrev, watches, tasks=tasks)
                nodes, nrev = await self._read(k.nodes, True)
                view.nodes = {K.node_id_of(kv.key): kv for kv in nodes}
                view.nodes_loaded = True
                await self._watch("nodes", k.nodes, True, nrev, watches, tasks=tasks)
            elif self.node_id in ids:
                pred = ids[ids.index(self.node_id) - 1]
                view.predecessor = pred
                await self._watch("pred", k.join(r, pred), False, jrev, watches, tasks=tasks)
        if name in ("wait", "member", "complete"):
            nodes, nrev = await self._read(k.nodes, True)
            view.nodes = {K.node_id_of(kv.key): kv for kv in nodes}
            view.nodes_loaded = True
            await self._watch("nodes", k.nodes, True, nrev, watches, tasks=tasks)
        if name == "complete":
            # Read after this node's own done key: the last member to finish
            # sees every done key and marks the job finished; the others learn
            # of it from the round record (no O(n^2) watch on done keys).
            dones, _ = await self._read(k.dones(r), True)
            view.done = {K.node_id_of(kv.key) for kv in dones}
        if name == "member":
            waiting, wrev = await self._read(k.waiting_prefix, True)
            view.waiting = {K.node_id_of(kv.key): kv for kv in waiting}
            await self._watch("waiting", k.waiting_prefix, True, wrev, watches, tasks=tasks)
        round_ev = await self._round_event()
        if round_ev is not None:
            events.append(round_ev)
        if name == "join":
            events.append(self._joiners_event())
        if name in ("wait", "member", "complete") and rnd == r:
            events.extend(await self._lost_events())
        if name == "member" and rnd == r:
            events.extend(self._waiting_event(n) for n in view.waiting)
        if name == "complete" and rnd == r and self._all_done():
            events.append(Event(Ev.BARRIER_DONE))
        return events

    # -- translating what the store says into rule events -----------------------
    def _set_round(self, kv: KeyValue | None) -> None:
        self._view.round_kv = kv
        self._view.round = None if kv is None else K.decode(kv.key, kv.value)

    async def _round_event(self) -> Event | None:
        rec = self._view.round
        if rec is None:
            return None
        r, state = int(rec["round"]), rec["state"]
        now = self.clock.monotonic()
        if state == K.OPEN:
            return Event(Ev.ROUND_OPEN, now=now, round=r)
        if state == K.FINISHED:
            return Event(Ev.ROUND_FINISHED, now=now, round=r)
        if state == K.FAILED:
            return Event(Ev.ROUND_FAILED, now=now, round=r)
        result = await self._get_result(r)
        members = [m["node_id"] for m in result["members"]]
        lost = ""
        if self._view.nodes_loaded:
            gone = [m for m in members if m not in self._view.nodes]
            lost = f"node {gone[0]} lost (no presence in the store)" if gone else ""
        return Event(
            Ev.ROUND_CLOSED,
            now=now,
            round=r,
            member=self.node_id in members,
            room=len(members) < self.settings.max_nodes,
            lost=lost,
            detail=f"node {self.host} ({self.node_id}) waits to join",
        )

    async def _get_result(self, r: int) -> dict[str, Any]:
        if r not in self._view.results:
            kv = await self.store.get(self.keys.result(r))
            if kv is None:
                raise RendezvousError(f"round {r} is closed but has no result record")
            self._view.results[r] = K.decode(kv.key, kv.value)
        return self._view.results[r]

    def _members(self) -> list[dict[str, Any]]:
        result = self._view.results.get(self.rules.ctx.round)
        return list(result["members"]) if result else []

    async def _finished(self, node_id: str) -> bool:
        """Whether a member put its done key for this round (it left after
        its workers succeeded: not a loss)."""
        if node_id in self._view.done:
            return True
        if await self.store.get(self.keys.done(self.rules.ctx.round, node_id)) is not None:
            self._view.done.add(node_id)
            return True
        return False

    async def _lost_events(self) -> list[Event]:
        out = []
        for m in self._members():
            nid = m["node_id"]
            if nid not in self._view.nodes and not await self._finished(nid):
                out.append(self._lost_event(m, "lease expired or revoked"))
        return out

    def _lost_event(self, member: dict[str, Any], how: str) -> Event:
        detail = f"node {member['host']} ({member['node_id']}) lost: {how}"
        return Event(Ev.MEMBER_LOST, now=self.clock.monotonic(), detail=detail)

    def _waiting_event(self, node_id: str) -> Event:
        room = len(self._members()) < self.settings.max_nodes
        kv = self._view.waiting.get(node_id)
        host = K.decode(kv.key, kv.value).get("host", node_id) if kv else node_id
        detail = f"node {host} ({node_id}) waits to join"
        return Event(Ev.NODE_WAITING, now=self.clock.monotonic(), room=room, detail=detail)

    def _all_done(self) -> bool:
        members = self._members()
        return bool(members) and all(m["node_id"] in self._view.done for m in members)

    def _joiners_event(self) -> Event:
        view = self._view
        prev = (view.round or {}).get("prev") or []
        all_joined = (
            bool(prev)
            and view.nodes_loaded
            and all(nid in view.joiners for nid in view.nodes)
            and not view.waiting
        )
        return Event(
            Ev.JOINERS_CHANGED,
            now=self.clock.monotonic(),
            round=self.rules.ctx.round,
            count=len(view.joiners),
            decider=view.decider,
            all_joined=all_joined,
        )

    async def _translate(self, tag: str, wev: WatchEvent) -> list[Event]:
        view, nid, put = self._view, K.node_id_of(wev.kv.key), wev.type == "put"
        if tag == "round":
            self._set_round(wev.kv if put else None)
            ev = await self._round_event()
            return [] if ev is None else [ev]
        if tag == "pred":
            if not put:
                self._resnap = True  # my predecessor left: am I the decider now?
            return []
        if tag == "join":
            if put:
                view.joiners[nid] = wev.kv
                self._saw_joiners(self.rules.ctx.round, [wev.kv])
            else:
                view.joiners.pop(nid, None)
            return [self._joiners_event()]
        if tag == "nodes":
            if put:
                view.nodes[nid] = wev.kv
                return [self._joiners_event()] if view.decider else []
            view.nodes.pop(nid, None)
            if view.decider:
                return [self._joiners_event()]
            for m in self._members():
                if m["node_id"] == nid and not await self._finished(nid):
                    return [self._lost_event(m, "lease expired or revoked")]
            return []
        if tag == "waiting":
            if put:
                view.waiting[nid] = wev.kv
                return [self._waiting_event(nid)]
            view.waiting.pop(nid, None)
        return []

    # -- executing actions -------------------------------------------------------
    async def _feed(self, event: Event) -> _Outcome | None:
        for action in self.rules.handle(event):
            out = await self._execute(action)
            if out is not None:
                return out
        return None

    async def _execute(self, a: Action) -> _Outcome | None:
        t = a.type
        if t is Act.ARM:
            assert a.timer is not None
            self._timers[a.timer] = a.deadline
        elif t is Act.CANCEL:
            if a.timer is not None:
                self._timers.pop(a.timer, None)
        elif t is Act.READ_ROUND:
            pass  # the SEEKING phase reads the round record
        elif t is Act.JOIN:
            await self._join(a.round)
        elif t is Act.LEAVE:
            await self._note_joiners(a.round)
            await self.store.txn(
                [],
                [Delete(self.keys.join(a.round, self.node_id)), Delete(self._waiting_key)],
            )
        elif t is Act.WAIT:
            rec = {"node_id": self.node_id, "host": self.host, "round": a.round}
            await self.store.put(self._waiting_key, K.encode(rec), self.keeper.lease)
        elif t is Act.CLOSE_ROUND:
            await self._close_round(a)
        elif t is Act.OPEN_ROUND:
            await self._open_round(a)
        elif t is Act.FAIL_JOB:
            await self._fail_job(a)
        elif t is Act.PUT_DONE:
            await self.store.put(self.keys.done(a.round, self.node_id), K.encode({}))
        elif t is Act.MARK_FINISHED:
            await self._mark_finished(a.round)
        elif t is Act.RENEW_LEASE:
            await self.keeper.start()
            await self._put_presence()
        elif t is Act.REVOKE:
            await self.keeper.stop(revoke=True)
        elif t is Act.RETURN_RESULT:
            return _Outcome(result=await self._round_result(a.round))
        elif t is Act.RETURN_CHANGE:
            return _Outcome(change=R.round_change(self._view.round, a.reason, a.detail))
        elif t is Act.RETURN:
            return _Outcome()
        elif t is Act.RAISE:
            return _Outcome(error=await self._error(a))
        return None

    @property
    def _waiting_key(self) -> str:
        return self.keys.waiting(self.node_id)

    async def _create_first_round(self) -> None:
        if await self.store.create(self.keys.round, K.encode(R.first_round())):
            self.events.emit("round_opened", round=0, reason="job_started", node=self.node_id)

    async def _join(self, r: int) -> None:
        kv = self._view.round_kv
        if kv is None or self._view.round is None or self._view.round["round"] != r:
            return
        if not self._port:
            self._port = await asyncio.to_thread(R.pick_master_port, self.settings.addr)
        rec = {
            "node_id": self.node_id,
            "host": self.host,
            "addr": self.addr,
            "nproc": self.settings.nproc,
            "rank_hint": self.settings.node_rank_hint,
            "port": self._port,
            "pid": os.getpid(),
        }
        res = await self.store.txn(
            [Compare.unchanged(self.keys.round, kv.mod_revision)],
            [
                Put(self.keys.join(r, self.node_id), K.encode(rec), self.keeper.lease),
                Delete(self._waiting_key),
            ],
        )
        if res.succeeded:
            self.events.emit("node_joined", round=r, node=self.node_id, host=self.host)

    async def _close_round(self, a: Action) -> None:
        view, kv, r = self._view, self._view.round_kv, a.round
        if kv is None or view.round is None or view.round.get("state") != K.OPEN:
            return
        order = sorted(view.joiners.values(), key=lambda kv: kv.create_revision)
        joiners = [K.decode(j.key, j.value) for j in order]
        closed, result = R.close_records(view.round, joiners, self.settings.max_nodes, a.reason)
        members = result["members"]
        res = await self.store.txn(
            [Compare.unchanged(self.keys.round, kv.mod_revision)],
            [
                Put(self.keys.round, K.encode(closed)),
                Put(self.keys.result(r), K.encode(result)),
            ],
        )
        if res.succeeded:
            view.results[r] = K.decode("result", K.encode(result))
            self.events.emit(
                "round_closed",
                round=r,
                reason=a.reason,
                members=[m["host"] for m in members],
                ranks={m["node_id"]: m["group_rank"] for m in members},
            )

    def _closed_round_kv(self, r: int) -> tuple[KeyValue, dict[str, Any]] | None:
        kv, rec = self._view.round_kv, self._view.round
        if kv is None or rec is None or rec["round"] != r or rec["state"] != K.CLOSED:
            return None
        return kv, rec

    async def _open_round(self, a: Action) -> None:
        found = self._closed_round_kv(a.round)
        if found is None:
            return
        kv, rec = found
        result = await self._get_result(a.round)
        new = R.next_round_record(
            rec, result, a.reason, a.detail, counts=a.counts, failure=self._failure
        )
        if await self.store.compare_and_set(self.keys.round, kv.mod_revision, K.encode(new)):
            if a.reason == "member_lost":
                self.events.emit("node_lost", round=a.round, detail=a.detail, by=self.node_id)
            self.events.emit(
                "round_opened", round=a.round + 1, reason=a.reason, detail=a.detail, by=self.node_id
            )

    async def _fail_job(self, a: Action) -> None:
        found = self._closed_round_kv(a.round)
        if found is None:
            return
        kv, rec = found
        new = {**rec, "state": K.FAILED, "last_failure": self._failure}
        if await self.store.compare_and_set(self.keys.round, kv.mod_revision, K.encode(new)):
            self.events.emit("job_failed", round=a.round, reason="restart budget exhausted")

    async def _mark_finished(self, r: int) -> None:
        found = self._closed_round_kv(r)
        if found is None:
            return
        kv, rec = found
        new = {**rec, "state": K.FINISHED}
        if await self.store.compare_and_set(self.keys.round, kv.mod_revision, K.encode(new)):
            self.events.emit("job_finished", round=r)

    async def _round_result(self, r: int) -> RoundResult:
        result = await self._get_result(r)
        self._result = R.round_result(
            self.settings.run_id, self.node_id, result, self.settings.max_restarts
        )
        return self._result

    async def _note_joiners(self, r: int) -> None:
        """Remember who joined round ``r`` (for the join-timeout message): the
        joiners this node saw, and those in the store now."""
        with contextlib.suppress(StoreError):
            self._saw_joiners(r, (await self._read(self.keys.joins(r), True))[0])

    def _saw_joiners(self, r: int, kvs: list[KeyValue]) -> None:
        for kv in kvs:
            host = str(K.decode(kv.key, kv.value)["host"])
            self._joiner_hosts[(r, K.node_id_of(kv.key))] = host

    async def _error(self, a: Action) -> BaseException:
        s, r = self.settings, a.round
        if a.error == "closed":
            return RendezvousClosed(
                f"job {s.run_id!r} has finished: there will be no further rounds"
            )
        if a.error == "budget":
            rec = self._view.round or {}
            return RestartBudgetExhausted(
                f"job {s.run_id!r} used its restart budget ({s.max_restarts} restarts, "
                f"--max-restarts); last failure: {rec.get('last_failure')}"
            )
        await self._note_joiners(r)
        joins = sorted(h for (jr, _), h in self._joiner_hosts.items() if jr == r)
        if self.rules.ctx.round == r and self._view.round and self._view.round["state"] != K.OPEN:
            return RendezvousTimeout(
                f"round {r} closed without this node and no new round opened before "
                f"join_timeout={s.join_timeout:g}s (job is full: max {s.max_nodes} nodes)"
            )
        return RendezvousTimeout(
            f"{len(joins)} of min {s.min_nodes} nodes joined before "
            f"join_timeout={s.join_timeout:g}s: {', '.join(joins) or 'none'}"
        )


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
