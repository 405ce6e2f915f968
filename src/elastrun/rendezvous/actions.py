"""Executing the rules' actions against the store (the driver's writes).

Every write to the job's ``round`` record is a compare-and-set against the
revision this node last saw; whether it won or lost, the outcome comes back
through the phase's watch on ``round`` as an ordinary event. Actions that end a
call (``RETURN_*``, ``RAISE``) produce an :class:`Outcome`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from elastrun.endpoint import Endpoint
from elastrun.errors import (
    StoreError,
)
from elastrun.failure import FailureRecord
from elastrun.rendezvous import notes as N
from elastrun.rendezvous import rounds
from elastrun.rendezvous.api import Change, RoundResult
from elastrun.rendezvous.barrier_plan import BarrierSeen
from elastrun.rendezvous.explain import call_error, spare, waiting_reason
from elastrun.rendezvous.protocol import Act, Action, Timer
from elastrun.rendezvous.records import (
    DONE,
    JoinRecord,
    MemberRecord,
    NodeInfo,
    PresenceRecord,
    RoundRecord,
    RoundState,
    WaitingRecord,
)
from elastrun.rendezvous.regain import regain
from elastrun.rendezvous.results import Head, shard_count, stored_form
from elastrun.rendezvous.sizes import promotions
from elastrun.rendezvous.view import Node, Observer
from elastrun.store.base import Compare, Count, Delete, Get, KeyValue, Op, Put
from elastrun.store.keepalive import LeaseKeeper, describe_store
from elastrun.untrusted import printable

__all__ = ["HANDLERS", "Executor", "Outcome"]


@dataclass
class Outcome:
    result: RoundResult | None = None
    change: Change | None = None
    error: BaseException | None = None


class Executor:
    """Executes :class:`~.rules.Action` values for one node."""

    def __init__(
        self, node: Node, observer: Observer, keeper: LeaseKeeper, timers: dict[Timer, float]
    ) -> None:
        self.node = node
        self.observer = observer
        self.keeper = keeper
        self.timers = timers  # the driver's armed deadlines (absolute, monotonic)
        self.failure: FailureRecord | None = None  # the last failure reported
        self.port = 0  # the master port this node offers (picked once)
        self.notice: Callable[[str], None] | None = None  # a line for the operator
        self.waited_as_spare = False  # this node's last wait was as a spare
        self.done_round: int | None = None  # the last round this node put its done key in

    @property
    def _waiting_key(self) -> str:
        return self.node.keys.waiting(self.node.node_id)

    async def execute(self, a: Action) -> Outcome | None:
        """Carry ``a`` out; an :class:`Outcome` where it ends the call."""
        return await HANDLERS[a.type](self, a)

    async def _arm(self, a: Action) -> None:
        assert a.timer is not None
        self.timers[a.timer] = a.deadline

    async def _cancel(self, a: Action) -> None:
        if a.timer is not None:
            self.timers.pop(a.timer, None)

    async def _read_round(self, a: Action) -> None:
        pass  # the SEEKING phase reads the round record

    async def _leave(self, a: Action) -> None:
        node = self.node
        await self.observer.note_joiners(a.round)
        await node.store.txn(
            [], [Delete(node.keys.join(a.round, node.node_id)), Delete(self._waiting_key)]
        )

    async def _wait(self, a: Action) -> None:
        node = self.node
        rec = WaitingRecord(node.node_id, node.host, a.round)
        await node.store.put(self._waiting_key, rec.encode(), self.keeper.lease)
        self.waited_as_spare = self._spare(a.round)
        node.events.emit(
            "node_waiting",
            round=a.round,
            node=node.node_id,
            host=node.host,
            reason=waiting_reason(node.settings, a.round, self.observer.view.size(a.round)),
            spare=self._spare(a.round),
        )

    async def _put_done(self, a: Action) -> None:
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

    async def _renew_lease(self, a: Action) -> None:
        # At the exit barrier, no longer than the barrier's own deadline.
        barrier = self.timers.get(Timer.BARRIER)
        left = None if barrier is None else max(0.0, barrier - self.node.clock.monotonic())
        await self.regain_lease(window=left, limit=None if left is None else "the exit barrier")

    async def regain_lease(
        self,
        check: Callable[[], Awaitable[None]] | None = None,
        window: float | None = None,
        limit: str | None = None,
    ) -> None:
        """A new lease and the presence key again after the lease was lost
        (``check`` first, each try): retried while the store is unreachable,
        at most ``join_timeout`` (or ``window``, named ``limit``, if shorter:
        :mod:`.regain`)."""
        node, keeper = self.node, self.keeper
        lost = keeper.lost_reason or "lease lost"
        full = node.settings.join_timeout
        if window is None or window >= full:
            window, limit = full, None
        said = f"join_timeout={window:g}s" if limit is None else f"{window:.0f}s: {limit}"
        tries = [1]

        async def attempt() -> None:
            if check is not None:
                await check()
            await keeper.start()
            await self.put_presence()

        def on_retry(exc: BaseException) -> None:
            tries[0] += 1

        if self.notice is not None:
            self.notice(
                f"elastrun: this node lost its lease ({printable(lost)}); registering again "
                f"(for up to {said} while the store is unreachable)"
            )
        took = await regain(
            attempt, window=window, clock=node.clock, lost=lost, on_retry=on_retry,
            store=describe_store(node.store), limit=limit,
        )  # fmt: skip
        node.events.emit(
            "lease_regained", node=node.node_id, lost=lost, tries=tries[0], after_s=took
        )
        if self.notice is not None:
            self.notice(f"elastrun: registered again after {took:.1f}s: rejoining the job")

    async def _revoke(self, a: Action) -> None:
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

    async def _return_result(self, a: Action) -> Outcome:
        node = self.node
        result = await self._round_result(a.round)
        rec = self.observer.view.round
        prev = {p.node_id: p.group_rank for p in rec.prev} if rec and rec.round == a.round else {}
        node.events.emit(
            "round_joined",
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
            node.events.emit("spare_promoted", round=r, node=nid, group_rank=rank, replaces=lost)
            if lost is not None and self.waited_as_spare and self.notice is not None:
                # Node ids are checked ([A-Za-z0-9._-]): nothing to escape.
                self.notice(
                    f"elastrun: round {r}: this spare trains now, as group rank {rank}, "
                    f"in place of node {lost}, which left the group"
                )

    async def _return_change(self, a: Action) -> Outcome:
        return Outcome(change=rounds.round_change(self.observer.view.round, a.reason, a.detail))

    async def _return(self, a: Action) -> Outcome:
        return Outcome()

    async def _raise(self, a: Action) -> Outcome:
        return Outcome(error=await call_error(a, self.node.settings, self.observer))

    def _me(self) -> NodeInfo:
        """This node, as its presence and join records describe it."""
        node = self.node
        return NodeInfo(
            node_id=node.node_id,
            host=node.host,
            addr=node.addr,
            nproc=node.settings.nproc,
            rank_hint=node.settings.node_rank_hint,
            pid=os.getpid(),
        )

    def presence(self) -> Put:
        """This node's presence key, on its lease."""
        record = PresenceRecord(self._me(), since=time.time())
        key = self.node.keys.node(self.node.node_id)
        return Put(key, record.encode(), self.keeper.lease)

    async def put_presence(self) -> None:
        put = self.presence()
        await self.node.store.put(put.key, put.value, put.lease)

    async def _join(self, a: Action) -> None:
        node, view, r = self.node, self.observer.view, a.round
        kv = view.round_kv
        if kv is None or view.round is None or view.round.round != r:
            return
        if not self.port:
            self.port = await asyncio.to_thread(rounds.pick_master_port, node.settings.addr)
        rec = JoinRecord(self._me(), port=self.port)
        res = await node.store.txn(
            [Compare.unchanged(node.keys.round, kv.mod_revision)],
            [
                Put(node.keys.join(r, node.node_id), rec.encode(), self.keeper.lease),
                Delete(self._waiting_key),
            ],
        )
        if res.succeeded:
            # round is unchanged at this revision (compared): the next phase
            # need not read it again.
            self.observer.round_seen = (kv, res.revision)
            self.observer.joined = (r, res.revision)
            node.events.emit("node_joined", round=r, node=node.node_id, host=node.host)

    async def _close_round(self, a: Action) -> None:
        node, view = self.node, self.observer.view
        kv, r = view.round_kv, a.round
        if kv is None or view.round is None or view.round.state is not RoundState.OPEN:
            return
        order = sorted(view.joiners.values(), key=lambda kv: kv.create_revision)
        joiners = [JoinRecord.decode(j.key, j.value) for j in order]
        settings = node.settings
        closed, result = rounds.close_records(
            view.round,
            joiners,
            settings.max_nodes,
            a.reason,
            time.time(),
            max_restarts=settings.max_restarts,
            unit=settings.node_unit,
        )
        members = result.members
        chosen = {m.node_id for m in members}
        shards = shard_count(settings.max_nodes)
        header, parts = stored_form(result, shards)
        res = await node.store.txn(
            [Compare.unchanged(node.keys.round, kv.mod_revision)],
            [
                Put(node.keys.round, closed.encode()),
                Put(node.keys.result(r), header.encode()),
                *(Put(node.keys.shard(r, p.shard), p.encode()) for p in parts),
            ],
        )
        if res.succeeded and closed.state is RoundState.FAILED:
            node.events.emit("job_failed", round=r, reason="restart budget exhausted")
        elif res.succeeded:
            view.results[r] = result
            view.heads[r] = Head.of(result, node.node_id, shards)
            node.events.emit(
                "round_closed",
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

    def _closed_round_kv(self, r: int) -> tuple[KeyValue, RoundRecord] | None:
        view = self.observer.view
        kv, rec = view.round_kv, view.round
        if kv is None or rec is None or rec.round != r or rec.state is not RoundState.CLOSED:
            return None
        return kv, rec

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

    async def _open_round(self, a: Action) -> None:
        found = self._closed_round_kv(a.round)
        if found is None:
            return
        kv, rec = found
        result = await self.observer.get_result(a.round)
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
        if await self._open(kv, new, hang=new.hang_round == a.round):
            events, me = self.node.events, self.node.node_id
            if a.reason == "member_lost":
                events.emit("node_lost", round=a.round, detail=a.detail, by=me)
            events.emit("round_opened", round=a.round + 1, reason=a.reason, detail=a.detail, by=me)

    async def _mark_finished(self, a: Action) -> None:
        r = a.round
        found = self._closed_round_kv(r)
        if found is None:
            return
        kv, rec = found
        if await self._cas_round(kv, dataclasses.replace(rec, state=RoundState.FINISHED)):
            self.node.events.emit("job_finished", round=r)

    def _spare(self, r: int) -> bool:
        return spare(self.node.settings, self.observer.view.size(r))

    async def _round_result(self, r: int) -> RoundResult:
        """Round ``r``'s result as this member sees it: every member where
        this node read them all (its members built once per process:
        :func:`.view.decode_whole`), else its own place in the round."""
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
            )
        head = await self.observer.get_head(r)
        return rounds.partial_result(s.run_id, head, s.max_restarts)


# What each action does (a unit test checks that every Act has one).
HANDLERS: dict[Act, Callable[[Executor, Action], Awaitable[Outcome | None]]] = {
    Act.ARM: Executor._arm,
    Act.CANCEL: Executor._cancel,
    Act.READ_ROUND: Executor._read_round,
    Act.JOIN: Executor._join,
    Act.LEAVE: Executor._leave,
    Act.WAIT: Executor._wait,
    Act.CLOSE_ROUND: Executor._close_round,
    Act.OPEN_ROUND: Executor._open_round,
    Act.PUT_DONE: Executor._put_done,
    Act.MARK_FINISHED: Executor._mark_finished,
    Act.RENEW_LEASE: Executor._renew_lease,
    Act.REVOKE: Executor._revoke,
    Act.RETURN_RESULT: Executor._return_result,
    Act.RETURN_CHANGE: Executor._return_change,
    Act.RETURN: Executor._return,
    Act.RAISE: Executor._raise,
}


def _promotions(
    rnd: RoundRecord | None, members: Sequence[MemberRecord]
) -> list[tuple[str, int, str | None]]:
    """The members of closed round ``rnd`` that were not members of the round
    before it: (node id, group rank, the lost member whose rank it took)."""
    if rnd is None:
        return []
    prev = {p.node_id: p.group_rank for p in rnd.prev}
    return promotions(prev, {m.node_id: m.group_rank for m in members})
