"""Which world sizes a job may form, and who trains in a round (pure).

``--nnodes=MIN:MAX --node-unit=K`` allows the world sizes (in nodes) that are
multiples of K between MIN and MAX. A round forms the largest allowed size the
nodes that joined it reach; the nodes beyond it wait as *spares*: joined the
job, warm, not training. When a training node is lost, the next round takes a
spare in its place (the world keeps its size); without one it shrinks to the
next allowed size, or waits (bounded by the join timeout) for enough nodes.

Who trains (:func:`choose_members`): the previous round's members first, so
that survivors keep training and spares stay spares; among them those whose
previous group rank fits the new size first (they keep it,
:mod:`.ranks`), then in their previous rank order; then the other joiners
in join order. With sticky ranks, a survivor keeps its group rank and a
promoted spare takes a lost member's rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeVar

from elastrun.frozen import frozen

__all__ = ["WorldSizes", "choose_members", "promotions"]

T = TypeVar("T")


@frozen
class WorldSizes:
    """The world sizes (in nodes) a job may form: multiples of ``unit``
    between ``min_nodes`` and ``max_nodes``."""

    min_nodes: int
    max_nodes: int
    unit: int = 1

    @property
    def smallest(self) -> int:
        """The smallest allowed size (0 when none is: see :meth:`problem`)."""
        size = -(-self.min_nodes // self.unit) * self.unit
        return size if size <= self.max_nodes else 0

    @property
    def largest(self) -> int:
        """The largest allowed size (0 when none is: see :meth:`problem`)."""
        size = self.max_nodes // self.unit * self.unit
        return size if size >= self.min_nodes and size > 0 else 0

    def allowed(self, n: int) -> bool:
        return self.min_nodes <= n <= self.max_nodes and n > 0 and n % self.unit == 0

    def fit(self, n: int) -> int:
        """The largest allowed size of at most ``n`` nodes; 0 if none."""
        size = min(n, self.max_nodes) // self.unit * self.unit
        return size if size >= self.min_nodes and size > 0 else 0

    def room(self, members: int, waiting: int) -> bool:
        """Whether ``waiting`` nodes beside a round of ``members`` nodes make a
        larger allowed world (then a new round is worth forming)."""
        return self.fit(members + waiting) > members

    def problem(self) -> str | None:
        """Why no world can ever be formed, naming the flags; None if one can."""
        nnodes = f"--nnodes={self.min_nodes}:{self.max_nodes}"
        if self.unit < 1:
            return (
                f"--node-unit={self.unit} must be at least 1 (world sizes are its multiples "
                f"in {nnodes})"
            )
        if self.unit > self.max_nodes:
            return (
                f"--node-unit={self.unit} is larger than the most nodes {nnodes} allows: "
                "no world could ever be formed"
            )
        if self.smallest == 0:
            return (
                f"no multiple of --node-unit={self.unit} lies between {self.min_nodes} and "
                f"{self.max_nodes} ({nnodes}): no world could ever be formed"
            )
        return None

    def describe(self) -> str:
        """``--nnodes=2:5 --node-unit=2 allows world sizes 2, 4``;
        ``--nnodes=2:3`` for unit 1."""
        text = f"--nnodes={self.min_nodes}:{self.max_nodes}"
        if self.unit == 1:
            return text
        sizes = range(self.smallest, self.largest + 1, self.unit) if self.smallest else range(0)
        shown = ", ".join(str(s) for s in sizes[:8]) + (", ..." if len(sizes) > 8 else "")
        return f"{text} --node-unit={self.unit} allows world sizes {shown or 'none'}"


def choose_members(
    joiners: Sequence[T], node_id: Mapping[int, str], previous: Mapping[str, int], size: int
) -> list[T]:
    """The ``size`` joiners who train, from ``joiners`` in join order
    (``node_id[i]``: joiner i's node id; ``previous``: node id -> group rank
    in the previous round). In the order of the module doc; the result keeps
    join order among the chosen (rank assignment is :mod:`.ranks`')."""

    def key(i: int) -> tuple[int, int, int]:
        rank = previous.get(node_id[i])
        if rank is None:
            return (2, 0, i)
        return (0 if rank < size else 1, rank, i)

    chosen = sorted(sorted(range(len(joiners)), key=key)[:size])
    return [joiners[i] for i in chosen]


def promotions(
    previous: Mapping[str, int], ranks: Mapping[str, int]
) -> list[tuple[str, int, str | None]]:
    """Members of a new round that were not members of the previous one
    (``previous`` and ``ranks``: node id -> group rank), each with its new
    rank and the previous member that held it (None: a new rank, the world
    grew, or its previous holder is still a member). Empty for a first round
    (no previous members)."""
    if not previous:
        return []
    held = {rank: nid for nid, rank in previous.items() if nid not in ranks}
    return sorted(
        ((nid, rank, held.get(rank)) for nid, rank in ranks.items() if nid not in previous),
        key=lambda p: p[1],
    )
