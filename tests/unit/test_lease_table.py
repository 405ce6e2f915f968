"""The engine's lease table: expiry in deadline order, deadlines that move,
owners that go, and a heap that stays bounded however often leases are kept
alive."""

from __future__ import annotations

import pytest

from elastrun.errors import LeaseNotFound
from elastrun.store.lease_table import LeaseTable


def test_leases_expire_in_deadline_order_and_a_kept_alive_one_later() -> None:
    t = LeaseTable()
    a = t.grant(10.0, 10.0, owner=None)
    b = t.grant(5.0, 5.0, owner=None)
    c = t.grant(7.0, 7.0, owner=None)
    assert t.next_deadline() == 5.0
    assert t.keepalive(b, now=4.0, owner=None) == 5.0  # b: 9.0 now
    assert t.next_deadline() == 7.0
    assert t.expired(8.0) == [c]  # b's old deadline 5.0 is stale, not expired
    t.pop(c)
    assert t.expired(9.5) == [b]
    t.pop(b)
    assert t.next_deadline() == 10.0 and t.expired(9.9) == []
    t.pop(a)
    assert t.next_deadline() is None and t.expired(1e9) == []
    with pytest.raises(LeaseNotFound):
        t.keepalive(a, now=0.0, owner=None)


def test_an_owner_gone_shortens_its_leases_only() -> None:
    t = LeaseTable()
    conn, other = object(), object()
    mine = t.grant(10.0, 10.0, owner=conn)
    theirs = t.grant(10.0, 10.0, owner=other)
    assert t.owner_gone(conn, grace=2.0, now=1.0) == [mine]
    assert t[mine].owner is None and t[theirs].owner is other
    assert t.next_deadline() == 3.0
    assert t.expired(3.0) == [mine]
    # A grace past the deadline never extends it.
    late = t.grant(1.0, 2.0, owner=conn)
    t.owner_gone(conn, grace=5.0, now=1.9)
    assert t[late].deadline == 2.0


def test_the_heap_stays_bounded_under_keepalives() -> None:
    t = LeaseTable()
    ids = [t.grant(10.0, 10.0, owner=None) for _ in range(100)]
    for step in range(1, 200):
        for lease_id in ids:
            t.keepalive(lease_id, now=float(step), owner=None)
    assert len(t._heap) <= 2 * 100 + 64
    assert t.next_deadline() == 199.0 + 10.0
    assert sorted(t.expired(209.0)) == sorted(ids)
