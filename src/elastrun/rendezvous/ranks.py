"""Ranks of a closed round (pure): each node's group rank, then its workers'.

Group ranks (:func:`assign_ranks`). Sticky first: a node keeps its previous
group rank when that rank is below the new group world size and nobody earlier
claimed it. Then rank hints (``--node-rank``) when free and in range. Then the
remaining ranks, lowest first, to the remaining nodes in join order. The
result is always a bijection from the joiners onto ``range(len(joiners))``.

Worker ranks (:func:`worker_ranks`), as torch's agent assigns them
(``SimpleElasticAgent._assign_worker_ranks``): a node's global ranks follow
those of the nodes before it in group-rank order (each node runs its own
number of workers), and its role ranks follow those of the nodes of its role
before it; a role's world size is its nodes' workers, together. Nodes of one
role (every job before roles differed) get role ranks equal to global ranks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from elastrun.frozen import frozen

__all__ = ["Candidate", "WorkerRanks", "assign_ranks", "worker_ranks"]


@frozen
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


@frozen
class WorkerRanks:
    """One node's place among the round's workers: its local rank 0's global
    rank and role rank, and the size of its role (its workers run
    ``rank_base + local_rank``, ``role_base + local_rank``)."""

    rank_base: int
    role_base: int
    role_size: int


def worker_ranks(nodes: Sequence[tuple[str, int]]) -> list[WorkerRanks]:
    """``nodes``: each member's (role, nproc), in group-rank order. Returns
    each member's :class:`WorkerRanks`, in the same order."""
    sizes: dict[str, int] = {}
    for role, nproc in nodes:
        sizes[role] = sizes.get(role, 0) + nproc
    out: list[WorkerRanks] = []
    base = 0
    role_bases: dict[str, int] = {}
    for role, nproc in nodes:
        out.append(WorkerRanks(base, role_bases.get(role, 0), sizes[role]))
        base += nproc
        role_bases[role] = role_bases.get(role, 0) + nproc
    return out
