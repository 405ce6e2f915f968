"""The engine's leases: TTLs, deadlines, owners, and the earliest deadline in O(log n).

Every lease operation (a grant, a keep-alive, a revoke) asks for the leases
whose deadline passed and for the next deadline; with one lease per node, a
scan of every lease there would make each operation O(n) and a round of n
nodes O(n^2). The deadlines are kept in a heap instead: each deadline set
pushes ``(deadline, lease id)``, and an entry whose lease is gone or whose
deadline moved since is dropped when it reaches the top (rebuilt when stale
entries outnumber the live ones), so both questions cost O(log n) amortized.
"""

from __future__ import annotations

import heapq
import itertools
import secrets
from dataclasses import dataclass, field

from elastrun.errors import LeaseNotFound

__all__ = ["Lease", "LeaseTable"]


@dataclass
class Lease:
    ttl: float
    deadline: float
    keys: set[str] = field(default_factory=set)
    owner: object | None = None


class LeaseTable:
    """The live leases by id, their owners, and their deadlines in a heap."""

    def __init__(self) -> None:
        self._leases: dict[int, Lease] = {}
        self._owned: dict[object, set[int]] = {}  # owner -> ids of the leases it owns
        self._heap: list[tuple[float, int]] = []
        self._ids = itertools.count(secrets.randbelow(1 << 40) + 1)

    def __contains__(self, lease_id: int) -> bool:
        return lease_id in self._leases

    def get(self, lease_id: int) -> Lease | None:
        return self._leases.get(lease_id)

    def __getitem__(self, lease_id: int) -> Lease:
        return self._leases[lease_id]

    def grant(self, ttl: float, deadline: float, owner: object | None) -> int:
        lease_id = next(self._ids)
        lease = self._leases[lease_id] = Lease(ttl, deadline)
        self._set_deadline(lease_id, lease, deadline)
        self.set_owner(lease_id, lease, owner)
        return lease_id

    def keepalive(self, lease_id: int, now: float, owner: object | None) -> float:
        """Restore the full TTL; ``owner`` becomes the lease's owner (None: none)."""
        lease = self._leases.get(lease_id)
        if lease is None:
            raise LeaseNotFound(f"lease {lease_id:x} not found (expired or revoked)")
        self._set_deadline(lease_id, lease, now + lease.ttl)
        self.set_owner(lease_id, lease, owner)
        return lease.ttl

    def pop(self, lease_id: int) -> Lease | None:
        """Forget the lease (its heap entries go stale); the lease, or None."""
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            self.set_owner(lease_id, lease, None)
        return lease

    def owner_gone(self, owner: object, grace: float, now: float) -> list[int]:
        """``owner``'s leases expire within ``grace`` or half their TTL,
        whichever is shorter (never later than before), and have no owner."""
        ids = sorted(self._owned.pop(owner, ()))
        for lease_id in ids:
            lease = self._leases[lease_id]
            lease.owner = None
            cutoff = now + max(0.0, min(grace, lease.ttl / 2))
            if cutoff < lease.deadline:
                self._set_deadline(lease_id, lease, cutoff)
        return ids

    def disown(self, owner: object) -> None:
        """Forget ``owner`` without touching deadlines."""
        for lease_id in self._owned.pop(owner, ()):
            self._leases[lease_id].owner = None

    def expired(self, now: float) -> list[int]:
        """The leases whose deadline passed, earliest first (still held: the
        caller revokes them)."""
        out: dict[int, None] = {}
        heap = self._heap
        while heap and heap[0][0] <= now:
            deadline, lease_id = heapq.heappop(heap)
            lease = self._leases.get(lease_id)
            if lease is not None and lease.deadline == deadline:
                out[lease_id] = None
        return list(out)

    def next_deadline(self) -> float | None:
        """The earliest deadline, or None when there are no leases."""
        heap = self._heap
        while heap:
            deadline, lease_id = heap[0]
            lease = self._leases.get(lease_id)
            if lease is not None and lease.deadline == deadline:
                return deadline
            heapq.heappop(heap)  # stale: revoked, or its deadline moved
        return None

    def set_owner(self, lease_id: int, lease: Lease, owner: object | None) -> None:
        if lease.owner is owner:
            return
        if lease.owner is not None:
            owned = self._owned.get(lease.owner)
            if owned is not None:
                owned.discard(lease_id)
                if not owned:
                    del self._owned[lease.owner]
        lease.owner = owner
        if owner is not None:
            self._owned.setdefault(owner, set()).add(lease_id)

    def _set_deadline(self, lease_id: int, lease: Lease, deadline: float) -> None:
        lease.deadline = deadline
        heapq.heappush(self._heap, (deadline, lease_id))
        if len(self._heap) > 2 * len(self._leases) + 64:  # mostly stale: rebuild
            self._heap = [(x.deadline, i) for i, x in self._leases.items()]
            heapq.heapify(self._heap)
