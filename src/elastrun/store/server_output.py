"""The output of one connection of the embedded store's server: the frames
queued for its client, held by reference (:class:`OutputQueue`) and handed
to the transport a chunk at a time (:class:`OutputStream`, which
:class:`~elastrun.store.server_conn.Connection` inherits through
:class:`~elastrun.store.server_watch.WatchStreams`).

Why not the transport's own buffer: it copies what it is given (in
Python 3.11, into one ``bytearray`` per connection), so a watch event of a
1.5 MiB value sent to 300 watchers that do not read became 300 private
copies of 2 MiB; and memory freed in such large blocks is not given back to
the system by the C allocator (its heap is left fragmented). Here an event's
encoded events (the same ``bytes`` object for every watch of a revision, see
:mod:`elastrun.store.server_watch`) are queued by reference and counted once
in the server's output budget (:meth:`~elastrun.store.budgets.OutputBudget.share`);
only a :data:`CHUNK` at a time is copied into the transport, when the kernel
has taken everything before it. A client that does not read makes the server
hold at most one chunk of its own, besides its references.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

from elastrun.store.budgets import OutputBudget
from elastrun.store.limits import StoreLimits

__all__ = ["CHUNK", "OutputQueue", "OutputStream"]

# Bytes handed to the transport at a time (and the most it holds for a
# connection whose client does not read: the kernel holds the rest).
CHUNK = 16 * 1024


class OutputQueue:
    """Bytes queued for one client, not yet handed to its transport, in order.

    A piece appended as ``shared`` may be queued for other connections too:
    it is not copied, and the budget counts it once for all of them until
    the last queue holding it hands it over or is cleared."""

    def __init__(self, budget: OutputBudget[Any]) -> None:
        self._budget = budget
        self._pieces: deque[tuple[bytes, bool]] = deque()
        self._offset = 0  # bytes of the first piece already taken
        self.size = 0  # bytes queued, in all
        self.own = 0  # of them, in pieces that are not shared

    def append(self, data: bytes, shared: bool = False) -> None:
        if not data:
            return
        self._pieces.append((data, shared))
        self.size += len(data)
        if shared:
            self._budget.share(data)
        else:
            self.own += len(data)

    def take(self, limit: int) -> bytes:
        """Up to ``limit`` bytes from the front: a copy, or a whole piece of at
        most ``limit`` bytes (the transport may keep what it is given)."""
        if self._pieces and not self._offset and len(self._pieces[0][0]) <= limit:
            data, shared = self._pieces[0]
            if len(self._pieces) == 1 or len(data) == limit:
                self._pieces.popleft()
                self.size -= len(data)
                if shared:
                    self._budget.unshare(data)
                else:
                    self.own -= len(data)
                return data
        parts: list[memoryview] = []
        taken = 0
        while self._pieces and taken < limit:
            data, shared = self._pieces[0]
            end = min(len(data), self._offset + limit - taken)
            parts.append(memoryview(data)[self._offset : end])
            n = end - self._offset
            taken += n
            self.size -= n
            if not shared:
                self.own -= n
            if end < len(data):
                self._offset = end
                break
            self._pieces.popleft()
            self._offset = 0
            if shared:
                self._budget.unshare(data)
        return b"".join(parts)

    def clear(self) -> None:
        """Drop everything queued (the connection is closed)."""
        for data, shared in self._pieces:
            if shared:
                self._budget.unshare(data)
        self._pieces.clear()
        self._offset = 0
        self.size = self.own = 0


class OutputStream:
    """A connection's output, as the transport takes it (asyncio's
    ``pause_writing`` and ``resume_writing``, with write buffer limits of 0:
    paused as soon as the kernel does not take a whole chunk, resumed once
    it took everything). While more than ``output_high_water`` bytes are
    queued the connection is *backed up* (:meth:`_backed_up`, until it
    drains below a quarter of it: :meth:`_drained`)."""

    limits: StoreLimits
    transport: asyncio.Transport | None
    closing: bool
    lost: bool
    aborted: bool

    def init_output(self, budget: OutputBudget[Any]) -> None:
        self.budget = budget
        # Frames not yet handed to the transport; the transport holds at most
        # a chunk more, until the kernel takes it (``kernel_full`` meanwhile).
        self.out = OutputQueue(budget)
        self.kernel_full = False
        self.close_when_flushed = False
        # Set while backed up: no request is handled (and nothing read), live
        # events are not queued (the watches catch up later).
        self.write_paused = False

    def abort(self, reason: str) -> None:
        raise NotImplementedError

    def _backed_up(self) -> None:
        """More than the high-water mark is queued: requests and live events wait."""
        raise NotImplementedError

    def _drained(self) -> None:
        """The queue drained below a quarter of the high-water mark."""
        raise NotImplementedError

    def pause_writing(self) -> None:
        """The transport holds bytes the kernel did not take: feed it no more."""
        self.kernel_full = True

    def resume_writing(self) -> None:
        """The kernel took everything the transport held: hand it more."""
        self.kernel_full = False
        self._feed()
        if self.write_paused and self.output_size() <= self.limits.output_high_water // 4:
            self._drained()

    def _write(self, data: bytes, shared: bytes = b"", tail: bytes = b"") -> None:
        """Queue a frame: ``data``, then (a watch event) ``shared``, a piece
        queued for other connections too (not copied, counted once), and
        ``tail``."""
        if self.closing or self.transport is None:
            return
        self.budget.observe(self, *self.output_sizes())
        self.budget.make_room(self, len(data) + len(tail) + self.budget.added(shared))
        self.out.append(data)
        self.out.append(shared, shared=True)
        self.out.append(tail)
        self._feed()
        queued = self.output_size()
        if queued > self.limits.max_output_buffer:
            self.abort(f"client too slow: {queued} bytes queued for it")
        elif queued > self.limits.output_high_water and not self.write_paused:
            self._backed_up()

    def _feed(self) -> None:
        """Hand the transport what is queued, a chunk at a time, while the
        kernel takes all of it; close it once flushed if the connection is
        closing (``close_when_flushed``)."""
        transport = self.transport
        if transport is None or self.lost or self.aborted:
            return
        while self.out.size and not self.kernel_full and not transport.is_closing():
            transport.write(self.out.take(CHUNK))
        if self.close_when_flushed and not self.out.size and not transport.is_closing():
            transport.close()
        self.budget.observe(self, *self.output_sizes())

    def output_size(self) -> int:
        """Bytes queued for this client, not yet taken by the kernel."""
        return self.output_sizes()[1]

    def output_sizes(self) -> tuple[int, int]:
        """Bytes queued for this client that are its own (not shared with
        other connections), and all bytes queued for it."""
        if self.transport is None or self.lost:
            return 0, 0
        held = self.transport.get_write_buffer_size()
        return held + self.out.own, held + self.out.size
