"""Bytes the embedded store's server holds for all its connections together.

Two budgets, each a bound from :class:`~elastrun.store.limits.StoreLimits`:

* :class:`InputBudget` (``max_partial_bytes``): bytes received that do not yet
  form a whole frame, or that wait unhandled while the connection's output is
  backed up. Past the budget, the connection whose incomplete frame began
  first is closed, then the next, until the rest fits. A legitimate client
  sends each frame at once, so its frame is the newest; a stranger who holds
  frames half-sent is the oldest and goes first.
* :class:`OutputBudget` (``max_output_bytes``): bytes queued for clients that
  have not read them yet. A piece of output queued for many connections (a
  watch event's encoded events, the same bytes object for every watch of a
  revision: :meth:`OutputBudget.share`) is held once and counted once; the
  rest (each frame's own bytes, what a transport holds) is counted for each
  connection. Before a write that would pass the budget, the queues are
  measured again (clients that read have drained theirs) and, if that is not
  enough, the connections whose output has waited longest without draining
  are closed (their queued bytes are dropped with them, and a shared piece
  once no connection queues it any more), until the write fits. A client
  that reads is never the one that waited longest; one that never reads is.

A connection is anything hashable with ``output_sizes()`` (the bytes it holds
of its own, and all the bytes queued for it, now); closing is the server's
callback. Pure bookkeeping: no sockets.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

__all__ = ["InputBudget", "OutputBudget"]


class _Queued(Protocol):
    def output_sizes(self) -> tuple[int, int]:
        """Bytes queued for it that are its own (not shared), and all bytes queued for it."""
        ...


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
        self._held: dict[Q, int] = {}  # own bytes last seen for each connection holding output
        self._unread: dict[Q, int] = {}  # all bytes queued for it, last seen
        self._since: dict[Q, float] = {}  # when it last drained (or began to hold)
        self._own = 0  # the sum of _held
        # id -> (piece, the queues holding it): pieces queued for several connections.
        self._shared: dict[int, tuple[bytes, int]] = {}
        self.shared = 0  # their bytes, each counted once
        self.peak = 0
        self.evicted = 0

    @property
    def total(self) -> int:
        """Bytes held for clients now: each connection's own, and every shared piece once."""
        return self._own + self.shared

    def observe(self, conn: Q, held: int, unread: int | None = None) -> None:
        """``conn`` holds ``held`` bytes of its own now, and ``unread`` bytes
        (its own and shared ones; default ``held``) are queued for it."""
        unread = held if unread is None else unread
        if unread <= 0:
            self.forget(conn)
            return
        if unread < self._unread.get(conn, 0) or conn not in self._unread:
            self._since[conn] = self._clock()
        self._own += held - self._held.get(conn, 0)
        self._held[conn] = held
        self._unread[conn] = unread
        self.peak = max(self.peak, self.total)

    def share(self, piece: bytes) -> None:
        """One more queue holds ``piece`` (counted once, however many hold it)."""
        key = id(piece)
        entry = self._shared.get(key)
        if entry is None:
            self._shared[key] = (piece, 1)
            self.shared += len(piece)
            self.peak = max(self.peak, self.total)
        else:
            self._shared[key] = (piece, entry[1] + 1)

    def unshare(self, piece: bytes) -> None:
        """A queue that held ``piece`` is done with it."""
        key = id(piece)
        entry = self._shared.get(key)
        if entry is None:
            return
        if entry[1] > 1:
            self._shared[key] = (piece, entry[1] - 1)
        else:
            del self._shared[key]
            self.shared -= len(piece)

    def added(self, piece: bytes) -> int:
        """Bytes the budget grows by when one more queue holds ``piece``."""
        return 0 if id(piece) in self._shared else len(piece)

    def make_room(self, conn: Q, size: int) -> None:
        """Before ``conn`` queues ``size`` more bytes: close the connections
        that waited longest, if the budget has no room otherwise."""
        if self.total + size <= self.limit:
            return
        for other in list(self._held):
            self.observe(other, *other.output_sizes())
        if self.total + size <= self.limit:
            return
        waiting = sorted((c for c in self._held if c is not conn), key=self._since.__getitem__)
        now = self._clock()
        for victim in waiting:
            if self.total + size <= self.limit:
                break
            if victim not in self._held:  # closed meanwhile (by another's closing)
                continue
            unread, since = self._unread[victim], self._since[victim]
            self.forget(victim)
            self.evicted += 1
            self._evict(
                victim,
                f"{unread} bytes queued for it unread for {now - since:.1f} s, the longest "
                f"while the store's output to all clients is at its limit of {self.limit} "
                "bytes (max_output_bytes)",
            )

    def forget(self, conn: Q) -> None:
        """``conn`` holds nothing now (its shared pieces are given back by :meth:`unshare`)."""
        self._own -= self._held.pop(conn, 0)
        self._unread.pop(conn, None)
        self._since.pop(conn, None)
