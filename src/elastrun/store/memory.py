"""In-memory store: the engine behind an asyncio front-end, for tests and
single-process use. Leases expire on a timer set at the earliest lease
deadline (no polling)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from elastrun.clock import SYSTEM_CLOCK, Clock
from elastrun.errors import StoreError, StoreUnavailable
from elastrun.store.base import NO_LEASE, Compare, KeyValue, Op, Store, TxnResult, Watch, WatchEvent
from elastrun.store.engine import Engine

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
            timeout = None if deadline is None else deadline - self._engine.clock.monotonic()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


class QueueWatch(Watch):
    """A watch fed by engine callbacks through an unbounded queue."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._queue: asyncio.Queue[WatchEvent | None] = asyncio.Queue()
        self._closed = False
        self.watch_id = 0

    def feed(self, events: list[WatchEvent]) -> None:
        for event in events:
            self._queue.put_nowait(event)

    async def __anext__(self) -> WatchEvent:
        if self._closed and self._queue.empty():
            raise StopAsyncIteration
        event = await self._queue.get()
        if event is None:
            raise StopAsyncIteration
        return event

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._engine.remove_watcher(self.watch_id)
            self._queue.put_nowait(None)


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
        watch.watch_id = engine.add_watcher(key, prefix, start_revision, watch.feed)
        self._watches.append(watch)
        return watch

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for watch in self._watches:
            await watch.close()
        if self._reaper is not None:
            await self._reaper.stop()
