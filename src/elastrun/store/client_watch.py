"""The watches of the embedded store's client (:mod:`elastrun.store.client`).

A :class:`TcpWatch` is fed by its :class:`~elastrun.store.client.TcpStore`'s
read loop (events routed by watch id) and survives reconnects: it tracks the
first revision it has not delivered, including a revision delivered only in
part (split frames), so that the store can re-establish it on a new
connection from exactly there, with nothing missed or repeated.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from elastrun.store.base import Watch, WatchEvent

if TYPE_CHECKING:
    from elastrun.store.client import TcpStore
    from elastrun.store.client_conn import Conn

__all__ = ["TcpWatch"]


class TcpWatch(Watch):
    """A watch on a :class:`TcpStore`; survives reconnects (see module doc)."""

    def __init__(self, store: TcpStore, watch_id: int, key: str, prefix: bool) -> None:
        self._store = store
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
            self._store._forget(self)
            self._queue.put_nowait(exc)

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
        self._store._forget(self)
        self._queue.put_nowait(None)
        conn = self.conn
        if conn is not None and conn.alive:
            # Not waited for: events still in flight for this watch are dropped
            # here (it is no longer registered), and a lost connection ends
            # every watch of it on the server anyway.
            self._store._post(conn, "watch_cancel", watch=self.watch_id)
