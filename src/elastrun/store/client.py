"""The embedded store's client: :class:`TcpStore`, a :class:`Store` over one
TCP connection to a :class:`~elastrun.store.server.StoreServer`.

* Requests are multiplexed by id; each has an absolute deadline
  (:class:`~elastrun.errors.StoreTimeout` when it passes).
* Watches stream by watch id over the same connection
  (:class:`~elastrun.store.client_watch.TcpWatch`).
* When the connection is lost, the next request reconnects (retrying until its
  deadline) and open watches resume from the revision after the last one they
  delivered, so no event is missed or repeated. If the store restarted without
  its history (a new server id), open watches raise
  :class:`~elastrun.errors.StoreReset`; if it stays unreachable longer than
  ``connect_timeout``, or refuses every reconnection for ``refused_timeout``
  (it is gone), they raise :class:`~elastrun.errors.StoreUnavailable`.
* Leases granted or kept alive through the client are renewed first thing on
  every new connection (:mod:`elastrun.store.client_leases`): the store cuts
  the leases of a lost connection to a short grace. A client holding leases or
  watches reconnects as soon as its connection is lost.
* A write (put, delete, txn, lease grant/revoke) in flight when the connection
  drops raises StoreUnavailable: it may or may not have been applied. Reads
  and keepalives are retried once on the new connection.
* A prefix read larger than the store's answer limit is read in pages
  (consistent: restarted if the store's revision moved between pages).

The connection machinery is :mod:`elastrun.store.client_link`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

from elastrun.clock import remaining
from elastrun.errors import (
    ConfigError,
    LeaseNotFound,
    StoreError,
    StoreTimeout,
    StoreUnavailable,
)
from elastrun.store import codec
from elastrun.store.base import (
    NO_LEASE,
    Compare,
    EmbeddedRevoke,
    KeyValue,
    Op,
    RevokeSpec,
    Store,
    TxnResult,
    Watch,
    newest_created,
)
from elastrun.store.client_link import REFUSED_TIMEOUT, TcpLink
from elastrun.store.client_watch import TcpWatch
from elastrun.store.limits import MAX_TOKEN

__all__ = ["TcpStore", "TcpWatch"]

# A paged prefix read restarts when the store's revision moved between its
# pages (a write in between); after this many tries it gives up.
PAGED_READ_TRIES = 8


class TcpStore(TcpLink, Store):
    """Client of the embedded store. Create with :meth:`connect`."""

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        token: str | None = None,
        timeout: float = 30.0,
        *,
        request_timeout: float = 10.0,
        refused_timeout: float = REFUSED_TIMEOUT,
        hello: dict[str, Any] | None = None,
    ) -> TcpStore:
        """Connect, retrying a refused connection until ``timeout`` (the store
        may still be starting). Raises StoreUnavailable naming host:port, or
        AuthenticationError."""
        if token is not None and len(token.encode("utf-8", "surrogatepass")) > MAX_TOKEN:
            raise ConfigError(f"the store token is longer than {MAX_TOKEN} bytes")
        store = cls(
            host,
            port,
            token=token,
            request_timeout=request_timeout,
            connect_timeout=timeout,
            refused_timeout=refused_timeout,
            hello=hello,
        )
        await store._connected(store.clock.monotonic() + timeout)
        return store

    def describe(self) -> str:
        """For messages: which store (see :mod:`elastrun.store.keepalive`)."""
        return f"the elastrun store at {self.address}"

    def revoke_spec(self, lease: int) -> RevokeSpec | None:
        return EmbeddedRevoke(lease, host=self.host, port=self.port, token=self.token)

    # -- Store -----------------------------------------------------------------
    async def get(self, key: str) -> KeyValue | None:
        answer = await self._request(codec.GetRequest(key), codec.GetAnswer.from_json)
        return answer.kv

    async def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        return await self.get_prefix_paged(prefix)

    async def get_prefix_paged(self, prefix: str, page_keys: int = 0) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix``, read in pages of at most the store's
        answer limit (and ``page_keys`` keys, if > 0), all at one revision: a
        write under the store between two pages restarts the read (bounded)."""
        for _ in range(PAGED_READ_TRIES):
            kvs: list[KeyValue] = []
            after: str | None = None
            revision = -1
            while True:
                answer = await self._request(
                    codec.RangePageRequest(prefix, after, page_keys), codec.RangeAnswer.from_json
                )
                page = answer.kvs
                if revision >= 0 and answer.revision != revision:
                    break  # the store changed between pages: read again
                revision = answer.revision
                kvs += page
                if answer.more is not True or not page:
                    return kvs, revision
                after = page[-1].key
        raise StoreError(
            f"the keys under {prefix!r} kept changing while being read in pages from "
            f"{self.address} ({PAGED_READ_TRIES} tries)"
        )

    async def get_prefix_newest(
        self, prefix: str, max_create_revision: int, limit: int = 1
    ) -> tuple[list[KeyValue], int, int]:
        """Up to ``limit`` keys under ``prefix`` created at or before
        ``max_create_revision``, the most recently created first; how many keys
        are under ``prefix`` in all; and the store's revision of the read. One
        request of O(limit) bytes (a server that predates the option answers
        every key, and the selection is made here)."""
        answer = await self._request(
            codec.RangeNewestRequest(prefix, max_create_revision, limit),
            codec.RangeAnswer.from_json,
        )
        kvs, revision = answer.kvs, answer.revision
        if answer.count is not None:
            return kvs, answer.count, revision
        return newest_created(kvs, max_create_revision, limit), len(kvs), revision

    async def put(self, key: str, value: bytes, lease: int = NO_LEASE) -> int:
        request = codec.PutRequest(key, value, lease)
        return (await self._request(request, codec.RevisionAnswer.from_json)).revision

    async def delete(self, key: str, prefix: bool = False) -> int:
        request = codec.DeleteRequest(key, prefix)
        return (await self._request(request, codec.DeleteAnswer.from_json)).deleted

    async def txn(
        self, compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> TxnResult:
        for compare in compares:
            if isinstance(compare.value, bytes) != (compare.target == "value"):
                needs = "bytes" if compare.target == "value" else "int"
                raise StoreError(f"compare {compare.target} needs {needs}")
        request = codec.TxnRequest(list(compares), list(success), list(failure))
        return await self._request(request, codec.decode_txn_result)

    async def lease_grant(self, ttl: float) -> int:
        request = codec.LeaseGrantRequest(float(ttl))
        lease = (await self._request(request, codec.LeaseGrantAnswer.from_json)).lease
        self._leases.renewed(lease, float(ttl))
        return lease

    async def lease_keepalive(self, lease: int) -> float:
        try:
            answer = await self._request(
                codec.LeaseKeepaliveRequest(lease), codec.LeaseKeepaliveAnswer.from_json
            )
        except LeaseNotFound:
            self._leases.forget(lease)
            raise
        self._leases.renewed(lease, answer.ttl)
        return answer.ttl

    async def lease_revoke(self, lease: int) -> None:
        self._leases.forget(lease)  # never renewed again, whatever the answer
        await self._request(codec.LeaseRevokeRequest(lease), codec.EmptyAnswer.from_json)

    async def watch(
        self, key: str, *, prefix: bool = False, start_revision: int | None = None
    ) -> Watch:
        watch = TcpWatch(self, next(self._ids), key, prefix)
        watch.next_revision = start_revision
        self._watches[watch.watch_id] = watch
        deadline = self.clock.monotonic() + self.request_timeout
        try:
            while True:
                try:
                    await self._establish(watch, deadline)
                    return watch
                except StoreTimeout:
                    raise
                except StoreUnavailable:
                    if remaining(deadline, self.clock) <= 0:
                        raise
        except BaseException:
            self.release_watch(watch)
            watch.closed = True
            raise

    async def compact(self, revision: int) -> None:
        await self._request(codec.CompactRequest(revision), codec.CompactAnswer.from_json)

    async def ping(self, timeout: float | None = None) -> int:
        """Round trip to the store (within ``timeout``, default the request
        timeout); returns its revision."""
        answer = await self._request(
            codec.PingRequest(), codec.RevisionAnswer.from_json, timeout=timeout
        )
        return answer.revision

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for watch in list(self._watches.values()):
            watch.end()
        self._watches.clear()
        self._leases.clear()
        if self._resumer is not None:
            self._resumer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._resumer
        conn = self._conn
        if conn is not None:
            conn.reason = "the client closed the connection"
            self._lost(conn)
            if conn.task is not None:
                conn.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await conn.task
            with contextlib.suppress(OSError):
                await asyncio.wait_for(conn.writer.wait_closed(), 2.0)
