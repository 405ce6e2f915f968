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
  :class:`~elastrun.errors.RevisionCompacted`; if it stays unreachable longer
  than ``connect_timeout``, they raise :class:`~elastrun.errors.StoreUnavailable`.
* Leases granted or kept alive through the client are renewed first thing on
  every new connection (:mod:`elastrun.store.client_leases`): the store cuts
  the leases of a lost connection to a short grace. A client holding leases or
  watches reconnects as soon as its connection is lost.
* A write (put, delete, txn, lease grant/revoke) in flight when the connection
  drops raises StoreUnavailable: it may or may not have been applied. Reads
  and keepalives are retried once on the new connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Sequence
from typing import Any

from elastrun.clock import SYSTEM_CLOCK, Clock, remaining
from elastrun.errors import (
    AuthenticationError,
    LeaseNotFound,
    ProtocolError,
    RevisionCompacted,
    StoreError,
    StoreTimeout,
    StoreUnavailable,
)
from elastrun.store import codec
from elastrun.store.base import (
    NO_LEASE,
    Compare,
    KeyValue,
    Op,
    Store,
    TxnResult,
    Watch,
    newest_created,
)
from elastrun.store.client_conn import Conn, describe_error, fmt_address, open_conn
from elastrun.store.client_leases import HeldLeases
from elastrun.store.client_watch import TcpWatch

__all__ = ["TcpStore", "TcpWatch"]

_ERRORS: dict[str, type[StoreError]] = {
    "lease_not_found": LeaseNotFound,
    "compacted": RevisionCompacted,
    "protocol": ProtocolError,
    "auth": AuthenticationError,
}
_IDEMPOTENT = frozenset({"get", "range", "lease_keepalive", "ping", "watch_cancel"})


class TcpStore(Store):
    """Client of the embedded store. Create with :meth:`connect`."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        token: str | None = None,
        request_timeout: float = 10.0,
        connect_timeout: float = 30.0,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.host = host
        self.port = port
        self.address = fmt_address(host, port)
        self.token = token
        self.request_timeout = request_timeout
        self.connect_timeout = connect_timeout
        self.clock = clock
        self.server_id: str | None = None
        self._conn: Conn | None = None
        self._lock = asyncio.Lock()
        self._ids = itertools.count(1)
        self._watches: dict[int, TcpWatch] = {}
        self._leases = HeldLeases(clock)
        self._resumer: asyncio.Task[None] | None = None
        self._closed = False

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        token: str | None = None,
        timeout: float = 30.0,
        *,
        request_timeout: float = 10.0,
    ) -> TcpStore:
        """Connect, retrying a refused connection until ``timeout`` (the store
        may still be starting). Raises StoreUnavailable naming host:port, or
        AuthenticationError."""
        store = cls(
            host, port, token=token, request_timeout=request_timeout, connect_timeout=timeout
        )
        await store._connected(store.clock.monotonic() + timeout)
        return store

    def describe(self) -> str:
        """For messages: which store (see :mod:`elastrun.store.keepalive`)."""
        return f"the elastrun store at {self.address}"

    # -- connection ------------------------------------------------------------
    async def _connected(self, deadline: float) -> Conn:
        if self._closed:
            raise StoreUnavailable(f"the client of the elastrun store at {self.address} is closed")
        conn = self._conn
        if conn is not None and conn.alive:
            return conn
        # Another task may be reconnecting (holding the lock): wait for it
        # no longer than this request's own deadline.
        try:
            async with asyncio.timeout(max(0.0, remaining(deadline, self.clock))):
                await self._lock.acquire()
        except TimeoutError:
            raise StoreUnavailable(
                f"cannot reach the elastrun store at {self.address}: still reconnecting"
            ) from None
        try:
            conn = self._conn
            if conn is not None and conn.alive:
                return conn
            delay = 0.05
            while True:
                try:
                    conn = await self._open(deadline)
                    break
                except (AuthenticationError, ProtocolError):
                    raise
                except (OSError, StoreUnavailable) as exc:
                    left = remaining(deadline, self.clock)
                    if left <= delay:
                        why = describe_error(exc)
                        raise StoreUnavailable(
                            f"cannot reach the elastrun store at {self.address}: {why}"
                        ) from None
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 1.0)
            self._conn = conn
            conn.task = asyncio.get_running_loop().create_task(self._read_loop(conn))
            self._leases.renew_on(conn, self._ids)  # before any other request
            return conn
        finally:
            self._lock.release()

    async def _open(self, deadline: float) -> Conn:
        left = remaining(deadline, self.clock)
        if left <= 0:
            raise TimeoutError
        conn, server_id = await open_conn(self.host, self.port, self.token, left)
        if self.server_id is not None and server_id != self.server_id:
            lost = RevisionCompacted(
                f"the elastrun store at {self.address} restarted without its history; "
                "open watches cannot resume (read the current state and watch again)"
            )
            for watch in list(self._watches.values()):
                watch.fail(lost)
        self.server_id = server_id
        return conn

    async def _read_loop(self, conn: Conn) -> None:
        decoder = conn.decoder
        try:
            while True:
                while (frame := decoder.pop()) is not None:
                    self._dispatch(conn, frame)
                data = await conn.reader.read(65536)
                if not data:
                    break
                decoder.push(data)
        except ProtocolError as exc:
            conn.reason = f"protocol error: {exc}"
        except (OSError, EOFError) as exc:
            conn.reason = describe_error(exc)
        finally:
            self._lost(conn)

    def _dispatch(self, conn: Conn, frame: dict[str, Any]) -> None:
        kind = frame.get("t")
        if kind == "resp":
            future = conn.pending.pop(frame.get("id"), None)  # type: ignore[arg-type]
            if future is not None and not future.done():
                future.set_result(frame)
        elif kind == "events":
            watch = self._watches.get(frame.get("watch"))  # type: ignore[arg-type]
            if watch is not None and watch.conn in (conn, None):
                raw = frame.get("events")
                if not isinstance(raw, list):
                    raise ProtocolError("'events' must be a list")
                events = [codec.decode_event(e) for e in raw]
                watch.deliver(events, frame.get("partial") is True)
        elif kind == "error":
            conn.reason = f"the store closed the connection: {frame.get('message')!s:.300}"

    def _lost(self, conn: Conn) -> None:
        if not conn.alive:
            return
        conn.alive = False
        conn.writer.close()
        if self._conn is conn:
            self._conn = None
        error = StoreUnavailable(
            f"lost the connection to the elastrun store at {self.address}: {conn.reason}"
        )
        for future in conn.pending.values():
            if not future.done():
                future.set_exception(error)
        conn.pending.clear()
        held = self._watches or self._leases
        if held and not self._closed and (self._resumer is None or self._resumer.done()):
            self._resumer = asyncio.get_running_loop().create_task(self._resume())

    async def _resume(self) -> None:
        """Reconnect at once (which renews held leases), then re-establish open
        watches on the new connection (bounded)."""
        deadline = self.clock.monotonic() + self.connect_timeout
        if not self._watches:
            with contextlib.suppress(StoreError):  # the next request reports it
                await self._connected(deadline)
            return
        while not self._closed:
            todo = [w for w in self._watches.values() if w.conn is None or not w.conn.alive]
            if not todo:
                return
            try:
                for watch in todo:
                    if not watch.closed:
                        await self._establish(watch, deadline)
            except StoreUnavailable as exc:
                if remaining(deadline, self.clock) > 0:
                    continue
                failure = StoreUnavailable(
                    f"watch on {watch.key!r} lost the elastrun store at {self.address} "
                    f"and could not resume: {exc}"
                )
                for w in list(self._watches.values()):
                    w.fail(failure)
                return
            except StoreError as exc:  # compacted, auth, protocol
                watch.fail(exc)

    async def _establish(self, watch: TcpWatch, deadline: float) -> None:
        conn = await self._connected(deadline)
        watch.conn = conn  # route events of this connection to it from now on
        try:
            result = await self._send(
                conn,
                deadline,
                "watch",
                watch=watch.watch_id,
                key=watch.key,
                prefix=watch.prefix,
                start_revision=watch.resume_revision(),
            )
        except BaseException:
            watch.conn = None
            raise
        watch.established(conn, codec.expect_int(result, "revision"))

    # -- requests --------------------------------------------------------------
    async def _request(self, op: str, *, timeout: float | None = None, **args: Any) -> Any:
        deadline = self.clock.monotonic() + (self.request_timeout if timeout is None else timeout)
        retried = False
        while True:
            conn = await self._connected(deadline)
            try:
                return await self._send(conn, deadline, op, **args)
            except StoreTimeout:
                raise
            except StoreUnavailable as exc:
                if op in _IDEMPOTENT and not retried and remaining(deadline, self.clock) > 0:
                    retried = True
                    continue
                if op not in _IDEMPOTENT:
                    raise StoreUnavailable(
                        f"{exc} (the {op} may or may not have been applied)"
                    ) from None
                raise

    async def _send(self, conn: Conn, deadline: float, op: str, **args: Any) -> Any:
        request_id = next(self._ids)
        frame = codec.encode_frame(codec.encode_request(request_id, op, **args))
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        conn.pending[request_id] = future
        try:
            async with asyncio.timeout(remaining(deadline, self.clock)):
                conn.writer.write(frame)
                await conn.writer.drain()
                response = await future
        except TimeoutError:
            raise StoreTimeout(
                f"the elastrun store at {self.address} did not answer a {op} request in time"
            ) from None
        except OSError as exc:
            why = describe_error(exc)
            raise StoreUnavailable(
                f"lost the connection to the elastrun store at {self.address}: {why}"
            ) from None
        finally:
            conn.pending.pop(request_id, None)
        if response.get("ok") is True:
            result = response.get("result")
            if not isinstance(result, dict):
                raise ProtocolError(f"malformed {op} response from {self.address}")
            return result
        error = response.get("error")
        code = error.get("code") if isinstance(error, dict) else None
        message = error.get("message") if isinstance(error, dict) else None
        raise _ERRORS.get(str(code), StoreError)(str(message or f"{op} failed ({code})"))

    def _post(self, conn: Conn, op: str, **args: Any) -> None:
        """Send a request whose answer nobody waits for (it is ignored)."""
        with contextlib.suppress(OSError, ProtocolError, RuntimeError):
            conn.writer.write(codec.encode_frame(codec.encode_request(next(self._ids), op, **args)))

    def _forget(self, watch: TcpWatch) -> None:
        self._watches.pop(watch.watch_id, None)

    # -- Store -----------------------------------------------------------------
    async def get(self, key: str) -> KeyValue | None:
        result = await self._request("get", key=key)
        raw = result.get("kv")
        return None if raw is None else codec.decode_kv(raw)

    async def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        result = await self._request("range", key=prefix)
        raw = result.get("kvs")
        if not isinstance(raw, list):
            raise ProtocolError(f"malformed range response from {self.address}")
        return [codec.decode_kv(kv) for kv in raw], codec.expect_int(result, "revision")

    async def get_prefix_newest(
        self, prefix: str, max_create_revision: int, limit: int = 1
    ) -> tuple[list[KeyValue], int, int]:
        """Up to ``limit`` keys under ``prefix`` created at or before
        ``max_create_revision``, the most recently created first; how many keys
        are under ``prefix`` in all; and the store's revision of the read. One
        request of O(limit) bytes (a server that predates the option answers
        every key, and the selection is made here)."""
        result = await self._request(
            "range", key=prefix, max_create=max_create_revision, limit=limit
        )
        raw = result.get("kvs")
        if not isinstance(raw, list):
            raise ProtocolError(f"malformed range response from {self.address}")
        kvs = [codec.decode_kv(kv) for kv in raw]
        revision = codec.expect_int(result, "revision")
        if "count" in result:
            return kvs, codec.expect_int(result, "count"), revision
        return newest_created(kvs, max_create_revision, limit), len(kvs), revision

    async def put(self, key: str, value: bytes, lease: int = NO_LEASE) -> int:
        result = await self._request("put", key=key, value=codec.b64(value), lease=lease)
        return codec.expect_int(result, "revision")

    async def delete(self, key: str, prefix: bool = False) -> int:
        result = await self._request("delete", key=key, prefix=prefix)
        return codec.expect_int(result, "deleted")

    async def txn(
        self, compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> TxnResult:
        for compare in compares:
            if isinstance(compare.value, bytes) != (compare.target == "value"):
                needs = "bytes" if compare.target == "value" else "int"
                raise StoreError(f"compare {compare.target} needs {needs}")
        result = await self._request(
            "txn",
            compares=[codec.encode_compare(c) for c in compares],
            success=[codec.encode_op(o) for o in success],
            failure=[codec.encode_op(o) for o in failure],
        )
        return codec.decode_txn_result(result)

    async def lease_grant(self, ttl: float) -> int:
        result = await self._request("lease_grant", ttl=float(ttl))
        lease = codec.expect_int(result, "lease", minimum=1)
        self._leases.renewed(lease, float(ttl))
        return lease

    async def lease_keepalive(self, lease: int) -> float:
        try:
            result = await self._request("lease_keepalive", lease=lease)
        except LeaseNotFound:
            self._leases.forget(lease)
            raise
        ttl = result.get("ttl")
        if type(ttl) not in (int, float):
            raise ProtocolError(f"malformed lease_keepalive response from {self.address}")
        self._leases.renewed(lease, float(ttl))
        return float(ttl)

    async def lease_revoke(self, lease: int) -> None:
        self._leases.forget(lease)  # never renewed again, whatever the answer
        await self._request("lease_revoke", lease=lease)

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
            self._forget(watch)
            watch.closed = True
            raise

    async def ping(self) -> int:
        """Round trip to the store; returns its revision."""
        return codec.expect_int(await self._request("ping"), "revision")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for watch in list(self._watches.values()):
            watch.closed = True
            watch._queue.put_nowait(None)
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
