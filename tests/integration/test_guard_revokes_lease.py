"""An agent's death is noticed at once, not at its lease's TTL.

The orphan guard (agent/_guard_main.py) outlives a SIGKILLed agent; besides
killing the agent's workers it revokes the agent's rendezvous lease, with the
agent's own store settings (etcd: endpoints, TLS files, user and password;
the embedded store: address and token).

* The guard alone, against real stores (the embedded store with a token;
  etcd with TLS client certificates, and with a user and password): a lease
  held by a live client
  (nothing else would end it before its TTL, an hour) is revoked when the
  guard's pipe closes without a word, as it does when the agent dies; a lease
  the agent said it no longer holds is left alone.
* End to end on etcd: two agents, ``lease_ttl`` an hour; one is SIGKILLed
  with its workers (not its guard, which lives in a session of its own); the
  survivor re-forms at world 1 while the test waits (bounded), so long before
  the lease would have expired.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastrun.agent.guard import OrphanGuard
from elastrun.store.base import Store
from elastrun.store.client import TcpStore
from elastrun.store.etcd import open_etcd_store
from elastrun.store.etcd_options import EtcdOptions
from elastrun.store.server import StoreServer
from tests.helpers import pid_alive, wait_for
from tests.integration.elastic_harness import BOUND, job, steps_after
from tests.integration.test_node_loss_disconnect import QUIET_WORKER
from tests.store.etcd_fixture import (
    EtcdCluster,
    enable_auth,
    requires_etcd,
    start_cluster,
    unique_prefix,
)

LEASE_TTL = 3600  # an hour: nothing but a revoke ends a lease while a test runs
GONE_BOUND = 30.0  # a bounded wait for the key to go


async def revoked_by_guard(store: Store, *, tell_none: bool = False) -> bool:
    """Hold a key on a lease of LEASE_TTL through ``store``, give the lease to
    a real guard process and end the guard's pipe as a dying agent does.
    Returns whether the key went: waited for (bounded) while the guard
    lives; once it has exited, nothing can revoke the lease any more."""
    lease = await store.lease_grant(LEASE_TTL)
    key = f"guarded-{secrets.token_hex(3)}"
    await store.put(key, b"alive", lease)
    guard = OrphanGuard()
    assert guard.start(), guard.error
    pid = guard.pid
    assert pid is not None
    guard.set_lease(store.revoke_spec(lease))
    if tell_none:  # the agent revoked it itself and said so
        guard.set_lease(None)
    await guard.close()  # end of file on the guard's stdin: "the agent is gone"
    deadline = time.monotonic() + GONE_BOUND
    while pid_alive(pid) and time.monotonic() < deadline:
        if await store.get(key) is None:
            return True
        await asyncio.sleep(0.05)
    assert not pid_alive(pid), f"the guard did not exit within {GONE_BOUND:.0f} s"
    if await store.get(key) is None:
        return True
    await store.lease_revoke(lease)
    return False


def test_guard_revokes_the_lease_on_the_embedded_store() -> None:
    async def body() -> None:
        async with StoreServer("127.0.0.1", 0, token="s3cret") as server:
            host, port = server.address or ("", 0)
            store = await TcpStore.connect(host, port, token="s3cret", timeout=5)
            assert await revoked_by_guard(store)
            assert not await revoked_by_guard(store, tell_none=True)
            await store.close()

    asyncio.run(body())


@requires_etcd
@pytest.mark.etcd
@pytest.mark.parametrize("security", ["tls", "auth"])
def test_guard_revokes_the_lease_on_etcd_with_the_agents_settings(security: str) -> None:
    """TLS with client certificates, or a user and password (etcd's gateway
    does not take both at once)."""
    cluster = start_cluster(1, tls=security == "tls")
    try:
        conf = {"key_prefix": unique_prefix()}
        if cluster.tls is not None:
            tls = cluster.tls
            conf |= {"cacert": tls.cacert, "cert": tls.cert, "key": tls.key}
        else:
            enable_auth(cluster, password="pw")
            conf |= {"user": "root", "password": "pw"}

        async def body() -> None:
            store = await open_etcd_store(
                cluster.endpoints, options=EtcdOptions(**conf), timeout=10
            )
            assert await revoked_by_guard(store)
            assert not await revoked_by_guard(store, tell_none=True)
            await store.close()

        asyncio.run(body())
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def etcd1() -> Iterator[EtcdCluster]:
    cluster = start_cluster(1)
    try:
        yield cluster
    finally:
        cluster.stop()


@requires_etcd
@pytest.mark.etcd
def test_a_sigkilled_agent_is_dropped_on_etcd_before_its_lease_ttl(
    tmp_path: Path, etcd1: EtcdCluster
) -> None:
    worker = tmp_path / "quiet_worker.py"
    worker.write_text(QUIET_WORKER)
    run_id = f"guard-{secrets.token_hex(3)}"
    flags = [
        "--nnodes=1:2",
        "--nproc-per-node=1",
        "--rdzv-backend=etcd",
        f"--rdzv-endpoint={etcd1.endpoints}",
        f"--rdzv-id={run_id}",
        "--max-restarts=3",
        f"--rdzv-conf=last_call_timeout=1,lease_ttl={LEASE_TTL},join_timeout=60,"
        "key_prefix=/elastrun-test/",
        "--shutdown-timeout=5",
    ]
    with job(tmp_path) as j:
        a = j.start_agent("a", flags, script=str(worker))
        b = j.start_agent("b", flags, script=str(worker))
        wait_for(lambda: any(s["world"] == 2 for s in j.steps()), BOUND, "training at world 2")
        mark = len(j.steps())
        b.kill_group()  # the agent and its workers; its guard is in its own session
        wait_for(
            lambda: steps_after(j, mark, lambda s: s["world"] == 1),
            BOUND,
            f"world 1 (bounded; the lease TTL is {LEASE_TTL} s)",
        )
        assert max(s["restart"] for s in j.steps()) == 0  # a membership change
        j.touch("finish")
        assert a.wait(BOUND) == 0, a.output()[-3000:]
