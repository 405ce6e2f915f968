"""Pure tests of the store engine (no I/O, fake clock)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from elastrun.clock import FakeClock
from elastrun.errors import LeaseNotFound, LimitExceeded, RevisionCompacted
from elastrun.store.base import Compare, Delete, Get, Put, WatchEvent, newest_created
from elastrun.store.engine import Engine
from elastrun.store.limits import StoreLimits, encoded_size


def test_revisions_and_versions() -> None:
    e = Engine(FakeClock())
    assert e.put("a", b"1") == 1
    assert e.put("a", b"2") == 2
    kv = e.get("a")
    assert kv is not None
    assert (kv.value, kv.create_revision, kv.mod_revision, kv.version) == (b"2", 1, 2, 2)
    assert e.delete("a") == 1
    assert e.get("a") is None
    assert e.revision == 3


def test_prefix_range_is_sorted_and_bounded() -> None:
    e = Engine(FakeClock())
    for k in ["p/b", "p/a", "q/a", "p/c", "o"]:
        e.put(k, b"")
    assert [kv.key for kv in e.range("p/", prefix=True)] == ["p/a", "p/b", "p/c"]


def test_txn_compare_and_set() -> None:
    e = Engine(FakeClock())
    r = e.txn([Compare.absent("k")], [Put("k", b"x")], [Get("k")])
    assert r.succeeded
    r = e.txn([Compare.absent("k")], [Put("k", b"y")], [Get("k")])
    assert not r.succeeded
    assert r.gets[0][0].value == b"x"
    rev = r.gets[0][0].mod_revision
    assert e.txn([Compare.unchanged("k", rev)], [Put("k", b"z"), Delete("other")], []).succeeded
    assert e.get("k") is not None and e.get("k").value == b"z"  # type: ignore[union-attr]


def test_lease_expiry_deletes_keys_and_notifies() -> None:
    clock = FakeClock()
    e = Engine(clock)
    seen: list[WatchEvent] = []
    e.add_watcher("n/", True, None, seen.extend)
    lease = e.lease_grant(2.0)
    e.put("n/a", b"1", lease)
    clock.advance(1.5)
    e.lease_keepalive(lease)
    clock.advance(1.5)
    assert e.expire_leases() == []
    clock.advance(1.0)
    assert e.expire_leases() == [lease]
    assert e.get("n/a") is None
    assert [(ev.type, ev.kv.key) for ev in seen] == [("put", "n/a"), ("delete", "n/a")]
    with pytest.raises(LeaseNotFound):
        e.lease_keepalive(lease)
    with pytest.raises(LeaseNotFound):
        e.put("n/b", b"", lease)


def test_watch_replays_history_from_revision() -> None:
    e = Engine(FakeClock())
    e.put("a", b"1")
    e.put("b", b"1")
    e.put("a", b"2")
    seen: list[WatchEvent] = []
    e.add_watcher("a", False, 2, seen.extend)
    e.put("a", b"3")
    assert [ev.kv.value for ev in seen] == [b"2", b"3"]


# -- the watcher index: a write reaches exactly the watchers it matches ---------
def _keys(seen: list[WatchEvent]) -> list[str]:
    return [ev.kv.key for ev in seen]


def test_exact_watcher_ignores_siblings_and_prefix_watcher_sees_all_under_it() -> None:
    e = Engine(FakeClock())
    exact: list[WatchEvent] = []
    under: list[WatchEvent] = []
    e.add_watcher("a/b", False, None, exact.extend)
    e.add_watcher("a/b", True, None, under.extend)
    for key in ["a/bc", "a/b", "a/b/x", "a/c", "a", "b", "a/", "a/b"]:
        e.put(key, b"v")
    e.delete("a/b")
    assert _keys(exact) == ["a/b", "a/b", "a/b"]
    assert [ev.type for ev in exact] == ["put", "put", "delete"]
    assert _keys(under) == ["a/bc", "a/b", "a/b/x", "a/b", "a/b"]


def test_removed_watchers_see_nothing_and_leave_no_index_behind() -> None:
    e = Engine(FakeClock())
    one: list[WatchEvent] = []
    two: list[WatchEvent] = []
    pre: list[WatchEvent] = []
    w1 = e.add_watcher("k", False, None, one.extend)
    w2 = e.add_watcher("k", False, None, two.extend)
    wp = e.add_watcher("k", True, None, pre.extend)
    e.put("k", b"1")
    e.remove_watcher(w1)
    e.put("k", b"2")
    assert [ev.kv.value for ev in one] == [b"1"]
    assert [ev.kv.value for ev in two] == [b"1", b"2"]  # the other one on "k" stays
    e.remove_watcher(w2)
    e.remove_watcher(wp)
    e.remove_watcher(wp)  # twice, and unknown ids: no-ops
    e.remove_watcher(12345)
    e.put("k", b"3")
    e.put("k2", b"3")
    assert len(one) == 1 and len(two) == 2 and len(pre) == 2
    assert not e._watchers and not e._by_key and not e._by_prefix


def test_many_watchers_each_get_only_their_events() -> None:
    e = Engine(FakeClock())
    n = 40
    exact: dict[str, list[WatchEvent]] = {}
    for i in range(n):
        exact[f"k/{i}"] = []
        e.add_watcher(f"k/{i}", False, None, exact[f"k/{i}"].extend)
    prefixes: dict[str, list[WatchEvent]] = {p: [] for p in ["k/", "k/1", "k/2", "x/"]}
    for p, seen in prefixes.items():
        e.add_watcher(p, True, None, seen.extend)
    for i in reversed(range(n)):
        e.put(f"k/{i}", str(i).encode())
    for key, seen in exact.items():
        assert _keys(seen) == [key]
        assert seen[0].kv.value == key[2:].encode()
    written = [f"k/{i}" for i in reversed(range(n))]
    assert _keys(prefixes["k/"]) == written
    for p in ["k/1", "k/2"]:
        assert _keys(prefixes[p]) == [k for k in written if k.startswith(p)]
    assert prefixes["x/"] == []


def test_a_multi_key_write_calls_each_watcher_once_with_its_events() -> None:
    e = Engine(FakeClock())
    calls: dict[str, list[list[str]]] = {"all": [], "k/1": [], "k/2": [], "other": []}

    def recorder(name: str) -> Callable[[list[WatchEvent]], None]:
        return lambda events: calls[name].append(_keys(events))

    order: list[str] = []
    e.add_watcher("k/", True, None, recorder("all"))
    e.add_watcher("k/1", False, None, recorder("k/1"))
    e.add_watcher("k/2", False, None, recorder("k/2"))
    e.add_watcher("other", False, None, recorder("other"))
    e.add_watcher("k/", True, None, lambda events: order.append("second prefix"))
    e.add_watcher("k/1", False, None, lambda events: order.append("second exact"))
    e.txn([], [Put("k/2", b""), Put("k/1", b""), Put("k/3", b"")], [])
    assert calls == {
        "all": [["k/2", "k/1", "k/3"]],
        "k/1": [["k/1"]],
        "k/2": [["k/2"]],
        "other": [],
    }
    assert order == ["second prefix", "second exact"]  # registration order
    e.delete("k/", prefix=True)
    assert calls["all"][-1] == ["k/1", "k/2", "k/3"]
    assert calls["k/1"][-1] == ["k/1"] and calls["k/2"][-1] == ["k/2"]


# -- watch replay from history ------------------------------------------------
def test_replay_from_the_middle_of_a_long_history_is_exact_and_ordered() -> None:
    e = Engine(FakeClock(), history=5000)
    for i in range(1200):
        e.put(f"h/{i % 7}", str(i).encode())
        if i % 100 == 99:
            e.delete(f"h/{i % 7}")
    assert e.revision == 1212
    start = 600
    replayed: list[WatchEvent] = []
    e.add_watcher("h/", True, start, replayed.extend)  # delivered before it returns
    assert [ev.kv.mod_revision for ev in replayed] == list(range(start, e.revision + 1))
    assert replayed[0] == WatchEvent("put", next(e.history.since(start))[1][0].kv)
    # then the live events follow, with nothing repeated
    e.put("h/x", b"live")
    assert replayed[-1].kv.key == "h/x" and replayed[-1].kv.mod_revision == 1213
    assert len(replayed) == 1213 - start + 1
    # an exact key's replay holds only that key's events
    only: list[WatchEvent] = []
    e.add_watcher("h/3", False, 1000, only.extend)
    assert _keys(only) == ["h/3"] * len(only)
    assert [ev.kv.mod_revision for ev in only] == [
        ev.kv.mod_revision for ev in replayed if ev.kv.key == "h/3" and ev.kv.mod_revision >= 1000
    ]
    # from the store's next revision (or later): nothing in the past
    later: list[WatchEvent] = []
    e.add_watcher("h/", True, e.revision + 1, later.extend)
    assert later == []


def test_replay_of_trimmed_history_raises_revision_compacted() -> None:
    e = Engine(FakeClock(), history=10)
    for i in range(25):
        e.put(f"t/{i}", b"")
    # revisions 16..25 are kept
    with pytest.raises(RevisionCompacted):
        e.add_watcher("t/", True, 15, lambda events: None)
    with pytest.raises(RevisionCompacted):
        e.add_watcher("t/3", False, 1, lambda events: None)
    assert not e._watchers  # a refused watch is not registered
    seen: list[WatchEvent] = []
    e.add_watcher("t/", True, 16, seen.extend)
    assert [ev.kv.mod_revision for ev in seen] == list(range(16, 26))
    # history not yet full: everything is still there, from revision 1
    fresh = Engine(FakeClock(), history=10)
    for i in range(9):
        fresh.put("f", str(i).encode())
    seen = []
    fresh.add_watcher("f", False, 1, seen.extend)
    assert [ev.kv.value for ev in seen] == [str(i).encode() for i in range(9)]


# -- range_newest -----------------------------------------------------------------
def test_range_newest_selects_by_create_revision_and_counts_all() -> None:
    e = Engine(FakeClock())
    for key in ["j/c", "j/a", "j/b", "jx"]:  # revisions 1..4
        e.put(key, b"")
    e.put("j/c", b"again")  # rewritten: still created at 1
    e.txn([], [Put("j/e", b""), Put("j/d", b"")], [])  # both created at 6

    def newest(max_create: int, limit: int) -> tuple[list[str], int]:
        kvs, count = e.range_newest("j/", max_create, limit)
        return [kv.key for kv in kvs], count

    assert newest(3, 1) == (["j/b"], 5)
    assert newest(2, 5) == (["j/a", "j/c"], 5)
    assert newest(6, 0) == (["j/d", "j/e", "j/b", "j/a", "j/c"], 5)  # ties: key order
    assert newest(6, 1) == (["j/d"], 5)
    assert newest(6, -1) == newest(6, 0)  # limit <= 0: no limit, as in etcd
    assert newest(0, 3) == ([], 5)
    assert e.range_newest("nothing/", 10, 3) == ([], 0)


def test_range_newest_answers_as_a_scan_through_puts_deletes_and_subfolders() -> None:
    """The folder index gives what newest_created over every key under the
    prefix gives, whatever was put, deleted or nested (seeded, bounded)."""
    rng = random.Random(23)
    e = Engine(FakeClock())
    names = [f"r/j/{c}" for c in "abcdefgh"] + ["r/j/sub/x", "r/jx", "r/k"]
    for _ in range(400):
        op = rng.random()
        if op < 0.5:
            e.put(rng.choice(names), b"v")
        elif op < 0.7:
            e.txn([], [Put(rng.choice(names), b""), Put(rng.choice(names), b"")], [])
        else:
            e.delete(rng.choice(names))
        for prefix in ("r/j/", "r/j", "r/", "r/j/sub/", "nothing/"):
            every = e.range(prefix, prefix=True)
            max_create, limit = rng.randint(0, e.revision + 1), rng.randint(-1, 4)
            want = newest_created(every, max_create, limit), len(every)
            assert e.range_newest(prefix, max_create, limit) == want, prefix


# -- bounds in bytes: history, data, values, answers -------------------------------
def small_limits(**changes: int) -> StoreLimits:
    base = {"history_bytes": 64 * 1024, "max_data_bytes": 256 * 1024, "max_value": 16 * 1024}
    return StoreLimits(**{**base, **changes})


def test_history_is_bounded_in_bytes_and_compacts_the_oldest() -> None:
    e = Engine(FakeClock(), limits=small_limits())
    value = b"x" * 10_000
    for _ in range(300):
        e.put("big", value)
    assert e.history.bytes <= 64 * 1024
    assert 1 <= len(e.history) <= 7
    assert e.compact_revision == 300 - len(e.history) + 1
    e.delete("big")
    assert e.data_bytes == 0  # nothing of the overwritten values is held as data
    with pytest.raises(RevisionCompacted) as info:
        e.add_watcher("big", False, 5, lambda events: None)
    assert info.value.compact_revision == e.compact_revision
    seen: list[WatchEvent] = []
    e.add_watcher("big", False, e.compact_revision, seen.extend)
    assert [ev.kv.mod_revision for ev in seen] == list(range(e.compact_revision, 302))
    assert seen[-1].type == "delete"


def test_one_revision_larger_than_the_history_bound_is_still_kept() -> None:
    e = Engine(FakeClock(), limits=small_limits(history_bytes=1000))
    e.put("a", b"")
    e.put("b", b"y" * 5000)
    assert len(e.history) == 1 and e.compact_revision == 2
    seen: list[WatchEvent] = []
    e.add_watcher("b", False, 2, seen.extend)
    assert [ev.kv.value for ev in seen] == [b"y" * 5000]


def test_compact_discards_history_before_a_revision() -> None:
    e = Engine(FakeClock())
    for i in range(5):
        e.put("k", str(i).encode())
    e.compact(3)
    assert e.compact_revision == 3
    with pytest.raises(RevisionCompacted):
        e.add_watcher("k", False, 2, lambda events: None)
    seen: list[WatchEvent] = []
    e.add_watcher("k", False, 3, seen.extend)
    assert [ev.kv.value for ev in seen] == [b"2", b"3", b"4"]
    for again in (3, 1):
        with pytest.raises(RevisionCompacted):
            e.compact(again)
    with pytest.raises(ValueError, match="future"):
        e.compact(99)
    assert e.get("k") is not None and e.get("k").value == b"4"  # type: ignore[union-attr]


def test_writes_over_the_value_key_or_data_limits_fail_unapplied() -> None:
    e = Engine(FakeClock(), limits=small_limits())
    with pytest.raises(LimitExceeded, match="max_value"):
        e.put("v", b"x" * (16 * 1024 + 1))
    with pytest.raises(LimitExceeded, match="max_key"):
        e.put("k" * 5000, b"")
    with pytest.raises(LimitExceeded, match="max_value"):  # all or nothing in a txn
        e.txn([], [Put("ok", b""), Put("v", b"x" * 20_000)], [])
    assert e.revision == 0 and e.get("ok") is None
    e.put("v", b"x" * 16 * 1024)  # at the limit: fine
    for i in range(14):  # 15 values of 16 KiB (and their overhead) fit in 256 KiB
        e.put(f"fill/{i}", b"f" * 16 * 1024)
    with pytest.raises(LimitExceeded, match="max_data_bytes"):
        e.put("fill/more", b"f" * 16 * 1024)
    e.put("fill/0", b"")  # shrinking is always allowed
    e.put("fill/more", b"f" * 10_000)  # and frees room
    e.delete("fill/", prefix=True)
    e.put("after", b"f" * 16 * 1024)


def test_txn_whose_gets_could_answer_too_much_is_refused_unapplied() -> None:
    e = Engine(FakeClock())
    for i in range(20):
        e.put(f"r/{i:02d}", b"x" * 1000)
    revision = e.revision
    with pytest.raises(LimitExceeded, match="max_response"):
        e.txn([], [Put("w", b"1"), Get("r/", prefix=True)], [], max_answer=10_000)
    assert e.revision == revision and e.get("w") is None
    result = e.txn([], [Put("w", b"1"), Get("r/0", prefix=True)], [], max_answer=30_000)
    assert [kv.key for kv in result.gets[0]] == [f"r/{i:02d}" for i in range(10)]


def test_range_pages_cover_every_key_once_in_order() -> None:
    e = Engine(FakeClock())
    keys = [f"p/{i:03d}" for i in range(50)]
    for k in keys:
        e.put(k, b"v" * 100)
    e.put("p0", b"")  # a neighbour outside the prefix
    seen: list[str] = []
    after: str | None = None
    pages = 0
    while True:
        kvs, more = e.range_page("p/", after, 0, 1500)
        pages += 1
        assert kvs and sum(encoded_size(kv) for kv in kvs[:-1]) <= 1500
        seen += [kv.key for kv in kvs]
        if not more:
            break
        after = kvs[-1].key
    assert seen == keys and pages > 5
    kvs, more = e.range_page("p/", None, 7, 1 << 20)
    assert len(kvs) == 7 and more
    assert e.range_page("p/", keys[-1], 0, 1 << 20) == ([], False)
    big = Engine(FakeClock())
    big.put("b/1", b"x" * 5000)
    assert len(big.range_page("b/", None, 0, 10)[0]) == 1  # never an empty page


# -- watchers that fall behind catch up from history ------------------------------
def test_a_watcher_that_refuses_events_catches_up_in_order() -> None:
    e = Engine(FakeClock())
    taken: list[int] = []
    room = [2]

    def take(events: list[WatchEvent]) -> bool:
        if room[0] <= 0:
            return False
        room[0] -= 1
        taken.extend(ev.kv.mod_revision for ev in events)
        return True

    wid = e.add_watcher("w/", True, None, take)
    for i in range(10):
        e.put(f"w/{i}", b"")
    assert taken == [1, 2] and not e.is_synced(wid)
    room[0] = 3
    assert e.catch_up(wid) is False  # refused again after 3 revisions
    assert taken == [1, 2, 3, 4, 5]
    room[0] = 100
    assert e.catch_up(wid, budget=1) is False  # one revision per small budget
    assert taken[-1] == 6
    assert e.catch_up(wid) is True and e.is_synced(wid)
    e.put("w/live", b"")
    assert taken == list(range(1, 12))


def test_compaction_past_a_lagging_watcher_cancels_it() -> None:
    e = Engine(FakeClock(), history=5)
    wid = e.add_watcher("c/", True, None, lambda events: False)  # never takes anything
    for i in range(20):
        e.put(f"c/{i}", b"")
    with pytest.raises(RevisionCompacted) as info:
        e.catch_up(wid)
    assert info.value.compact_revision == 16
    assert wid not in e._watchers


def test_a_watch_from_the_past_on_a_key_unchanged_since_is_live_at_once() -> None:
    """A key watch that starts in the past catches up only where its key
    changed since: unchanged (whatever else was written), it is live at once;
    rewritten or deleted since, those events come first."""
    e = Engine(FakeClock())
    e.put("round", b"r0")  # revision 1
    start = e.revision + 1
    for i in range(50):
        e.put(f"join/{i}", b"")  # other keys only
    seen: list[tuple[str, bytes]] = []
    wid = e.add_watcher(
        "round",
        False,
        start,
        lambda evs: seen.extend((ev.type, ev.kv.value) for ev in evs),
        catch_up=False,
    )
    assert e.is_synced(wid) and seen == []
    e.put("round", b"r1")
    assert seen == [("put", b"r1")]
    for change in (lambda: e.put("round", b"r2"), lambda: e.delete("round")):
        start = e.revision + 1
        change()
        e.put("join/x", b"")
        got: list[str] = []
        wid = e.add_watcher("round", False, start, _types_into(got), catch_up=False)
        assert not e.is_synced(wid)
        assert e.catch_up(wid) and got in (["put"], ["delete"])


def _types_into(out: list[str]) -> Callable[[list[WatchEvent]], None]:
    """A watch callback that appends each event's type to ``out``."""
    return lambda events: out.extend(ev.type for ev in events)
