"""The store's lease timers in virtual time: the reaper that deletes a lease's
keys wakes exactly when the earliest lease is due, including a deadline moved
earlier (a keepalive, a shorter lease, an owner gone: the server's disconnect
grace). The integration tests of the real server and etcd only wait, bounded,
for the deletes; when they happen is checked here, to the millisecond."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest

from elastrun.clock import Clock, VirtualTimeLoop, run_virtual
from elastrun.store.base import Watch
from elastrun.store.memory import LeaseReaper, MemoryStore

T = TypeVar("T")


def clock() -> Clock:
    loop = asyncio.get_running_loop()
    assert isinstance(loop, VirtualTimeLoop)
    return loop.clock


def run(scenario: Callable[[], Awaitable[T]]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(scenario(), 7200.0)  # virtual seconds

    return run_virtual(bounded())


async def deleted_at(watch: Watch, t0: float) -> list[tuple[str, float]]:
    """(key, virtual seconds since ``t0``) of each delete, until the watch has
    been quiet for an hour of virtual time."""
    out: list[tuple[str, float]] = []
    while True:
        try:
            event = await asyncio.wait_for(anext(watch), 3600.0)
        except TimeoutError:
            return out
        if event.type == "delete":
            out.append((event.kv.key, round(clock().monotonic() - t0, 3)))


def test_keys_of_an_expired_lease_are_deleted_when_it_is_due_and_not_before() -> None:
    async def scenario() -> list[tuple[str, float]]:
        store = MemoryStore(clock=clock())
        t0 = clock().monotonic()
        watch = await store.watch("k/", prefix=True)
        seen = asyncio.create_task(deleted_at(watch, t0))
        lease = await store.lease_grant(2.0)
        await store.put("k/renewed", b"", lease)
        await clock().sleep_until(t0 + 1.5)
        assert await store.lease_keepalive(lease) == 2.0  # now due at 3.5
        # A shorter lease granted later is due first: the reaper wakes for it.
        short = await store.lease_grant(0.5)
        await store.put("k/short", b"", short)
        got = await seen
        await watch.close()
        await store.close()
        return got

    assert run(scenario) == [("k/short", 2.0), ("k/renewed", 3.5)]


def test_an_owner_gone_moves_its_leases_to_the_grace() -> None:
    """What the TCP server does when a client's connection ends: the owner's
    leases are cut to the grace (or half their TTL), and the sleeping reaper,
    poked, deletes their keys then, not at the TTL."""

    async def scenario() -> list[tuple[str, float]]:
        store = MemoryStore(clock=clock())
        engine = store.engine
        reaper = LeaseReaper(engine)
        t0 = clock().monotonic()
        watch = await store.watch("g/", prefix=True)
        seen = asyncio.create_task(deleted_at(watch, t0))
        long = engine.lease_grant(3600.0, owner="client")
        engine.put("g/long", b"", long)
        other = engine.lease_grant(60.0, owner="other")
        engine.put("g/other", b"", other)
        reaper.poke()
        await clock().sleep_until(t0 + 10.0)
        assert engine.lease_owner_gone("client", 2.0) == [long]
        reaper.poke()
        got = await seen
        await reaper.stop()
        await watch.close()
        await store.close()
        return got

    assert run(scenario) == [("g/long", 12.0), ("g/other", 60.0)]


@pytest.mark.parametrize("revoked", [True, False])
def test_nothing_is_deleted_while_a_lease_is_kept_alive(revoked: bool) -> None:
    async def scenario() -> list[tuple[str, float]]:
        store = MemoryStore(clock=clock())
        t0 = clock().monotonic()
        watch = await store.watch("a/", prefix=True)
        seen = asyncio.create_task(deleted_at(watch, t0))
        lease = await store.lease_grant(10.0)
        await store.put("a/k", b"", lease)
        for i in range(1, 31):  # five virtual minutes of keepalives, every 9 s
            await clock().sleep_until(t0 + 9.0 * i)
            await store.lease_keepalive(lease)
        if revoked:
            await store.lease_revoke(lease)
        got = await seen
        await watch.close()
        await store.close()
        return got

    # kept alive until 270 s; then revoked at once, or expired 10 s later
    assert run(scenario) == [("a/k", 270.0 if revoked else 280.0)]
