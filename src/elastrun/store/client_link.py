"""The connection machinery under :class:`~elastrun.store.client.TcpStore`:
connecting and reconnecting, the read loop, requests with deadlines, and
watches re-established after a reconnect.

* Requests are multiplexed by id; each has an absolute deadline
  (:class:`~elastrun.errors.StoreTimeout` when it passes).
* When the connection is lost, the next request reconnects (retrying until its
  deadline) and open watches resume from the revision after the last one they
  delivered. A client holding leases or watches reconnects at once; its held
  leases are renewed first thing on every new connection
  (:mod:`elastrun.store.client_leases`).
* **A store that is gone is reported, not waited for.** Once connected, if
  every reconnection attempt for ``refused_timeout`` (5 s) is refused (nothing
  listens on the port: the process serving the store exited, e.g. the agent
  hosting it was killed), requests and watches fail with StoreUnavailable
  naming the store, instead of retrying until their deadline. A store that
  does not answer at all (host down, partition) is still waited for until the
  deadline, and the first connection is retried until its own (the store may
  still be starting).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import struct
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from elastrun.clock import SYSTEM_CLOCK, Clock, remaining
from elastrun.endpoint import Endpoint
from elastrun.errors import (
    AuthenticationError,
    LeaseNotFound,
    LimitExceeded,
    NotHost,
    ProtocolError,
    RevisionCompacted,
    StoreError,
    StoreReset,
    StoreTimeout,
    StoreUnavailable,
    WatchCancelled,
)
from elastrun.store import codec
from elastrun.store.client_conn import (
    Conn,
    HelloUnanswered,
    close_writer,
    describe_error,
    open_conn,
)
from elastrun.store.client_leases import HeldLeases
from elastrun.store.client_watch import TcpWatch

__all__ = ["REFUSED_TIMEOUT", "TcpLink"]

_ERRORS: dict[str, type[StoreError]] = {
    "lease_not_found": LeaseNotFound,
    "compacted": RevisionCompacted,
    "limit": LimitExceeded,
    "protocol": ProtocolError,
    "auth": AuthenticationError,
}
A = TypeVar("A")
REFUSED_TIMEOUT = 5.0


NOT_A_STORE_AFTER = 3  # hellos unanswered in a row (client_conn.HelloUnanswered)


class StoreGone(StoreUnavailable):
    """Every reconnection was refused for ``refused_timeout``: not retried."""


class TcpLink:
    """One client's connection to the embedded store, kept up (see module doc)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        token: str | None = None,
        request_timeout: float = 10.0,
        connect_timeout: float = 30.0,
        refused_timeout: float = REFUSED_TIMEOUT,
        clock: Clock = SYSTEM_CLOCK,
        hello: dict[str, Any] | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.address = str(Endpoint(host, port))
        self.token = token
        self.request_timeout = request_timeout
        self.connect_timeout = connect_timeout
        self.refused_timeout = refused_timeout
        self.clock = clock
        self.server_id: str | None = None
        self._conn: Conn | None = None
        self._lock = asyncio.Lock()
        self._ids = itertools.count(1)
        self._watches: dict[int, TcpWatch] = {}
        self._leases = HeldLeases(clock)
        self._resumer: asyncio.Task[None] | None = None
        self._refused_since: float | None = None
        self._unanswered = 0  # hellos unanswered in a row (_check_not_a_store)
        self._closed = False
        # A failover store (docs/failover.md): the hello's ``term`` (an older
        # term's host is refused) and ``candidate`` (this node's index).
        self.hello = dict(hello or {})
        self.term = 0
        self.last_heard = clock.monotonic()  # the last bytes from the store
        self.dropped = asyncio.Event()  # set when a connection is lost

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
                except (AuthenticationError, ProtocolError, NotHost):
                    raise
                except (OSError, StoreUnavailable) as exc:
                    self._check_gone(exc)
                    self._check_not_a_store(exc)
                    left = remaining(deadline, self.clock)
                    if left <= delay:
                        why = describe_error(exc)
                        raise StoreUnavailable(
                            f"cannot reach the elastrun store at {self.address}: {why}"
                        ) from None
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 1.0)
            self._refused_since = None
            self._unanswered = 0
            self._conn = conn
            conn.task = asyncio.get_running_loop().create_task(self._read_loop(conn))
            self._leases.renew_on(conn, self._ids)  # before any other request
            return conn
        finally:
            self._lock.release()

    def _check_not_a_store(self, exc: BaseException) -> None:
        """Raise ProtocolError when what listens at the address has failed the
        hello ``NOT_A_STORE_AFTER`` times in a row: silent, or (before this
        client ever reached a store) closing the connection unanswered."""
        self._unanswered = self._unanswered + 1 if isinstance(exc, HelloUnanswered) else 0
        times = self._unanswered
        if not isinstance(exc, HelloUnanswered) or times < NOT_A_STORE_AFTER:
            return
        if not exc.silent and self.server_id is not None:
            return  # a store that served us, closing connections as it stops
        raise ProtocolError(
            f"{exc} ({times} times in a row): that is not an elastrun store. Is the port "
            f"held by another program? Give the job's store a free port (--rdzv-endpoint)"
        )

    def _check_gone(self, exc: BaseException) -> None:
        """Raise StoreGone once reconnections were refused for refused_timeout."""
        if self.server_id is None or not isinstance(exc, ConnectionRefusedError):
            self._refused_since = None  # never connected yet, or not a refusal
            return
        now = self.clock.monotonic()
        if self._refused_since is None:
            self._refused_since = now
        if now - self._refused_since >= self.refused_timeout:
            raise StoreGone(
                f"lost the elastrun store at {self.address}: connection refused for "
                f"{now - self._refused_since:.0f} s, nothing listens there any more "
                "(the process serving the store exited: was the agent hosting it "
                "stopped or killed?)"
            )

    async def _open(self, deadline: float) -> Conn:
        left = remaining(deadline, self.clock)
        if left <= 0:
            raise TimeoutError
        conn, server_id = await open_conn(self.host, self.port, self.token, left, self.hello)
        if conn.term < self.term or conn.term < self.hello.get("term", 0):
            close_writer(conn.writer)
            raise NotHost(
                f"the elastrun store at {self.address} answered for term {conn.term}, "
                f"older than term {max(self.term, self.hello.get('term', 0))}",
                term=conn.term,
            )
        self.term = conn.term
        if self.server_id is not None and server_id != self.server_id:
            lost = StoreReset(
                f"the elastrun store at {self.address} restarted without its data "
                "and history; open watches cannot resume"
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
                self.last_heard = self.clock.monotonic()
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
        elif kind == "cancel":
            watch = self._watches.get(frame.get("watch"))  # type: ignore[arg-type]
            if watch is not None and watch.conn in (conn, None):
                watch.fail(_error_of(frame, f"the store ended the watch on {watch.key!r}"))
        elif kind == "error":
            conn.reason = f"the store closed the connection: {frame.get('message')!s:.300}"

    def _lost(self, conn: Conn) -> None:
        if not conn.alive:
            return
        conn.alive = False
        self.dropped.set()
        close_writer(conn.writer)
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
                if remaining(deadline, self.clock) > 0 and not isinstance(exc, StoreGone):
                    continue
                failure = exc
                if not isinstance(exc, StoreGone):
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
            request = codec.WatchRequest(
                watch.watch_id, watch.key, watch.prefix, watch.resume_revision()
            )
            answer = await self._send(conn, deadline, request, codec.RevisionAnswer.from_json)
        except BaseException:
            watch.conn = None
            raise
        watch.established(conn, answer.revision)

    # -- requests --------------------------------------------------------------
    async def _request(
        self,
        request: codec.Request,
        decode: Callable[[Mapping[str, Any]], A],
        *,
        timeout: float | None = None,
    ) -> A:
        """``request``'s answer, read by ``decode`` (reconnecting first if
        need be; a read is sent again once if the connection was lost)."""
        deadline = self.clock.monotonic() + (self.request_timeout if timeout is None else timeout)
        retried = False
        while True:
            conn = await self._connected(deadline)
            try:
                return await self._send(conn, deadline, request, decode)
            except StoreTimeout:
                raise
            except StoreUnavailable as exc:
                if request.RETRIED and not retried and remaining(deadline, self.clock) > 0:
                    retried = True
                    continue
                if not request.RETRIED:
                    raise StoreUnavailable(
                        f"{exc} (the {request.OP} may or may not have been applied)"
                    ) from None
                raise

    async def _send(
        self,
        conn: Conn,
        deadline: float,
        request: codec.Request,
        decode: Callable[[Mapping[str, Any]], A],
    ) -> A:
        request_id = next(self._ids)
        frame = codec.encode_frame(codec.encode_request(request_id, request))
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        conn.pending[request_id] = future
        try:
            async with asyncio.timeout(remaining(deadline, self.clock)):
                conn.writer.write(frame)
                await conn.writer.drain()
                response = await future
        except TimeoutError:
            raise StoreTimeout(
                f"the elastrun store at {self.address} did not answer a {request.OP} "
                "request in time"
            ) from None
        except OSError as exc:
            why = describe_error(exc)
            raise StoreUnavailable(
                f"lost the connection to the elastrun store at {self.address}: {why}"
            ) from None
        finally:
            conn.pending.pop(request_id, None)
        if response.get("ok") is not True:
            raise _error_of(response.get("error"), f"{request.OP} failed")
        result = response.get("result")
        if not isinstance(result, dict):
            raise ProtocolError(f"malformed {request.OP} response from {self.address}")
        try:
            return decode(result)
        except ProtocolError as exc:
            raise ProtocolError(
                f"malformed {request.OP} response from {self.address}: {exc}"
            ) from None

    def _post(self, conn: Conn, request: codec.Request) -> None:
        """Send a request whose answer nobody waits for (it is ignored)."""
        with contextlib.suppress(OSError, ProtocolError, RuntimeError):
            conn.writer.write(codec.encode_frame(codec.encode_request(next(self._ids), request)))

    def abort(self) -> None:
        """Drop the connection at once, with a reset: nothing queued for the
        store is sent any more (a node that gave the store's host up). The
        client is closed: its requests and watches fail."""
        self._closed = True
        conn = self._conn
        if conn is not None:
            sock = conn.writer.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.reason = "this node gave the store's host up"
            conn.writer.transport.abort()
            self._lost(conn)
        for watch in list(self._watches.values()):
            watch.fail(StoreUnavailable(f"gave up the elastrun store at {self.address}"))

    # -- what a TcpWatch asks of its client (client_watch.WatchOwner) -------------
    def release_watch(self, watch: TcpWatch) -> None:
        self._watches.pop(watch.watch_id, None)

    def cancel_watch(self, conn: Conn, watch_id: int) -> None:
        self._post(conn, codec.WatchCancelRequest(watch_id))


def _error_of(error: Any, fallback: str) -> StoreError:
    """The exception for an error object (``code``, ``message``, ...)."""
    if not isinstance(error, dict):
        return StoreError(fallback)
    code = str(error.get("code"))
    message = str(error.get("message") or f"{fallback} ({code})")
    if code == "compacted":
        revision = error.get("compact_revision")
        return RevisionCompacted(message, revision if type(revision) is int else 0)
    if code == "slow":
        revision = error.get("next_revision")
        return WatchCancelled(message, revision if type(revision) is int else 0)
    return _ERRORS.get(code, StoreError)(message)
