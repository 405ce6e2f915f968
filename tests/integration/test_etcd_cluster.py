"""The etcd store on a real 3-member cluster: losing the member it talks to is
invisible (operations go on, an open watch keeps delivering, in order, nothing
lost); losing the quorum fails within the timeout instead of hanging."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator

import pytest

from elastrun.errors import StoreUnavailable
from elastrun.store.base import WatchEvent
from elastrun.store.etcd_options import EtcdOptions
from tests.store.etcd_fixture import EtcdCluster, requires_etcd, start_cluster

pytestmark = [pytest.mark.etcd, requires_etcd]


@pytest.fixture
def cluster() -> Iterator[EtcdCluster]:
    c = start_cluster(3)
    try:
        yield c
    finally:
        c.stop()


OP_BOUND = 20.0  # each operation's bounded wait: 5 x the store's timeout (4 s)


def run(body: object, timeout: float = 90.0) -> None:
    async def main() -> None:
        async with asyncio.timeout(timeout):
            await body()  # type: ignore[operator]

    asyncio.run(main())


async def drain(watch: object, count: int, timeout: float = 20.0) -> list[WatchEvent]:
    async with asyncio.timeout(timeout):
        return [await anext(watch) for _ in range(count)]  # type: ignore[call-overload]


def test_member_loss_is_invisible(cluster: EtcdCluster) -> None:
    async def body() -> None:
        from elastrun.store.etcd import EtcdStore, open_etcd_store

        store = await open_etcd_store(
            cluster.endpoints, options=EtcdOptions(key_prefix="job/"), timeout=20
        )
        assert isinstance(store, EtcdStore)
        try:
            watch = await store.watch("n/", prefix=True)
            lease = await store.lease_grant(10)
            for i in range(5):
                await store.put(f"n/{i}", str(i).encode(), lease=lease)
            victim = cluster.member_at(str(store.endpoint))
            victim.kill(signal.SIGKILL)
            # The next operations fail over to the survivors.
            for i in range(5, 10):
                await store.put(f"n/{i}", str(i).encode())
            assert await store.lease_keepalive(lease) == 10.0
            assert str(store.endpoint) != victim.endpoint
            kvs, _ = await store.get_prefix("n/")
            assert len(kvs) == 10
            # The watch resumed elsewhere: every event exactly once, in order.
            events = await drain(watch, 10)
            assert [e.kv.key for e in events] == [f"n/{i}" for i in range(10)]
            revisions = [e.kv.mod_revision for e in events]
            assert revisions == sorted(set(revisions))
            await store.put("n/after", b"x")
            assert (await drain(watch, 1))[0].kv.key == "n/after"
            await watch.close()
        finally:
            await store.close()

    run(body)


def test_quorum_loss_fails_instead_of_hanging(cluster: EtcdCluster) -> None:
    async def body() -> None:
        from elastrun.store.etcd import open_etcd_store

        timeout = 4.0
        store = await open_etcd_store(cluster.endpoints, timeout=timeout)
        try:
            watch = await store.watch("q", prefix=True)
            await store.put("q", b"1")
            assert (await drain(watch, 1))[0].kv.value == b"1"
            for member in cluster.members[:2]:
                member.kill(signal.SIGKILL)
            for op in (store.put("q", b"2"), store.get("q"), store.lease_grant(5)):
                # Each fails on its own with an error naming the member (a
                # bounded wait: asyncio's TimeoutError is no StoreUnavailable).
                with pytest.raises(StoreUnavailable) as info:  # StoreTimeout is one
                    await asyncio.wait_for(op, OP_BOUND)
                assert cluster.members[0].endpoint in str(info.value)
            # The open watch ends with an error too (its member lost the leader).
            with pytest.raises(StoreUnavailable):
                await drain(watch, 1, timeout=OP_BOUND)
        finally:
            await store.close()

    run(body)


def test_frozen_member_is_failed_over(cluster: EtcdCluster) -> None:
    """A member that accepts connections but never answers (SIGSTOP) costs one
    attempt (timeout/3), not the whole operation: the write succeeds, on
    another member."""

    async def body() -> None:
        from elastrun.store.etcd import EtcdStore, open_etcd_store

        store = await open_etcd_store(cluster.endpoints, timeout=9.0)
        assert isinstance(store, EtcdStore)
        frozen = cluster.member_at(str(store.endpoint))
        assert frozen.proc is not None
        await store.put("warm", b"connection pooled")
        os.kill(frozen.proc.pid, signal.SIGSTOP)
        try:
            await store.put("k", b"v")
            assert str(store.endpoint) != frozen.endpoint
            assert (await store.get("k")).value == b"v"  # type: ignore[union-attr]
        finally:
            os.kill(frozen.proc.pid, signal.SIGCONT)
            await store.close()

    run(body)
