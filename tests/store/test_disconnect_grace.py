"""Lease grace on disconnect (embedded TCP store): a lease whose owner
connection ends expires within the grace, not its TTL; a live client that
loses its connection reconnects and renews its leases before the grace runs
out. The engine rules are checked on a fake clock; the rest with real
sockets, a real server and clients in real processes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from elastrun.clock import FakeClock
from elastrun.errors import LeaseNotFound
from elastrun.store.base import Store
from elastrun.store.client import TcpStore
from elastrun.store.client_leases import HeldLeases
from elastrun.store.engine import Engine
from elastrun.store.server import DISCONNECT_GRACE, StoreServer
from tests.conftest import PYTHON, REPO
from tests.store.conftest import ServerProcess, read_line, stop_process

# An hour (the longest TTL a lease may have): keys that vanish while a test
# runs vanished by the grace, never by their TTL, however slow the machine.
LONG_TTL = 3600.0
VANISH_BOUND = 45.0  # a bounded wait, far below LONG_TTL


def run(body: Callable[[], Awaitable[None]], timeout: float = 120.0) -> None:
    async def main() -> None:
        async with asyncio.timeout(timeout):
            await body()

    asyncio.run(main())


def hold_process(host: str, port: int, prefix: str, ttl: float) -> subprocess.Popen[str]:
    """A client in its own process: grants a lease of ``ttl``, puts
    ``prefix``a and ``prefix``b with it, prints ``ready``, keeps it alive."""
    return subprocess.Popen(
        [PYTHON, "-m", "tests.store.client_proc", "hold", host, str(port), prefix, str(ttl)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


async def vanished(store: Store, key: str, bound: float) -> float:
    """Seconds until ``key`` is deleted (watched), failing after ``bound``."""
    kv = await store.get(key)
    if kv is None:
        return 0.0
    t0 = time.monotonic()
    watch = await store.watch(key, start_revision=kv.mod_revision + 1)
    try:
        async with asyncio.timeout(bound):
            async for event in watch:
                if event.type == "delete":
                    return time.monotonic() - t0
    finally:
        await watch.close()
    raise AssertionError("the watch ended")


@contextlib.asynccontextmanager
async def server_and_client(
    disconnect_grace: float = DISCONNECT_GRACE,
) -> AsyncIterator[tuple[StoreServer, TcpStore]]:
    server = StoreServer("127.0.0.1", 0, disconnect_grace=disconnect_grace)
    host, port = await server.start()
    client = await TcpStore.connect(host, port, timeout=5.0)
    try:
        yield server, client
    finally:
        await client.close()
        await server.stop()


# -- the engine's rules (fake clock) --------------------------------------------
def test_owner_gone_cuts_deadlines_to_the_grace_never_later() -> None:
    clock = FakeClock()
    engine = Engine(clock)
    long = engine.lease_grant(60.0, owner="a")
    short = engine.lease_grant(1.0, owner="a")
    other = engine.lease_grant(60.0, owner="b")
    plain = engine.lease_grant(60.0)
    engine.put("/long", b"", long)
    assert engine.lease_owner_gone("a", 2.0) == sorted([long, short])
    # A lease shorter than twice the grace gets half its TTL instead.
    assert engine.next_deadline() == clock.monotonic() + 0.5
    clock.advance(0.6)
    assert engine.expire_leases() == [short]
    clock.advance(1.0)
    assert engine.expire_leases() == []  # the long one: the grace, 2 s
    clock.advance(0.5)
    assert engine.expire_leases() == [long]
    assert engine.get("/long") is None
    assert engine.lease_owner_gone("a", 2.0) == []  # forgotten
    clock.advance(50.0)
    assert engine.expire_leases() == []  # b's and the unowned lease keep their TTL
    clock.advance(10.0)
    assert sorted(engine.expire_leases()) == sorted([other, plain])


def test_keepalive_restores_the_ttl_and_moves_ownership() -> None:
    clock = FakeClock()
    engine = Engine(clock)
    lease = engine.lease_grant(60.0, owner="a")
    engine.lease_keepalive(lease, owner="b")
    assert engine.lease_owner_gone("a", 2.0) == []  # no longer a's
    assert engine.lease_owner_gone("b", 2.0) == [lease]
    engine.lease_keepalive(lease, owner="c")  # renewed within the grace: full TTL
    clock.advance(30.0)
    assert engine.expire_leases() == []
    engine.lease_disown("c")  # e.g. the server stopped: the TTL stands
    assert engine.lease_owner_gone("c", 2.0) == []
    clock.advance(31.0)
    assert engine.expire_leases() == [lease]


def test_revoked_and_expired_leases_are_forgotten_by_their_owner() -> None:
    clock = FakeClock()
    engine = Engine(clock)
    revoked = engine.lease_grant(5.0, owner="a")
    expired = engine.lease_grant(1.0, owner="a")
    engine.lease_revoke(revoked)
    clock.advance(1.0)
    assert engine.expire_leases() == [expired]
    assert engine.lease_owner_gone("a", 2.0) == []
    with pytest.raises(LeaseNotFound):
        engine.lease_keepalive(expired, owner="a")


def test_held_leases_drop_what_their_holder_stopped_renewing() -> None:
    clock = FakeClock()
    held = HeldLeases(clock)
    held.renewed(1, 10.0)
    held.renewed(2, 3.0)
    held.renewed(3, 10.0)
    held.forget(3)
    assert held.due() == [1, 2]
    clock.advance(3.0)
    assert held.due() == [1]  # 2 was not renewed within its TTL: not revived
    held.clear()
    assert held.due() == [] and not held


# -- real processes and sockets -------------------------------------------------
def test_sigkilled_client_keys_vanish_within_the_grace_not_the_ttl(
    store_server: ServerProcess,
) -> None:
    prefix = f"/grace/{os.getpid()}/kill/"
    proc = hold_process(store_server.host, store_server.port, prefix, LONG_TTL)
    try:
        assert read_line(proc, 30).strip() == "ready", proc.stderr

        async def body() -> None:
            store = await TcpStore.connect(store_server.host, store_server.port, timeout=10)
            try:
                assert len((await store.get_prefix(prefix))[0]) == 2
                os.killpg(proc.pid, signal.SIGKILL)  # no goodbye; the kernel closes its socket
                took = await vanished(store, prefix + "b", VANISH_BOUND)
                print(f"keys of a SIGKILLed client (lease TTL {LONG_TTL:g} s) gone in {took:.1f} s")
                assert (await store.get_prefix(prefix))[0] == []
            finally:
                await store.close()

        run(body)
    finally:
        stop_process(proc)


def test_closed_connection_without_reconnect_loses_its_keys_within_the_grace() -> None:
    """A client grants a long lease, puts a key and closes its connection
    without revoking: the server's reaper must wake at the cut deadline, not
    at the TTL."""

    async def body() -> None:
        async with server_and_client() as (server, watcher):
            assert server.address is not None
            raw = await TcpStore.connect(*server.address, timeout=5)
            lease = await raw.lease_grant(LONG_TTL)
            await raw.put("/grace/raw", b"", lease)
            await raw.close()  # closing does not revoke: the grace does it
            await vanished(watcher, "/grace/raw", VANISH_BOUND)

    run(body)


def test_dropped_connection_reconnects_and_keeps_its_lease() -> None:
    """The server drops the connection of a live client in another process (it
    renews only every TTL/4 = 15 minutes): the client reconnects and renews at once,
    so its keys outlive the grace."""

    async def body() -> None:
        async with server_and_client() as (server, observer):
            assert server.address is not None
            host, port = server.address
            prefix = f"/grace/{os.getpid()}/drop/"
            proc = await asyncio.create_subprocess_exec(
                PYTHON,
                "-m",
                "tests.store.client_proc",
                "hold",
                host,
                str(port),
                prefix,
                str(LONG_TTL),
                cwd=REPO,
                stdout=asyncio.subprocess.PIPE,
                start_new_session=True,
            )
            try:
                assert proc.stdout is not None
                line = await asyncio.wait_for(proc.stdout.readline(), 30)
                assert line.strip() == b"ready"
                for _ in range(2):  # twice: the new connection owns the lease
                    before = server.connection_count
                    server.disconnect_all()
                    await asyncio.sleep(DISCONNECT_GRACE + 1.0)
                    kvs, _ = await observer.get_prefix(prefix)
                    assert len(kvs) == 2, "the lease did not survive the reconnect"
                    assert server.connection_count == before  # both reconnected
                assert proc.returncode is None
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
            # and once it is gone for good, its keys follow within the grace
            await vanished(observer, prefix + "a", VANISH_BOUND)

    run(body)


def test_socket_shut_down_under_the_client_keeps_its_lease() -> None:
    async def body() -> None:
        async with server_and_client() as (_server, client):
            lease = await client.lease_grant(LONG_TTL)
            await client.put("/grace/shut", b"", lease)
            conn = client._conn
            assert conn is not None
            sock = conn.writer.get_extra_info("socket")
            sock.shutdown(socket.SHUT_RDWR)  # the server sees end of file
            await asyncio.sleep(DISCONNECT_GRACE + 1.0)
            assert client._conn is not None and client._conn is not conn  # reconnected
            assert await client.get("/grace/shut") is not None
            # revoked leases are not renewed on the next reconnect
            await client.lease_revoke(lease)
            assert await client.get("/grace/shut") is None
            assert len(client._leases) == 0

    run(body)


def test_handed_over_engine_keeps_plain_ttl() -> None:
    """A server stops (its engine handed to the next one): the leases keep their
    TTL even though their client does not come back."""

    async def body() -> None:
        server = StoreServer("127.0.0.1", 0)
        host, port = await server.start()
        client = await TcpStore.connect(host, port, timeout=5)
        lease = await client.lease_grant(LONG_TTL)
        await client.put("/grace/handover", b"", lease)
        client._leases.clear()  # so that it does not renew when it reconnects
        engine = server.engine
        await server.stop()
        await client.close()
        server = StoreServer("127.0.0.1", port, engine=engine)
        await server.start()
        try:
            await asyncio.sleep(DISCONNECT_GRACE + 1.0)
            assert engine.get("/grace/handover") is not None
        finally:
            await server.stop()

    run(body)


def test_grace_is_configurable_and_never_beyond_the_ttl() -> None:
    async def body() -> None:
        async with server_and_client(disconnect_grace=30.0) as (server, watcher):
            assert server.address is not None
            raw = await TcpStore.connect(*server.address, timeout=5)
            lease = await raw.lease_grant(1.0)  # shorter than the grace
            await raw.put("/grace/short", b"", lease)
            await raw.close()
            assert await vanished(watcher, "/grace/short", 5.0) < 5.0

    run(body)
