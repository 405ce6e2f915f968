"""The exit barrier with real processes and a real embedded TCP store: it
waits for every member, then finishes the job; it survives its watcher (group
rank 0) being killed mid-barrier; a member killed during it ends it at once.
The barrier's timeout is an hour: a barrier that ends while a test waits was
ended by its members, never by the timeout. When it ends (at once, to the
virtual millisecond) is checked in tests/unit/test_rdzv_barrier.py.
Fixtures and helpers: tests/integration/test_rendezvous.py."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from elastrun.rendezvous import keys as K
from elastrun.store.client import TcpStore
from tests.integration import test_rendezvous as base
from tests.integration.test_rendezvous import assert_one_world, step

store = base.store  # the fixtures
cluster = base.cluster

BARRIER = 3600.0  # rdzv_node's exit_barrier_timeout: far beyond every wait here


def done_keys(c: Any) -> set[str]:
    """The nodes whose done key for round 0 is in the store: they are at the
    exit barrier (or past it)."""

    async def read() -> set[str]:
        host, port = c.addr
        store = await TcpStore.connect(host, port, timeout=10.0)
        try:
            kvs, _ = await store.get_prefix(K.Keys(c.common["run_id"]).dones(0))
            return {K.node_id_of(kv.key) for kv in kvs}
        finally:
            await store.close()

    return asyncio.run(read())


def wait_at_barrier(c: Any, nodes: set[str], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not nodes <= done_keys(c):
        assert time.monotonic() < deadline, f"{nodes} not at the barrier after {timeout}s"
        time.sleep(0.05)


def assert_job_finished(c: Any) -> None:
    """A node that comes now is told the job is over (the round is finished)."""
    c.start(1, ["next_round"], first=50)
    late = c.wait(step("next_round", ok=False), 1, timeout=30)[0]
    assert late["error"] == "RendezvousClosed"


def test_the_barrier_waits_for_every_member_then_finishes(cluster: Any) -> None:
    c = cluster(min=4, max=4, barrier=BARRIER)
    for i, pause in enumerate([0.0, 0.5, 1.0, 2.5]):
        c.start(1, ["next_round", f"sleep:{pause}", "complete"], first=i)
    assert_one_world(c.wait(step("next_round"), 4, timeout=60), 4)
    wait_at_barrier(c, {"n0", "n1", "n2"})
    # Nobody got past the barrier while the last member was still running:
    # the lines are read before the done keys, so a last member not at the
    # barrier yet means none of those lines may exist.
    early = c.lines(step("complete"))
    if "n3" not in done_keys(c):
        assert not early, "the barrier ended before every member finished"
    # Then it ends for everyone, by the last member (never by the timeout).
    done = c.wait(step("complete"), 4, timeout=30)
    assert {d["node"] for d in done} == {"n0", "n1", "n2", "n3"} and all(d["ok"] for d in done)
    assert_job_finished(c)


def test_the_watcher_killed_mid_barrier_does_not_stall_the_others(cluster: Any) -> None:
    c = cluster(min=3, max=3, barrier=BARRIER, progress=True)
    # First to join: group rank 0, the barrier's watcher.
    victim = c.start(1, ["next_round", "complete"], first=0)
    victim.wait_lines(lambda x: x["step"] == "progress", 1, timeout=30)
    # n1 reaches the barrier (watching the victim) before it dies; n2 after.
    c.start(1, ["next_round", "sleep:0.5", "complete"], first=1)
    c.start(1, ["next_round", "sleep:4", "complete"], first=2)
    results = c.wait(step("next_round"), 3, timeout=60)
    assert_one_world(results, 3)
    assert next(r for r in results if r["node"] == "n0")["rank"] == 0
    wait_at_barrier(c, {"n0", "n1"})
    assert not c.lines(step("complete")), "the barrier ended before every member finished"
    victim.kill()  # at the barrier, its done key written
    done = c.wait(step("complete"), 2, timeout=30)  # not the barrier's timeout: an hour
    assert {d["node"] for d in done} == {"n1", "n2"}
    assert_job_finished(c)


def test_a_member_killed_during_the_barrier_ends_it(cluster: Any) -> None:
    ttl = 2.0
    c = cluster(min=3, max=3, ttl=ttl, barrier=BARRIER)
    victim = c.start(1, ["next_round", "hang"], first=9)
    c.start(2, ["next_round", "complete"])
    c.wait(step("next_round"), 3, timeout=60)
    c.wait(step("hang"), 1, timeout=30)
    wait_at_barrier(c, {"n0", "n1"})  # the others wait at the barrier
    assert not c.lines(step("complete"))
    victim.kill()  # its workers were running: no done key
    done = c.wait(step("complete"), 2, timeout=30)  # ended by the loss, at the lease TTL
    assert all(d["ok"] for d in done)
