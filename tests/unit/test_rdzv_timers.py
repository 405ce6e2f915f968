"""The rendezvous' timers, driven end to end in virtual time: in-process
handlers on one in-memory store, on an event loop whose time jumps to the next
deadline once every task waits. Leases are renewed, expire and are noticed on
the same clock as the last call and the join timeout, so each test says
exactly when something happens (or that nothing does for a given time), with
no real sleep."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest

from elastrun.clock import Clock, VirtualTimeLoop, run_virtual
from elastrun.errors import RendezvousTimeout
from elastrun.names import RunId
from elastrun.rendezvous.api import Change, RendezvousSettings, RoundResult
from elastrun.rendezvous.dynamic import DynamicRendezvous
from elastrun.store.memory import MemoryStore

T = TypeVar("T")


def clock() -> Clock:
    loop = asyncio.get_running_loop()
    assert isinstance(loop, VirtualTimeLoop)
    return loop.clock


def run(scenario: Callable[[], Awaitable[T]]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(scenario(), 3600.0)  # virtual seconds

    return run_virtual(bounded())


def handler(store: MemoryStore, run_id: str, name: str, **kw: Any) -> DynamicRendezvous:
    settings = RendezvousSettings(run_id=RunId(run_id), host=f"h-{name}", addr="127.0.0.1", **kw)
    return DynamicRendezvous(store, settings, node_id=name, clock=clock())


def test_the_last_call_closes_the_round_exactly_when_it_is_due() -> None:
    async def scenario() -> tuple[float, list[RoundResult]]:
        store, run_id = MemoryStore(clock=clock()), f"j-{uuid.uuid4().hex[:6]}"
        common = {"min_nodes": 2, "max_nodes": 3, "last_call_timeout": 30.0}
        a, b = (handler(store, run_id, n, **common) for n in ("a", "b"))
        t0 = clock().monotonic()
        results = await asyncio.gather(a.next_round(), b.next_round())
        took = clock().monotonic() - t0
        for h in (a, b):
            await h.shutdown()
        return took, list(results)

    took, results = run(scenario)
    assert took == pytest.approx(30.0, abs=0.01)  # min joined at once; then the last call
    assert sorted(r.group_rank for r in results) == [0, 1]


def test_the_join_timeout_fires_at_its_deadline_and_names_who_joined() -> None:
    async def scenario() -> tuple[float, list[BaseException]]:
        store, run_id = MemoryStore(clock=clock()), f"j-{uuid.uuid4().hex[:6]}"
        common = {"min_nodes": 3, "max_nodes": 3, "join_timeout": 600.0}
        hs = [handler(store, run_id, n, **common) for n in ("a", "b")]
        t0 = clock().monotonic()
        errors = await asyncio.gather(*(h.next_round() for h in hs), return_exceptions=True)
        took = clock().monotonic() - t0
        for h in hs:
            await h.shutdown()
        return took, [e for e in errors if isinstance(e, BaseException)]

    took, errors = run(scenario)
    assert took == pytest.approx(600.0, abs=0.01)
    assert len(errors) == 2 and all(isinstance(e, RendezvousTimeout) for e in errors)
    assert "2 of min 3 nodes joined before join_timeout=600s: h-a, h-b" in str(errors[0])


def test_a_full_round_is_not_re_formed_for_a_waiting_node_until_a_member_is_lost() -> None:
    ttl = 1.0

    async def scenario() -> tuple[bool, Change, RoundResult, float]:
        store, run_id = MemoryStore(clock=clock()), f"j-{uuid.uuid4().hex[:6]}"
        common = {"min_nodes": 2, "max_nodes": 2, "lease_ttl": ttl, "last_call_timeout": 0.5}
        n0, victim, late = (handler(store, run_id, n, **common) for n in ("n0", "n9", "n7"))
        await asyncio.gather(n0.next_round(), victim.next_round())
        change = asyncio.create_task(n0.wait_for_change())
        joining = asyncio.create_task(late.next_round())
        # Three lease TTLs: the members' leases are renewed, the late node
        # waits, and nobody re-forms the full round.
        await clock().sleep_until(clock().monotonic() + 3 * ttl)
        quiet = not change.done() and not joining.done()
        await victim.keeper.stop(revoke=False)  # killed: its lease expires
        killed_at = clock().monotonic()
        got = await change
        second = await asyncio.gather(n0.next_round(), joining)
        whole = await late.full_result(second[1])  # every member, not only its own place
        took = clock().monotonic() - killed_at
        for h in (n0, late):
            await h.shutdown()
        return quiet, got, whole, took

    quiet, change, second, took = run(scenario)
    assert quiet, "a full round was re-formed for a waiting node"
    assert change.reason == "member_lost" and "n9" in change.detail
    assert sorted(m.node_id for m in second.members) == ["n0", "n7"]
    assert took <= ttl + 1.0  # noticed when the lease expired, re-formed at once


def test_each_member_reads_its_own_place_and_a_late_node_sees_a_running_job() -> None:
    """Members get their own place in a sharded result (heterogeneous nproc:
    contiguous global ranks), the whole membership on request, and a node
    outside the closed round is told it joins a running job."""

    async def scenario() -> tuple[list[RoundResult], list[RoundResult], list[bool]]:
        store, run_id = MemoryStore(clock=clock()), f"j-{uuid.uuid4().hex[:6]}"
        common = {"min_nodes": 3, "max_nodes": 3, "last_call_timeout": 0.5}
        nproc = {"n0": 2, "n1": 3, "n2": 1}
        hs = [handler(store, run_id, n, nproc=p, **common) for n, p in nproc.items()]
        late = handler(store, run_id, "n9", **common)
        got = list(await asyncio.gather(*(h.next_round() for h in hs)))
        whole = [await h.full_result(r) for h, r in zip(hs, got, strict=True)]
        running = [await h.joining_running_job() for h in (*hs, late)]
        for h in (*hs, late):
            await h.shutdown()
        return got, whole, running

    got, whole, running = run(scenario)
    assert running == [False, False, False, True]
    # The decider has every member; the others read only their own place.
    assert sorted(r.complete for r in got) == [False, False, True]
    assert all(len(r.members) == 1 for r in got if not r.complete)
    members = whole[0].members
    assert [w.members for w in whole] == [members] * 3 and len(members) == 3
    spans = sorted((r.rank_offset, r.rank_offset + r.me.nproc) for r in got)
    assert spans == [(0, spans[1][0]), (spans[1][0], spans[2][0]), (spans[2][0], 6)]
    for r, w in zip(got, whole, strict=True):
        assert w.complete
        assert (r.group_rank, r.group_world_size, r.world_size, r.rank_offset, r.me) == (
            w.group_rank,
            w.group_world_size,
            w.world_size,
            w.rank_offset,
            w.me,
        )
