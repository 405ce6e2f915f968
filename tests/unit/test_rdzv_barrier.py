"""The exit barrier driven end to end: in-process rendezvous handlers on one
in-memory store (fast; no processes). Several members complete; the barrier's
watcher dies mid-barrier; a member is lost during it; and the store traffic of
the barrier stays O(n): only one member reads or watches the ``nodes/`` and
done prefixes. Everything runs in virtual time (the store's leases, the
handlers' timers and the test's waits on the loop's clock): deterministic,
and as fast as the code."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from elastrun.clock import VirtualTimeLoop, run_virtual
from elastrun.names import RunId
from elastrun.rendezvous import keys as K
from elastrun.rendezvous.api import RendezvousSettings
from elastrun.rendezvous.dynamic import DynamicRendezvous
from elastrun.rendezvous.records import DONE, RoundRecord, RoundState
from elastrun.store.base import Compare, Get, Op, TxnResult, Watch
from elastrun.store.memory import MemoryStore

T = TypeVar("T")
BARRIER = 30.0  # far longer than any test: returning before it is the point


class CountingStore(MemoryStore):
    """A memory store that counts prefix reads and watches by key."""

    def __init__(self) -> None:
        super().__init__(clock=vloop().clock)
        self.prefix_reads: Counter[str] = Counter()
        self.watches: Counter[str] = Counter()

    async def txn(
        self, compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> TxnResult:
        for op in success:
            if isinstance(op, Get) and op.prefix:
                self.prefix_reads[op.key] += 1
        return await super().txn(compares, success, failure)

    async def watch(
        self, key: str, *, prefix: bool = False, start_revision: int | None = None
    ) -> Watch:
        self.watches[key] += 1
        return await super().watch(key, prefix=prefix, start_revision=start_revision)


def vloop() -> VirtualTimeLoop:
    loop = asyncio.get_running_loop()
    assert isinstance(loop, VirtualTimeLoop)
    return loop


def memory_store() -> MemoryStore:
    return MemoryStore(clock=vloop().clock)


def run(scenario: Callable[[], Awaitable[T]]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(scenario(), 20.0)

    return run_virtual(bounded())


async def form(store: MemoryStore, n: int) -> list[DynamicRendezvous]:
    """``n`` handlers in one closed round; returned in group-rank order."""
    run_id = f"job-{uuid.uuid4().hex[:6]}"
    handlers = [
        DynamicRendezvous(
            store,
            RendezvousSettings(
                run_id=RunId(run_id),
                min_nodes=n,
                max_nodes=n,
                lease_ttl=5.0,
                join_timeout=15.0,
                exit_barrier_timeout=BARRIER,
                host=f"h{i}",
                addr="127.0.0.1",
            ),
            node_id=f"n{i}",
            clock=vloop().clock,
        )
        for i in range(n)
    ]
    results = await asyncio.gather(*(h.next_round() for h in handlers))
    ranked = sorted(zip(results, handlers, strict=True), key=lambda rh: rh[0].group_rank)
    return [h for _, h in ranked]


async def round_record(h: DynamicRendezvous) -> RoundRecord:
    kv = await h.store.get(h.keys.round)
    assert kv is not None
    return RoundRecord.decode(kv.key, kv.value)


async def until(cond: Callable[[], Awaitable[bool]]) -> None:
    while not await cond():
        await asyncio.sleep(0.01)


async def at_barrier(h: DynamicRendezvous) -> None:
    """Wait until ``h`` put its done key and is waiting at the barrier."""

    async def ready() -> bool:
        done = await h.store.get(h.keys.done(h.rules.ctx.round, h.node_id))
        return done is not None and h.rules.state.name == "COMPLETING"

    await until(ready)
    await vloop().all_tasks_blocked()  # its phase is set up (reads and watches)


async def die(h: DynamicRendezvous) -> None:
    """As a killed agent: its lease (presence) goes; its done key, if any, stays."""
    await h.keeper.stop(revoke=True)


async def close_all(handlers: list[DynamicRendezvous]) -> None:
    for h in handlers:
        await h.shutdown()


def test_several_members_complete_and_the_job_finishes() -> None:
    async def scenario() -> RoundRecord:
        store = CountingStore()
        hs = await form(store, 8)
        # One at a time: each waits at the barrier until the last one.
        tasks = []
        for h in hs[:-1]:
            tasks.append(asyncio.create_task(h.complete()))
            await at_barrier(h)
        assert not any(t.done() for t in tasks)
        await asyncio.wait_for(hs[-1].complete(), 5.0)
        await asyncio.wait_for(asyncio.gather(*tasks), 5.0)
        rec = await round_record(hs[0])
        assert all(h.rules.state.name == "FINISHED" for h in hs)
        await close_all(hs)
        return rec

    rec = run(scenario)
    assert rec.state is RoundState.FINISHED and rec.round == 0


def test_the_barrier_reads_and_watches_the_prefixes_once_in_all() -> None:
    async def scenario() -> tuple[CountingStore, K.Keys]:
        store = CountingStore()
        hs = await form(store, 24)
        store.prefix_reads.clear()
        store.watches.clear()
        await asyncio.wait_for(asyncio.gather(*(h.complete() for h in hs)), 10.0)
        assert (await round_record(hs[0])).state is RoundState.FINISHED
        await close_all(hs)
        return store, hs[0].keys

    store, keys = run(scenario)
    # At most the watcher reads / watches nodes/ and the done keys, and the
    # last member through reads the done keys (are they the members'?): O(n)
    # in all; every member watches round (and at most one presence key).
    assert store.prefix_reads[keys.nodes] <= 1 and store.prefix_reads[keys.dones(0)] <= 2
    assert store.watches[keys.nodes] <= 1 and store.watches[keys.dones(0)] <= 1
    assert store.prefix_reads[keys.waiting_prefix] == 0
    assert store.watches[keys.round] <= 24


def test_the_watcher_dies_mid_barrier_and_the_next_member_takes_over() -> None:
    async def scenario() -> RoundRecord:
        store = memory_store()
        hs = await form(store, 4)
        w, nxt, a, b = hs
        tw = asyncio.create_task(w.complete())
        await at_barrier(w)
        tn = asyncio.create_task(nxt.complete())
        await at_barrier(nxt)
        assert nxt._observer.view.watcher == w.node_id  # it watches rank 0
        # The watcher dies with its done key in the store: not a loss.
        tw.cancel()
        await asyncio.gather(tw, return_exceptions=True)
        await die(w)
        await until(lambda: _is(nxt._observer.view.watcher, None))
        # The last two die after their done keys, before they count them:
        # only the new watcher can finish the barrier now.
        for h in (a, b):
            await store.put(h.keys.done(0, h.node_id), DONE)
            await die(h)
        await asyncio.wait_for(tn, 5.0)
        assert nxt.rules.state.name == "FINISHED"
        rec = await round_record(nxt)
        await close_all(hs)
        return rec

    assert run(scenario).state is RoundState.FINISHED


def test_a_member_lost_during_the_barrier_ends_it_for_everyone() -> None:
    async def scenario() -> tuple[RoundRecord, float]:
        store = memory_store()
        hs = await form(store, 4)
        tasks = []
        for h in hs[:3]:  # rank 0 (the watcher) and two more wait at the barrier
            tasks.append(asyncio.create_task(h.complete()))
            await at_barrier(h)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await die(hs[3])  # its workers were still running: no done key
        await asyncio.wait_for(asyncio.gather(*tasks), 5.0)
        took = loop.time() - t0
        rec = await round_record(hs[0])
        await close_all(hs)
        return rec, took

    rec, took = run(scenario)
    assert took < BARRIER / 10
    assert rec.state is RoundState.OPEN and rec.round == 1
    assert rec.reason == "member_lost" and "n" in rec.detail


def test_the_watcher_lost_while_running_ends_the_barrier() -> None:
    async def scenario() -> RoundRecord:
        store = memory_store()
        hs = await form(store, 3)
        tasks = []
        for h in hs[1:]:  # rank 0 is still running its workers
            tasks.append(asyncio.create_task(h.complete()))
            await at_barrier(h)
            assert h._observer.view.watcher == hs[0].node_id
        await die(hs[0])
        await asyncio.wait_for(asyncio.gather(*tasks), 5.0)
        rec = await round_record(hs[1])
        await close_all(hs)
        return rec

    rec = run(scenario)
    assert rec.state is RoundState.OPEN and rec.reason == "member_lost"
    assert "n" in rec.detail and "lost" in rec.detail


async def _is(value: object, expected: object) -> bool:
    return value is expected


def test_a_member_that_leaves_on_purpose_is_said_to_have_left_not_lost() -> None:
    async def scenario(graceful: bool) -> tuple[str, str]:
        store = memory_store()
        hs = await form(store, 2)
        change = asyncio.create_task(hs[0].wait_for_change())
        await vloop().all_tasks_blocked()
        gone = f"node {hs[1].settings.host} ({hs[1].node_id})"
        if graceful:
            await hs[1].shutdown()  # its agent stops: it says so, then revokes
        else:
            await die(hs[1])
        detail = (await asyncio.wait_for(change, 10.0)).detail
        await close_all(hs)
        return gone, detail

    gone, detail = run(lambda: scenario(True))
    assert detail == f"{gone} left the job (its agent stopped)"
    gone, detail = run(lambda: scenario(False))
    assert detail == f"{gone} lost: lease expired or revoked"
