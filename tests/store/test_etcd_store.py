"""The etcd store against a real single-member etcd: what the conformance
suite does not cover (key prefixes, etcd leases, compaction, auth, TLS files,
bad endpoints). Failover is in tests/integration/test_etcd_cluster.py."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from elastrun.errors import (
    AuthenticationError,
    ConfigError,
    LeaseNotFound,
    RevisionCompacted,
    StoreError,
    StoreUnavailable,
)
from elastrun.store.base import Compare, Delete, Get, Put, Store, WatchEvent
from elastrun.store.etcd_options import EtcdOptions
from tests.helpers import free_ports
from tests.store.etcd_fixture import (
    EtcdCluster,
    gateway,
    requires_etcd,
    start_cluster,
    unique_prefix,
)

pytestmark = [pytest.mark.etcd, requires_etcd]


def run(body: Callable[[], Awaitable[None]], timeout: float = 60.0) -> None:
    async def main() -> None:
        async with asyncio.timeout(timeout):
            await body()

    asyncio.run(main())


async def open_store(cluster: EtcdCluster, timeout: float = 10.0, **conf: str) -> Store:
    from elastrun.store.etcd import open_etcd_store

    return await open_etcd_store(cluster.endpoints, options=EtcdOptions(**conf), timeout=timeout)


async def next_event(watch: object, timeout: float = 10.0) -> WatchEvent:
    return await asyncio.wait_for(anext(watch), timeout)  # type: ignore[call-overload]


def test_key_prefix_isolates_stores(etcd_session: EtcdCluster) -> None:
    async def body() -> None:
        job = unique_prefix()
        a = await open_store(etcd_session, key_prefix=job + "a/")
        b = await open_store(etcd_session, key_prefix=job + "b/")
        root = await open_store(etcd_session)
        try:
            await a.put("k", b"from-a")
            await b.put("k", b"from-b")
            assert (await a.get("k")).value == b"from-a"  # type: ignore[union-attr]
            assert (await b.get("k")).value == b"from-b"  # type: ignore[union-attr]
            kvs, _ = await a.get_prefix("")
            assert [(kv.key, kv.value) for kv in kvs] == [("k", b"from-a")]
            watch = await b.watch("", prefix=True)
            assert await a.delete("", prefix=True) == 1
            assert await b.get("k") is not None
            await b.put("k2", b"x")
            event = await next_event(watch)
            assert (event.type, event.kv.key) == ("put", "k2")  # a's delete not seen
            # Without a prefix the full keys are visible.
            kvs, _ = await root.get_prefix(job)
            assert [kv.key for kv in kvs] == [job + "b/k", job + "b/k2"]
            # A txn's compares and ops are prefixed too.
            res = await a.txn([Compare.absent("k2")], [Put("k2", b"a2"), Get("", prefix=True)])
            assert res.succeeded
            assert [kv.key for kv in res.gets[0]] == ["k2"]
            await watch.close()
        finally:
            for s in (a, b, root):
                await s.close()

    run(body)


def test_txn_compare_targets(etcd_session: EtcdCluster) -> None:
    async def body() -> None:
        s = await open_store(etcd_session, key_prefix=unique_prefix())
        try:
            rev = await s.put("k", b"v1")
            kv = await s.get("k")
            assert kv is not None and kv.mod_revision == rev and kv.version == 1
            ok = [
                Compare("k", "mod", "==", rev),
                Compare("k", "create", "==", rev),
                Compare("k", "version", ">", 0),
                Compare("k", "value", "==", b"v1"),
                Compare("k", "lease", "==", 0),
                Compare("k", "mod", "<", rev + 1),
                Compare("k", "value", "!=", b"v2"),
            ]
            res = await s.txn(ok, [Put("k", b"v2"), Delete("gone")], [Get("k")])
            assert res.succeeded and res.gets == [] and res.revision == rev + 1
            res = await s.txn([Compare("missing", "value", "==", b"")], [], [Get("missing")])
            assert not res.succeeded and res.gets == [[]]  # value compare on absent: false
            assert not await s.compare_and_set("k", rev, b"stale")
            assert await s.compare_and_set("k", rev + 1, b"v3")
            assert await s.create("new", b"1") and not await s.create("new", b"2")
        finally:
            await s.close()

    run(body)


def test_leases_round_up_and_expire(etcd_session: EtcdCluster) -> None:
    async def body() -> None:
        s = await open_store(etcd_session, key_prefix=unique_prefix())
        try:
            lease = await s.lease_grant(0.2)
            assert await s.lease_keepalive(lease) == 1.0  # whole seconds, at least 1
            assert await s.lease_keepalive(await s.lease_grant(1.5)) == 2.0
            watch = await s.watch("owned")
            await s.put("owned", b"x", lease=lease)
            assert (await next_event(watch)).type == "put"
            # etcd deletes the key once the lease expires: a bounded wait
            event = await next_event(watch, timeout=30)
            assert event.type == "delete" and event.kv.key == "owned"
            with pytest.raises(LeaseNotFound):
                await s.lease_keepalive(lease)
            with pytest.raises(LeaseNotFound):
                await s.put("k", b"v", lease=lease)
            await s.lease_revoke(lease)  # missing: a no-op
            with pytest.raises(StoreError):
                await s.lease_grant(0)
        finally:
            await s.close()

    run(body)


def test_watch_history_and_compaction(etcd_session: EtcdCluster) -> None:
    async def body() -> None:
        s = await open_store(etcd_session, key_prefix=unique_prefix())
        try:
            first = await s.put("w/a", b"1")
            await s.put("w/b", b"2")
            await s.delete("w/a")
            watch = await s.watch("w/", prefix=True, start_revision=first)
            got = [await next_event(watch) for _ in range(3)]
            assert [(e.type, e.kv.key) for e in got] == [
                ("put", "w/a"),
                ("put", "w/b"),
                ("delete", "w/a"),
            ]
            assert [e.kv.mod_revision for e in got] == [first, first + 1, first + 2]
            await watch.close()
            with pytest.raises(StopAsyncIteration):
                await next_event(watch)
            # Compact past `first`: history from there is gone.
            _, now = await s.get_prefix("w/")
            await asyncio.to_thread(
                gateway, etcd_session.url, "kv/compaction", {"revision": str(now)}
            )
            with pytest.raises(RevisionCompacted):
                await s.watch("w/", prefix=True, start_revision=first)
            # A watch from a future revision is fine.
            future = await s.watch("w/x", start_revision=now + 2)
            await s.put("w/x", b"skipped")
            await s.put("w/x", b"seen")
            assert (await next_event(future)).kv.value == b"seen"
            await future.close()
        finally:
            await s.close()

    run(body)


def test_unreachable_endpoint_is_named_within_the_timeout() -> None:
    port = free_ports(1)[0]

    async def body() -> None:
        from elastrun.store.etcd import open_etcd_store

        # It gives up with an error naming the endpoint (run() bounds the wait).
        with pytest.raises(StoreUnavailable) as info:
            await open_etcd_store(f"127.0.0.1:{port}", timeout=2.0)
        assert f"127.0.0.1:{port}" in str(info.value)

    run(body)


def test_bad_configuration_is_a_config_error(tmp_path: object) -> None:
    async def body() -> None:
        from elastrun.store.etcd import open_etcd_store

        missing = "/nonexistent/elastrun/ca.pem"
        with pytest.raises(ConfigError, match=missing):
            await open_etcd_store("127.0.0.1:2379", options=EtcdOptions(cacert=missing))
        with pytest.raises(ConfigError, match="cert and key"):
            await open_etcd_store("127.0.0.1:2379", options=EtcdOptions(cert=__file__))
        for bad in ("", "host:notaport", "host:0", "ftp://host:1", "[::1"):
            with pytest.raises(ConfigError):
                await open_etcd_store(bad, timeout=1.0)

    run(body)


def test_endpoint_parsing() -> None:
    from elastrun.store.etcd_conn import Endpoint, parse_endpoints

    eps, https = parse_endpoints("a, b:1,[::1]:2,https://c:3,::1")
    assert https
    assert eps == (
        Endpoint("a", 2379),
        Endpoint("b", 1),
        Endpoint("::1", 2),
        Endpoint("c", 3),
        Endpoint("::1", 2379),
    )
    assert str(eps[2]) == "[::1]:2"


def test_authentication(etcd_with_auth: EtcdCluster) -> None:
    async def body() -> None:
        with pytest.raises(AuthenticationError, match="user name or password"):
            await open_store(etcd_with_auth, user="root", password="wrong")
        with pytest.raises(AuthenticationError, match="requires authentication"):
            await open_store(etcd_with_auth)
        s = await open_store(etcd_with_auth, user="root", password="pw", key_prefix="auth/")
        try:
            watch = await s.watch("k")
            await s.put("k", b"v")
            assert (await next_event(watch)).kv.value == b"v"
            lease = await s.lease_grant(5)
            assert await s.lease_keepalive(lease) == 5.0
            # An expired/invalid token is renewed transparently.
            s.conn._token = "bogus.1"  # type: ignore[attr-defined]
            assert (await s.get("k")).value == b"v"  # type: ignore[union-attr]
        finally:
            await s.close()

    run(body)


def test_tls_with_client_certificates() -> None:
    cluster = start_cluster(1, tls=True)
    assert cluster.tls is not None
    tls = cluster.tls

    async def body() -> None:
        from elastrun.store.etcd import open_etcd_store

        conf = {"cacert": tls.cacert, "cert": tls.cert, "key": tls.key, "key_prefix": "tls/"}
        s = await open_etcd_store(cluster.endpoints, options=EtcdOptions(**conf), timeout=10.0)
        try:
            watch = await s.watch("k")
            await s.put("k", b"secure")
            assert (await next_event(watch)).kv.value == b"secure"
        finally:
            await s.close()
        # Without a client certificate etcd refuses the TLS handshake.
        with pytest.raises(StoreUnavailable, match=f"{cluster.endpoints} unavailable over TLS"):
            await open_etcd_store(
                cluster.endpoints, options=EtcdOptions(cacert=tls.cacert), timeout=2.0
            )

    try:
        run(body)
    finally:
        cluster.stop()


def test_httpx_is_imported_only_for_the_etcd_backend() -> None:
    import subprocess
    import sys

    code = (
        "import sys, elastrun.cli, elastrun.store.factory, elastrun.store.memory\n"
        "assert 'httpx' not in sys.modules, 'httpx imported without the etcd backend'\n"
        "import elastrun.store.etcd\n"
        "assert 'httpx' in sys.modules\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
