"""The one conformance suite every store passes (see conftest.BACKENDS).

Lease TTLs are whole seconds (1-2 s) so the same tests hold on etcd, which
rounds TTLs up; bounds on expiry are generous (TTL + a few seconds).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from elastrun.errors import LeaseNotFound, RevisionCompacted, StoreError
from elastrun.store.base import (
    Compare,
    Count,
    Delete,
    Get,
    KeyValue,
    Put,
    Store,
    Watch,
    WatchEvent,
)
from tests.store.conftest import ClientFactory, StoreHarness


async def next_event(watch: Watch, timeout: float = 5.0) -> WatchEvent:
    return await asyncio.wait_for(watch.__anext__(), timeout)


async def events(watch: Watch, n: int, timeout: float = 5.0) -> list[tuple[str, str, bytes]]:
    out: list[tuple[str, str, bytes]] = []
    for _ in range(n):
        e = await next_event(watch, timeout)
        out.append((e.type, e.kv.key, e.kv.value))
    return out


def test_put_get_and_revisions(make_store: StoreHarness) -> None:
    p = make_store.prefix

    async def body(new: ClientFactory) -> None:
        s = await new()
        assert await s.get(p + "missing") is None
        r1 = await s.put(p + "a", b"1")
        r2 = await s.put(p + "a", b"\x00\xff binary")
        assert r2 > r1 > 0
        kv = await s.get(p + "a")
        assert kv is not None
        assert kv.value == b"\x00\xff binary"
        assert (kv.create_revision, kv.mod_revision, kv.version) == (r1, r2, 2)
        # another client sees the same data
        other = await new()
        assert await other.get(p + "a") == kv

    make_store.run(body)


def test_prefix_range_is_sorted_and_excludes_neighbours(make_store: StoreHarness) -> None:
    p = make_store.prefix

    async def body(new: ClientFactory) -> None:
        s = await new()
        last = 0
        for k in ["r/b", "r/a", "r0", "r/c", "q", "r/a/deeper"]:
            last = await s.put(p + k, k.encode())
        kvs, rev = await s.get_prefix(p + "r/")
        assert [kv.key for kv in kvs] == [p + "r/a", p + "r/a/deeper", p + "r/b", p + "r/c"]
        assert [kv.value for kv in kvs] == [b"r/a", b"r/a/deeper", b"r/b", b"r/c"]
        assert rev >= last
        assert (await s.get_prefix(p + "nothing/"))[0] == []

    make_store.run(body)


def test_delete_and_prefix_delete(make_store: StoreHarness) -> None:
    p = make_store.prefix

    async def body(new: ClientFactory) -> None:
        s = await new()
        for k in ["d/1", "d/2", "d/3", "e"]:
            await s.put(p + k, b"x")
        assert await s.delete(p + "e") == 1
        assert await s.delete(p + "e") == 0
        assert await s.delete(p + "d/", prefix=True) == 3
        assert (await s.get_prefix(p))[0] == []

    make_store.run(body)


def test_txn_compare_and_set(make_store: StoreHarness) -> None:
    p = make_store.prefix
    k = p + "cas"

    async def body(new: ClientFactory) -> None:
        s = await new()
        assert await s.create(k, b"first")
        assert not await s.create(k, b"second")
        kv = await s.get(k)
        assert kv is not None and kv.value == b"first"
        assert not await s.compare_and_set(k, kv.mod_revision + 1000, b"stale")
        assert await s.compare_and_set(k, kv.mod_revision, b"third")
        # failure branch returns the current value
        r = await s.txn([Compare(k, "value", "==", b"nope")], [Put(k, b"x")], [Get(k)])
        assert not r.succeeded
        assert [kv.value for kv in r.gets[0]] == [b"third"]
        # one txn's writes share one revision; deletes and prefix gets work
        r = await s.txn(
            [Compare(k, "version", "==", 2), Compare(k, "value", "==", b"third")],
            [Put(p + "t/a", b"1"), Put(p + "t/b", b"2"), Delete(k), Get(p + "t/", prefix=True)],
        )
        assert r.succeeded
        a, b = r.gets[0]
        assert a.mod_revision == b.mod_revision == r.revision
        assert await s.get(k) is None
        with pytest.raises(StoreError):  # wrong operand type for the target
            await s.txn([Compare(k, "mod", "==", b"x")], [])

    make_store.run(body)


def test_txn_counts_keys_under_a_prefix(make_store: StoreHarness) -> None:
    """A Count op answers how many keys are under a prefix (not its
    neighbours), after the writes before it in its txn, in both branches,
    beside Gets in order."""
    p = make_store.prefix

    async def body(new: ClientFactory) -> None:
        s = await new()
        for k in ["c/a", "c/b", "c0", "b"]:
            await s.put(p + k, b"x")
        r = await s.txn([], [Count(p + "c/"), Get(p + "b"), Count(p + "nothing/")])
        assert r.succeeded and r.counts == [2, 0]
        assert [kv.value for kv in r.gets[0]] == [b"x"]
        # The txn's own put is counted by a Count after it, and its delete.
        r = await s.txn([], [Put(p + "c/c", b"y"), Count(p + "c/"), Delete(p + "c/a")])
        assert r.counts == [3]
        r = await s.txn([], [Delete(p + "c/b"), Count(p + "c/")])
        assert r.counts == [1]
        # The failure branch's counts; no Count op: no counts.
        r = await s.txn([Compare(p + "b", "version", "==", 9)], [Put(p + "b", b"z")], [Count(p)])
        assert not r.succeeded and r.counts == [3]  # c/c, c0, b
        r = await s.txn([], [Get(p + "b")])
        assert r.counts == []

    make_store.run(body)


def test_cas_race_has_exactly_one_winner(make_store: StoreHarness) -> None:
    p = make_store.prefix

    async def body(new: ClientFactory) -> None:
        clients = [await new() for _ in range(6)]
        for round_ in range(10):
            key = f"{p}race/{round_}"
            results = await asyncio.gather(
                *(c.create(key, str(i).encode()) for i, c in enumerate(clients))
            )
            assert sum(results) == 1, f"round {round_}: winners {results}"
            kv = await clients[0].get(key)
            assert kv is not None and kv.value == str(results.index(True)).encode()
            # and a CAS on the observed revision: again exactly one winner
            outcomes = await asyncio.gather(
                *(c.compare_and_set(key, kv.mod_revision, b"again") for c in clients)
            )
            assert sum(outcomes) == 1

    make_store.run(body)


def test_lease_expiry_deletes_keys_and_notifies_watchers(make_store: StoreHarness) -> None:
    p = make_store.prefix

    async def body(new: ClientFactory) -> None:
        owner, observer = await new(), await new()
        lease = await owner.lease_grant(1)
        await owner.put(p + "l/a", b"1", lease)
        await owner.put(p + "l/b", b"2", lease)
        await owner.put(p + "l/keep", b"3")
        watch = await observer.watch(p + "l/", prefix=True)
        # The deletes arrive (a bounded wait, not a speed claim: when they are
        # due is tested in virtual time, tests/unit/test_store_timers.py).
        got = await events(watch, 2, timeout=30.0)
        assert sorted(got) == [("delete", p + "l/a", b""), ("delete", p + "l/b", b"")]
        assert [kv.key for kv in (await observer.get_prefix(p + "l/"))[0]] == [p + "l/keep"]
        with pytest.raises(LeaseNotFound):
            await owner.lease_keepalive(lease)
        with pytest.raises(LeaseNotFound):
            await owner.put(p + "l/c", b"", lease)
        await watch.close()

    make_store.run(body)


def test_keepalive_extends_lease(make_store: StoreHarness) -> None:
    p = make_store.prefix

    async def body(new: ClientFactory) -> None:
        s = await new()
        lease = await s.lease_grant(2)
        await s.put(p + "alive", b"1", lease)
        end = time.monotonic() + 3.5  # well past the TTL
        while time.monotonic() < end:
            assert await s.lease_keepalive(lease) >= 2
            await asyncio.sleep(0.4)
        assert await s.get(p + "alive") is not None
        deadline = time.monotonic() + 8.0
        while await s.get(p + "alive") is not None:
            assert time.monotonic() < deadline, "key outlived its lease"
            await asyncio.sleep(0.1)

    make_store.run(body)


def test_revoke_deletes_keys_at_once(make_store: StoreHarness) -> None:
    p = make_store.prefix

    async def body(new: ClientFactory) -> None:
        s = await new()
        lease = await s.lease_grant(60)
        await s.put(p + "rv/a", b"1", lease)
        watch = await s.watch(p + "rv/", prefix=True)
        await s.lease_revoke(lease)
        assert await events(watch, 1, timeout=2.0) == [("delete", p + "rv/a", b"")]
        assert await s.get(p + "rv/a") is None
        await s.lease_revoke(lease)  # revoking a missing lease is a no-op
        with pytest.raises(LeaseNotFound):
            await s.lease_keepalive(lease)

    make_store.run(body)


def test_watch_orders_events_across_keys(make_store: StoreHarness) -> None:
    p = make_store.prefix

    async def body(new: ClientFactory) -> None:
        watcher, writer = await new(), await new()
        watch = await watcher.watch(p + "w/", prefix=True)
        single = await watcher.watch(p + "w/a")
        await writer.put(p + "w/a", b"1")
        await writer.put(p + "w/b", b"1")
        await writer.put(p + "other", b"x")
        await writer.put(p + "w/a", b"2")
        await writer.delete(p + "w/b")
        seen = []
        for _ in range(4):
            seen.append(await next_event(watch))
        assert [(e.type, e.kv.key, e.kv.value) for e in seen] == [
            ("put", p + "w/a", b"1"),
            ("put", p + "w/b", b"1"),
            ("put", p + "w/a", b"2"),
            ("delete", p + "w/b", b""),
        ]
        revisions = [e.kv.mod_revision for e in seen]
        assert revisions == sorted(revisions) and len(set(revisions)) == 4
        assert await events(single, 2) == [("put", p + "w/a", b"1"), ("put", p + "w/a", b"2")]

    make_store.run(body)


def test_watch_from_old_revision_replays(make_store: StoreHarness) -> None:
    p = make_store.prefix

    async def body(new: ClientFactory) -> None:
        s = await new()
        r1 = await s.put(p + "h", b"1")
        await s.put(p + "h", b"2")
        await s.put(p + "unrelated", b"x")
        watch = await s.watch(p + "h", start_revision=r1 + 1)
        await s.put(p + "h", b"3")
        assert await events(watch, 2) == [("put", p + "h", b"2"), ("put", p + "h", b"3")]

    make_store.run(body)


def test_watch_close_ends_iteration(make_store: StoreHarness) -> None:
    p = make_store.prefix

    async def body(new: ClientFactory) -> None:
        s = await new()
        watch = await s.watch(p + "c")
        await s.put(p + "c", b"1")
        got = []

        async def consume() -> None:
            async for event in watch:
                got.append(event.kv.value)
                await watch.close()

        await asyncio.wait_for(consume(), 5.0)
        assert got == [b"1"]
        await s.put(p + "c", b"2")  # nothing delivered after close
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(watch.__anext__(), 1.0)

    make_store.run(body)


def test_waiting_on_a_watch_is_bounded_and_cancel_safe(make_store: StoreHarness) -> None:
    p = make_store.prefix

    async def body(new: ClientFactory) -> None:
        s: Store = await new()
        watch = await s.watch(p + "quiet")
        # The wait ends with TimeoutError (a wait that hung would end the
        # body's own bound instead, failing the test).
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(watch.__anext__(), 0.3)
        # the cancelled wait lost nothing: the next event still arrives
        await s.put(p + "quiet", b"now")
        assert await events(watch, 1) == [("put", p + "quiet", b"now")]

    make_store.run(body)


def test_invalid_lease_ttl_is_a_store_error(make_store: StoreHarness) -> None:
    async def body(new: ClientFactory) -> None:
        s = await new()
        with pytest.raises(StoreError):
            await s.lease_grant(-1)

    make_store.run(body)


# -- get_prefix_newest: the newest keys created up to a revision ----------------
def test_newest_selects_by_create_revision_newest_first(make_store: StoreHarness) -> None:
    p = make_store.prefix

    async def body(new: ClientFactory) -> None:
        s = await new()
        j = p + "j/"
        order = ["n3", "n1", "n4", "n0", "n2"]  # creation order, not key order
        created = {name: await s.put(j + name, b"x") for name in order}
        revs = [created[name] for name in order]
        # Neighbours outside the prefix, and a rewrite (its create revision stays).
        await s.put(p + "j", b"")
        await s.put(p + "jx/n9", b"")
        last = await s.put(j + "n3", b"rewritten")

        def names(kvs: list[KeyValue]) -> list[str]:
            assert all(kv.key.startswith(j) for kv in kvs)
            return [kv.key[len(j) :] for kv in kvs]

        kvs, count, rev = await s.get_prefix_newest(j, revs[3], 2)
        assert (names(kvs), count) == (["n0", "n4"], 5)
        assert rev >= last
        assert [kv.create_revision for kv in kvs] == [revs[3], revs[2]]
        assert kvs[0] == await s.get(j + "n0")  # whole key-values, not just keys
        # the default limit is 1: one's own key (or, with one less, its predecessor)
        kvs, count, _ = await s.get_prefix_newest(j, revs[2])
        assert (names(kvs), count) == (["n4"], 5)
        kvs, _, _ = await s.get_prefix_newest(j, revs[2] - 1)
        assert names(kvs) == ["n1"]
        # a bound past every key: the newest of all
        kvs, count, _ = await s.get_prefix_newest(j, last + 1000, 3)
        assert (names(kvs), count) == (["n2", "n0", "n4"], 5)
        # the rewritten key counts by its creation, and carries its new value
        kvs, _, _ = await s.get_prefix_newest(j, revs[0], 1)
        assert names(kvs) == ["n3"] and kvs[0].value == b"rewritten"
        assert (kvs[0].create_revision, kvs[0].mod_revision) == (revs[0], last)

    make_store.run(body)


def test_newest_limit_and_bounds_edge_cases(make_store: StoreHarness) -> None:
    p = make_store.prefix

    async def body(new: ClientFactory) -> None:
        s = await new()
        j = p + "j/"
        revs = [await s.put(j + name, b"") for name in ["c", "a", "b"]]
        newest_first = [j + "b", j + "a", j + "c"]
        # a limit larger than what there is: every selected key, no padding
        kvs, count, _ = await s.get_prefix_newest(j, revs[1], 10)
        assert ([kv.key for kv in kvs], count) == ([j + "a", j + "c"], 3)
        kvs, count, _ = await s.get_prefix_newest(j, revs[2], 100)
        assert ([kv.key for kv in kvs], count) == (newest_first, 3)
        # limit 0: no limit
        kvs, _, _ = await s.get_prefix_newest(j, revs[2], 0)
        assert [kv.key for kv in kvs] == newest_first
        # a bound below the first key (and 0): nothing, but the count of all
        for bound in (revs[0] - 1, 0):
            kvs, count, rev = await s.get_prefix_newest(j, bound, 2)
            assert (kvs, count) == ([], 3)
            assert rev >= revs[2]
        # a prefix with no keys under it
        kvs, count, rev = await s.get_prefix_newest(p + "none/", revs[2], 5)
        assert (kvs, count) == ([], 0)
        assert rev >= revs[2]
        # the empty prefix (every key of the store): the bound picks my key
        kvs, count, _ = await s.get_prefix_newest("", revs[1], 1)
        assert [kv.key for kv in kvs] == [j + "a"]
        assert count >= 3

    make_store.run(body)


def test_newest_sees_a_recreated_key_at_its_new_create_revision(
    make_store: StoreHarness,
) -> None:
    p = make_store.prefix

    async def body(new: ClientFactory) -> None:
        s = await new()
        j = p + "j/"
        a1 = await s.put(j + "a", b"1")
        b1 = await s.put(j + "b", b"1")
        await s.delete(j + "a")
        kvs, count, _ = await s.get_prefix_newest(j, b1 + 1000, 5)
        assert ([kv.key for kv in kvs], count) == ([j + "b"], 1)
        a2 = await s.put(j + "a", b"2")
        assert a2 > b1 > a1
        kvs, count, _ = await s.get_prefix_newest(j, a2, 5)
        assert ([(kv.key, kv.create_revision) for kv in kvs], count) == (
            [(j + "a", a2), (j + "b", b1)],
            2,
        )
        # Its old creation is gone: up to b1, only b was created (and still is).
        kvs, count, _ = await s.get_prefix_newest(j, b1, 5)
        assert ([kv.key for kv in kvs], count) == ([j + "b"], 2)
        kvs, _, _ = await s.get_prefix_newest(j, a1, 5)
        assert kvs == []

    make_store.run(body)


def test_newest_orders_keys_of_one_txn_by_key(make_store: StoreHarness) -> None:
    p = make_store.prefix

    async def body(new: ClientFactory) -> None:
        s = await new()
        j = p + "j/"
        first = await s.put(j + "z", b"")
        res = await s.txn([], [Put(j + "c", b""), Put(j + "a", b""), Put(j + "b", b"")])
        kvs, count, _ = await s.get_prefix_newest(j, res.revision, 0)
        assert [kv.key for kv in kvs] == [j + "a", j + "b", j + "c", j + "z"]
        assert [kv.create_revision for kv in kvs] == [res.revision] * 3 + [first]
        assert count == 4
        # (Which of them a limit keeps is unspecified: etcd's sort is unstable.)
        kvs, _, _ = await s.get_prefix_newest(j, res.revision, 2)
        assert len(kvs) == 2 and {kv.key for kv in kvs} <= {j + "a", j + "b", j + "c"}

    make_store.run(body)


# -- compaction: history before a revision is gone; current values are not ---
def test_compaction_refuses_old_watches_and_keeps_current_values(make_store: StoreHarness) -> None:
    p = make_store.prefix
    k = p + "compact"

    async def body(new: ClientFactory) -> None:
        s = await new()
        revs = [await s.put(k, str(i).encode()) for i in range(4)]
        live = await s.watch(k)
        await s.compact(revs[2])
        # a watch from before the compaction: compacted, naming the oldest kept
        with pytest.raises(RevisionCompacted) as info:
            watch = await s.watch(k, start_revision=revs[1])
            await next_event(watch)  # (where a store reports it only on the stream)
        assert info.value.compact_revision == revs[2]
        # from the compaction revision on, the history is there
        watch = await s.watch(k, start_revision=revs[2])
        assert await events(watch, 2) == [("put", k, b"2"), ("put", k, b"3")]
        # the current value, and watches established before, are untouched
        kv = await s.get(k)
        assert kv is not None and (kv.value, kv.version) == (b"3", 4)
        await s.put(k, b"4")
        assert await events(live, 1) == [("put", k, b"4")]
        assert await events(watch, 1) == [("put", k, b"4")]
        # compacting again to the same or an older revision: already compacted
        for again in (revs[2], revs[0]):
            with pytest.raises(RevisionCompacted):
                await s.compact(again)
        # a future revision is refused, and is no compaction
        with pytest.raises(StoreError) as future:
            await s.compact(revs[3] + 1000)
        assert not isinstance(future.value, RevisionCompacted)

    make_store.run(body)
