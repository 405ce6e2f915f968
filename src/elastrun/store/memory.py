"""In-memory store: the engine behind an asyncio front-end, for tests and
single-process use. Leases expire on a timer set at the earliest lease
deadline (no polling).

Each watch holds at most ``watch_queue_bytes`` (see
:mod:`elastrun.store.limits`) of events its consumer has not read; past that
it stops taking live events and, as the consumer reads, catches up from the
engine's history (see :mod:`elastrun.store.engine`). If compaction passes it
meanwhile, iterating it raises RevisionCompacted: read, then watch again."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
from collections.abc import Sequence

from elastrun.clock import SYSTEM_CLOCK, Clock, wait_until
from elastrun.errors import RevisionCompacted, StoreError, StoreUnavailable
from elastrun.store.base import NO_LEASE, Compare, KeyValue, Op, Store, TxnResult, Watch, WatchEvent
from elastrun.store.engine import Engine
from elastrun.store.history import event_size

__all__ = ["LeaseReaper", "MemoryStore", "QueueWatch"]


class LeaseReaper:
    """Runs ``engine.expire_leases()`` whenever the earliest lease deadline
    passes. Call :meth:`poke` after anything that may move the deadline: a
    grant, keepalive or revoke, and above all a deadline moved *earlier*
    (:meth:`Engine.lease_owner_gone`), which the sleeping reaper would
    otherwise only notice at the old deadline."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def poke(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        self._wake.set()

    async def _run(self) -> None:
        while True:
            self._engine.expire_leases()
            deadline = self._engine.next_deadline()
            self._wake.clear()
            # (Not asyncio.wait_for: on Python 3.11, cancelling it just as the
            # wake-up lands leaves its inner task's end unheard: a hang.)
            with contextlib.suppress(TimeoutError):
                await wait_until(
                    self._wake.wait(),
                    math.inf if deadline is None else deadline,
                    self._engine.clock,
                )

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


class QueueWatch(Watch):
    """A watch fed by engine callbacks through a queue bounded in bytes."""

    def __init__(self, engine: Engine, max_bytes: int | None = None) -> None:
        self._engine = engine
        self._max_bytes = engine.limits.watch_queue_bytes if max_bytes is None else max_bytes
        self._queue: collections.deque[WatchEvent] = collections.deque()
        self._bytes = 0
        self._ready = asyncio.Event()
        self._error: StoreError | None = None
        self._closed = False
        self.watch_id = 0

    @property
    def queued_bytes(self) -> int:
        return self._bytes

    def feed(self, events: list[WatchEvent]) -> bool:
        """The engine's callback: False (not taken) when the queue is full."""
        if self._closed:
            return True
        if self._queue and self._bytes >= self._max_bytes:
            return False
        for event in events:
            self._queue.append(event)
            self._bytes += event_size(event)
        self._ready.set()
        return True

    def _refill(self) -> None:
        """Catch up from history while there is room (no-op when synced)."""
        if self._closed or self._error is not None:
            return
        try:
            self._engine.catch_up(self.watch_id, max(1, self._max_bytes - self._bytes))
        except RevisionCompacted as exc:
            self._error = exc

    async def __anext__(self) -> WatchEvent:
        while True:
            if self._queue:
                event = self._queue.popleft()
                self._bytes -= event_size(event)
                if self._bytes <= self._max_bytes // 4:
                    self._refill()
                return event
            if self._closed:
                raise StopAsyncIteration
            self._refill()
            if self._queue:
                continue
            if self._error is not None:
                raise self._error  # keeps failing on later calls too
            self._ready.clear()
            await self._ready.wait()

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._engine.remove_watcher(self.watch_id)
            self._queue.clear()
            self._bytes = 0
            self._ready.set()


class MemoryStore(Store):
    def __init__(self, clock: Clock = SYSTEM_CLOCK, engine: Engine | None = None) -> None:
        self.engine = engine if engine is not None else Engine(clock)
        self._reaper: LeaseReaper | None = None
        self._watches: list[QueueWatch] = []
        self._closed = False

    def _check(self) -> Engine:
        if self._closed:
            raise StoreUnavailable("the in-memory store is closed")
        return self.engine

    def _poke(self) -> None:
        if self._reaper is None:
            self._reaper = LeaseReaper(self.engine)
        self._reaper.poke()

    async def get(self, key: str) -> KeyValue | None:
        return self._check().get(key)

    async def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        engine = self._check()
        return engine.range(prefix, prefix=True), engine.revision

    async def get_prefix_newest(
        self, prefix: str, max_create_revision: int, limit: int = 1
    ) -> tuple[list[KeyValue], int, int]:
        engine = self._check()
        kvs, count = engine.range_newest(prefix, max_create_revision, limit)
        return kvs, count, engine.revision

    async def put(self, key: str, value: bytes, lease: int = NO_LEASE) -> int:
        return self._check().put(key, value, lease)

    async def delete(self, key: str, prefix: bool = False) -> int:
        return self._check().delete(key, prefix)

    async def txn(
        self, compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> TxnResult:
        try:
            return self._check().txn(compares, success, failure)
        except TypeError as exc:  # a compare of the wrong type
            raise StoreError(str(exc)) from None

    async def lease_grant(self, ttl: float) -> int:
        try:
            lease = self._check().lease_grant(ttl)
        except ValueError as exc:
            raise StoreError(str(exc)) from None
        self._poke()
        return lease

    async def lease_keepalive(self, lease: int) -> float:
        self._check().expire_leases()  # an expired lease must not be revived
        ttl = self.engine.lease_keepalive(lease)
        self._poke()
        return ttl

    async def lease_revoke(self, lease: int) -> None:
        self._check().lease_revoke(lease)
        self._poke()

    async def watch(
        self, key: str, *, prefix: bool = False, start_revision: int | None = None
    ) -> Watch:
        engine = self._check()
        watch = QueueWatch(engine)
        watch.watch_id = engine.add_watcher(key, prefix, start_revision, watch.feed, catch_up=False)
        watch._refill()
        self._watches.append(watch)
        return watch

    async def compact(self, revision: int) -> None:
        try:
            self._check().compact(revision)
        except ValueError as exc:
            raise StoreError(str(exc)) from None

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for watch in self._watches:
            await watch.close()
        if self._reaper is not None:
            await self._reaper.stop()
