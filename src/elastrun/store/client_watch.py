"""The watches of the embedded store's client (:mod:`elastrun.store.client`).

A :class:`TcpWatch` is fed by its client's read loop (events routed by watch
id) and survives reconnects: it tracks the first revision it has not
delivered, including a revision delivered only in part (split frames), so
that the client can re-establish it on a new connection from exactly there,
with nothing missed or repeated. What a watch asks of its client is the
:class:`WatchOwner` protocol (the client, :mod:`elastrun.store.client_link`,
imports this module, never the other way round).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Protocol

from elastrun.store.base import Watch, WatchEvent

if TYPE_CHECKING:
    from elastrun.store.client_conn import Conn

__all__ = ["TcpWatch", "WatchOwner"]


class WatchOwner(Protocol):
    """What a :class:`TcpWatch` needs of the client that feeds it."""

    def release_watch(self, watch: TcpWatch) -> None:
        """Route no more events to ``watch`` (it ended)."""

    def cancel_watch(self, conn: Conn, watch_id: int) -> None:
        """Ask the server to end watch ``watch_id`` on ``conn``, without
        waiting for the answer."""


class TcpWatch(Watch):
    """A watch on the embedded store's client; survives reconnects (see module doc)."""

    def __init__(self, owner: WatchOwner, watch_id: int, key: str, prefix: bool) -> None:
        self._owner = owner
        self.watch_id = watch_id
        self.key = key
        self.prefix = prefix
        self._queue: asyncio.Queue[WatchEvent | BaseException | None] = asyncio.Queue()
        self.closed = False
        self.conn: Conn | None = None  # the connection it is established on
        self.next_revision: int | None = None  # resume point (first revision not yet seen)
        self._partial_rev = 0  # a revision delivered only in part (split frames)
        self._partial_count = 0
        self._skip_rev = 0  # after resuming mid-revision: events already delivered
        self._skip_count = 0

    def resume_revision(self) -> int | None:
        if self._partial_count:
            self._skip_rev, self._skip_count = self._partial_rev, self._partial_count
            self._partial_count = 0
            return self._partial_rev
        return self.next_revision

    def established(self, conn: Conn, revision: int) -> None:
        # Every event up to ``revision`` was delivered (the server sends a
        # watch's history before its response).
        self.conn = conn
        self.next_revision = max(self.next_revision or 0, revision + 1)

    def deliver(self, events: list[WatchEvent], partial: bool) -> None:
        if self.closed:
            return
        for event in events:
            rev = event.kv.mod_revision
            if self._skip_count and rev == self._skip_rev:
                self._skip_count -= 1
                continue
            if self.next_revision is not None and rev < self.next_revision:
                continue  # already delivered before a reconnect
            self._queue.put_nowait(event)
            if partial:
                if rev != self._partial_rev:
                    self._partial_rev, self._partial_count = rev, 0
                self._partial_count += 1
        if events and not partial:
            self.next_revision = events[-1].kv.mod_revision + 1
            self._partial_count = 0
            self._skip_count = 0

    def fail(self, exc: BaseException) -> None:
        if not self.closed:
            self.closed = True
            self._owner.release_watch(self)
            self._queue.put_nowait(exc)

    def end(self) -> None:
        """End the iteration (the client is closing: it released every watch)."""
        self.closed = True
        self._queue.put_nowait(None)

    async def __anext__(self) -> WatchEvent:
        item = await self._queue.get()
        if isinstance(item, WatchEvent):
            return item
        self._queue.put_nowait(item)  # keep ending (or failing) for later calls
        if item is None:
            raise StopAsyncIteration
        raise item

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._owner.release_watch(self)
        self._queue.put_nowait(None)
        conn = self.conn
        if conn is not None and conn.alive:
            # Not waited for: events still in flight for this watch are dropped
            # here (it is no longer registered), and a lost connection ends
            # every watch of it on the server anyway.
            self._owner.cancel_watch(conn, self.watch_id)
