"""LeaseKeeper against the in-memory store and the embedded TCP store (in process).

The in-memory store runs in virtual time (:class:`~elastrun.clock.VirtualTimeLoop`:
the store's leases, the keeper's renewals and the test's waits on one clock,
deterministic and instant); the TCP store, whose replies travel over real
sockets, in real time."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from elastrun.clock import SYSTEM_CLOCK, Clock, VirtualTimeLoop, run_virtual
from elastrun.store.base import Store
from elastrun.store.client import TcpStore
from elastrun.store.keepalive import LeaseKeeper
from elastrun.store.memory import MemoryStore
from elastrun.store.server import StoreServer

TTL = 0.6


@dataclass
class Harness:
    """One store; ``client()`` opens another handle on it; ``kill()`` makes it go away."""

    store: Store
    client: Callable[[], Awaitable[Store]]
    kill: Callable[[], Awaitable[None]]
    clock: Clock = SYSTEM_CLOCK  # the store's (and so the keeper's)
    opened: list[Store] = field(default_factory=list)


@contextlib.asynccontextmanager
async def memory() -> AsyncIterator[Harness]:
    loop = asyncio.get_running_loop()
    assert isinstance(loop, VirtualTimeLoop)
    store = MemoryStore(clock=loop.clock)

    async def client() -> Store:
        return store

    try:
        yield Harness(store, client, store.close, loop.clock)
    finally:
        await store.close()


@contextlib.asynccontextmanager
async def tcp() -> AsyncIterator[Harness]:
    server = StoreServer("127.0.0.1", 0)
    host, port = await server.start()
    opened: list[Store] = []

    async def client() -> Store:
        s = await TcpStore.connect(host, port, timeout=5.0, request_timeout=2.0)
        opened.append(s)
        return s

    try:
        yield Harness(await client(), client, server.stop)
    finally:
        for s in opened:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(s.close(), 2.0)
        await server.stop()


STORES = {"memory": memory, "tcp": tcp}


def run(kind: str, body: Callable[[Harness], Awaitable[None]]) -> None:
    async def main() -> None:
        async with STORES[kind]() as h:
            await asyncio.wait_for(body(h), 30.0)

    if kind == "memory":
        run_virtual(main())
    else:
        asyncio.run(main())


async def lost_within(lost: asyncio.Future[str], seconds: float) -> str:
    return await asyncio.wait_for(asyncio.shield(lost), seconds)


def keeper_with_future(h: Harness) -> tuple[LeaseKeeper, asyncio.Future[str]]:
    fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    def on_lost(reason: str) -> None:
        if not fut.done():
            fut.set_result(reason)

    return LeaseKeeper(h.store, TTL, clock=h.clock, on_lost=on_lost), fut


@pytest.mark.parametrize("kind", list(STORES))
def test_keeps_the_lease_alive_past_several_ttls(kind: str) -> None:
    async def body(h: Harness) -> None:
        keeper, lost = keeper_with_future(h)
        lease = await keeper.start()
        await h.store.put("/ka/k", b"v", lease)
        await h.clock.sleep_until(h.clock.monotonic() + 5 * TTL)
        assert not lost.done() and keeper.alive
        assert await h.store.get("/ka/k") is not None
        await keeper.stop()

    run(kind, body)


@pytest.mark.parametrize("kind", list(STORES))
def test_on_lost_when_revoked_from_outside(kind: str) -> None:
    async def body(h: Harness) -> None:
        keeper, lost = keeper_with_future(h)
        lease = await keeper.start()
        other = await h.client()
        await other.lease_revoke(lease)
        reason = await lost_within(lost, TTL + 1.0)
        assert "expired or was revoked" in reason
        assert not keeper.alive and keeper.lost.is_set()
        await keeper.stop()

    run(kind, body)


@pytest.mark.parametrize("kind", list(STORES))
def test_on_lost_when_the_store_goes_away(kind: str) -> None:
    async def body(h: Harness) -> None:
        keeper, lost = keeper_with_future(h)
        await keeper.start()
        t0 = h.clock.monotonic()
        await h.kill()
        reason = await lost_within(lost, 2 * TTL + 2.0)
        assert "store unreachable" in reason
        # Declared lost once the lease must have expired there, not before.
        assert h.clock.monotonic() - t0 >= TTL * 0.5
        await keeper.stop()

    run(kind, body)


@pytest.mark.parametrize("kind", list(STORES))
def test_stop_revokes_the_lease(kind: str) -> None:
    async def body(h: Harness) -> None:
        keeper, lost = keeper_with_future(h)
        lease = await keeper.start()
        await h.store.put("/ka/gone", b"v", lease)
        await keeper.stop(revoke=True)
        assert await h.store.get("/ka/gone") is None
        assert not lost.done() and not keeper.alive

    run(kind, body)


def test_stop_is_bounded_when_the_store_is_gone() -> None:
    async def body(h: Harness) -> None:
        keeper, _ = keeper_with_future(h)
        await keeper.start()
        await h.kill()
        # It returns although nothing answers (a bounded wait: a stop that
        # hung on the dead connection would end it with TimeoutError).
        await asyncio.wait_for(keeper.stop(revoke=True, timeout=0.2), 20.0)
        assert not keeper.alive

    run("tcp", body)
