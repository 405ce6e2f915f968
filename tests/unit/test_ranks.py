"""Group-rank assignment: a bijection; sticky; hints honoured when free."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from elastrun.rendezvous.ranks import Candidate, assign_ranks


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
