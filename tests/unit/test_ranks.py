"""Group-rank assignment: a bijection; sticky; hints honoured when free.
Worker ranks: global and role ranks as torch's agent gives them."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastrun.rendezvous.ranks import Candidate, assign_ranks, worker_ranks


def test_join_order_without_history() -> None:
    got = assign_ranks([Candidate("a"), Candidate("b"), Candidate("c")])
    assert got == {"a": 0, "b": 1, "c": 2}


def test_node_rank_hint_gets_its_rank() -> None:
    got = assign_ranks([Candidate("a"), Candidate("b", 0), Candidate("c")])
    assert got["b"] == 0 and sorted(got.values()) == [0, 1, 2]


def test_sticky_ranks_when_membership_is_unchanged() -> None:
    prev = {"a": 2, "b": 0, "c": 1}
    got = assign_ranks([Candidate("a"), Candidate("c"), Candidate("b")], prev)
    assert got == prev


def test_sticky_beats_hint_and_out_of_range_ranks_are_refilled() -> None:
    prev = {"a": 0, "b": 3}
    got = assign_ranks([Candidate("b"), Candidate("x", 0), Candidate("a")], prev)
    assert got["a"] == 0  # kept its rank, although x hinted 0
    assert sorted(got.values()) == [0, 1, 2]


ids = st.lists(st.text("abcdef", min_size=1, max_size=3), unique=True, max_size=12)


@given(
    ids,
    st.dictionaries(st.text("abcdef", min_size=1, max_size=3), st.integers(-2, 14)),
    st.lists(st.one_of(st.none(), st.integers(-2, 14)), max_size=12),
)
def test_always_a_bijection_and_sticky_when_possible(
    nodes: list[str], prev: dict[str, int], hints: list[int | None]
) -> None:
    joiners = [Candidate(n, hints[i] if i < len(hints) else None) for i, n in enumerate(nodes)]
    got = assign_ranks(joiners, prev)
    assert set(got) == set(nodes)
    assert sorted(got.values()) == list(range(len(nodes)))
    # A node whose previous rank is in range and unique among joiners keeps it.
    in_range = [n for n in nodes if n in prev and 0 <= prev[n] < len(nodes)]
    for n in in_range:
        if [prev[m] for m in in_range].count(prev[n]) == 1:
            assert got[n] == prev[n]
    # A free, in-range hint is honoured.
    sticky_ranks = {got[n] for n in in_range}
    for c in joiners:
        if c.node_id in in_range or c.rank_hint is None or not 0 <= c.rank_hint < len(nodes):
            continue
        same = [d for d in joiners if d.rank_hint == c.rank_hint and d.node_id not in in_range]
        if c.rank_hint not in sticky_ranks and same[0] is c:
            assert got[c.node_id] == c.rank_hint


# Worker ranks, as torch's agent assigns them (_assign_worker_ranks): global
# ranks in group-rank order, role ranks within each role, per-node nproc.
# Each row: the members' (role, nproc) in group-rank order, and each member's
# (first global rank, first role rank, role world size).
WORKER_RANKS = [
    # torch's launcher test: a master with 1 worker, a trainer with 2
    ([("master", 1), ("trainer", 2)], [(0, 0, 1), (1, 0, 2)]),
    # one role: role ranks are global ranks, the role's size the world's
    ([("r", 2), ("r", 3), ("r", 4)], [(0, 0, 9), (2, 2, 9), (5, 5, 9)]),
    # roles interleaved in group-rank order
    (
        [("t", 2), ("ps", 1), ("t", 3), ("ps", 2), ("t", 1)],
        [(0, 0, 6), (2, 0, 3), (3, 2, 6), (6, 1, 3), (8, 5, 6)],
    ),
    # every node its own role
    ([("a", 4), ("b", 4)], [(0, 0, 4), (4, 0, 4)]),
    # the roles of older versions' results ("": one role)
    ([("", 1), ("", 1)], [(0, 0, 2), (1, 1, 2)]),
    ([("solo", 8)], [(0, 0, 8)]),
    ([], []),
]


@pytest.mark.parametrize(("nodes", "expected"), WORKER_RANKS)
def test_worker_ranks_as_torch_assigns_them(
    nodes: list[tuple[str, int]], expected: list[tuple[int, int, int]]
) -> None:
    got = worker_ranks(nodes)
    assert [(w.rank_base, w.role_base, w.role_size) for w in got] == expected


@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(1, 4)), max_size=12))
def test_every_role_rank_once_and_every_global_rank_once(nodes: list[tuple[str, int]]) -> None:
    got = worker_ranks(nodes)
    world = sum(n for _, n in nodes)
    ranks = [w.rank_base + lr for w, (_, n) in zip(got, nodes, strict=True) for lr in range(n)]
    assert ranks == list(range(world))
    for role in {r for r, _ in nodes}:
        mine = [(w, n) for w, (r, n) in zip(got, nodes, strict=True) if r == role]
        size = sum(n for _, n in mine)
        assert all(w.role_size == size for w, _ in mine)
        assert sorted(w.role_base + lr for w, n in mine for lr in range(n)) == list(range(size))
