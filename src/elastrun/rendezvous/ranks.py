"""Group-rank assignment for a closed round (pure).

Sticky first: a node keeps its previous group rank when that rank is below the
new group world size and nobody earlier claimed it. Then rank hints
(``--node-rank``) when free and in range. Then the remaining ranks, lowest
first, to the remaining nodes in join order. The result is always a bijection
from the joiners onto ``range(len(joiners))``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Candidate", "assign_ranks"]


@dataclass(frozen=True)
class Candidate:
    node_id: str
    rank_hint: int | None = None


def assign_ranks(
    joiners: Sequence[Candidate], previous: Mapping[str, int] | None = None
) -> dict[str, int]:
    """``joiners`` in join order; ``previous``: node id -> group rank of the
    previous round. Returns node id -> group rank."""
    n = len(joiners)
    previous = previous or {}
    ranks: dict[str, int] = {}
    taken: set[int] = set()
    for cand in joiners:
        rank = previous.get(cand.node_id)
        if rank is not None and 0 <= rank < n and rank not in taken:
            ranks[cand.node_id] = rank
            taken.add(rank)
    for cand in joiners:
        hint = cand.rank_hint
        if cand.node_id in ranks or hint is None:
            continue
        if 0 <= hint < n and hint not in taken:
            ranks[cand.node_id] = hint
            taken.add(hint)
    free = iter(r for r in range(n) if r not in taken)
    for cand in joiners:
        if cand.node_id not in ranks:
            ranks[cand.node_id] = next(free)
    return ranks
