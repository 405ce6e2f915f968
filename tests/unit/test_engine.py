"""Pure tests of the store engine (no I/O, fake clock)."""

from __future__ import annotations

import pytest

from elastrun.clock import FakeClock
from elastrun.errors import LeaseNotFound
from elastrun.store.base import Compare, Delete, Get, Put, WatchEvent
from elastrun.store.engine import Engine


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
