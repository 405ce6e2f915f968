"""Bytes the embedded store's server holds for all its connections together.

Two budgets, each a bound from :class:`~elastrun.store.limits.StoreLimits`:

* :class:`InputBudget` (``max_partial_bytes``): bytes received that do not yet
  form a whole frame, or that wait unhandled while the connection's output is
  backed up. Past the budget, the connection whose incomplete frame began
  first is closed, then the next, until the rest fits. A legitimate client
  sends each frame at once, so its frame is the newest; a stranger who holds
  frames half-sent is the oldest and goes first.
* :class:`OutputBudget` (``max_output_bytes``): bytes queued for clients that
  have not read them yet. Before a write that would pass the budget, the
  queues are measured again (clients that read have drained theirs) and, if
  that is not enough, the connections whose output has waited longest
  without draining are closed (their queued bytes are dropped with them),
  until the write fits. A client that reads is never the one that waited
  longest; one that never reads is.

A connection is anything hashable with ``output_size()`` (bytes its transport
holds now); closing is the server's callback. Pure bookkeeping: no sockets.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

__all__ = ["InputBudget", "OutputBudget"]


class _Queued(Protocol):
    def output_size(self) -> int: ...


C = TypeVar("C")
Q = TypeVar("Q", bound=_Queued)


class InputBudget(Generic[C]):
    """Bytes held in incomplete frames, in all; see the module docstring."""

    def __init__(self, limit: int, evict: Callable[[C, str], None]) -> None:
        self.limit = limit
        self._evict = evict
        # Connection -> bytes it holds; in the order its current frame began.
        self._held: dict[C, int] = {}
        self.total = 0
        self.peak = 0
        self.evicted = 0  # connections closed to stay within the budget

    def update(self, conn: C, held: int, new_frame: bool) -> None:
        """``conn`` now holds ``held`` bytes; ``new_frame``: the frame they
        begin is not the one it held before (it completed one since)."""
        old = self._held.pop(conn, 0) if new_frame or not held else self._held.get(conn, 0)
        self.total += held - old
        if held:
            self._held[conn] = held
        self.peak = max(self.peak, self.total)
        while self.total > self.limit and self._held:
            victim = next(iter(self._held))
            self.forget(victim)
            self.evicted += 1
            self._evict(
                victim,
                f"the store holds {self.limit} bytes of incomplete frames from all "
                "connections (max_partial_bytes) and this connection's frame is the oldest",
            )

    def forget(self, conn: C) -> None:
        self.total -= self._held.pop(conn, 0)


class OutputBudget(Generic[Q]):
    """Bytes queued for clients, in all; see the module docstring."""

    def __init__(
        self,
        limit: int,
        evict: Callable[[Q, str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = limit
        self._evict = evict
        self._clock = clock
        self._held: dict[Q, int] = {}  # last size seen for each connection holding output
        self._since: dict[Q, float] = {}  # when it last drained (or began to hold)
        self.total = 0
        self.peak = 0
        self.evicted = 0

    def observe(self, conn: Q, size: int) -> None:
        """``conn``'s transport holds ``size`` bytes now."""
        old = self._held.get(conn, 0)
        if size <= 0:
            self.forget(conn)
            return
        if size < old or not old:
            self._since[conn] = self._clock()
        self.total += size - old
        self._held[conn] = size
        self.peak = max(self.peak, self.total)

    def make_room(self, conn: Q, size: int) -> None:
        """Before ``conn`` queues ``size`` more bytes: close the connections
        that waited longest, if the budget has no room otherwise."""
        if self.total + size <= self.limit:
            return
        for other in list(self._held):
            self.observe(other, other.output_size())
        if self.total + size <= self.limit:
            return
        waiting = sorted((c for c in self._held if c is not conn), key=self._since.__getitem__)
        now = self._clock()
        for victim in waiting:
            if self.total + size <= self.limit:
                break
            held, since = self._held[victim], self._since[victim]
            self.forget(victim)
            self.evicted += 1
            self._evict(
                victim,
                f"{held} bytes queued for it unread for {now - since:.1f} s, the longest "
                f"while the store's output to all clients is at its limit of {self.limit} "
                "bytes (max_output_bytes)",
            )

    def forget(self, conn: Q) -> None:
        self.total -= self._held.pop(conn, 0)
        self._since.pop(conn, None)
