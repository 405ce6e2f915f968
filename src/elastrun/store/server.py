"""The embedded store's TCP server: the :class:`~elastrun.store.engine.Engine`
behind the wire protocol of :mod:`elastrun.store.codec`.

Runs inside an agent's event loop (the agent hosting the store) or on its own
(``elastrun store serve``). Leases expire on a timer (as in etcd), with one
addition, the *grace on disconnect*: each lease remembers the connection that
granted it or last kept it alive (its owner). When that connection ends (end
of file, reset, or closed by the server), the lease's deadline is cut to at
most :data:`DISCONNECT_GRACE` from then. A client process that dies has its
socket closed by the kernel, so its keys vanish within the grace instead of
the whole TTL; a live client that lost its connection reconnects and renews
its leases at once (see :mod:`elastrun.store.client`), well within the grace.
A keepalive from any connection restores the full TTL and makes that
connection the owner. A peer that vanishes without a FIN or reset (network
partition, powered-off host) still loses its leases only at the TTL. Leases
of an engine handed over from a stopped server have no owner (plain TTL)
until they are kept alive again.

A connection that misbehaves is closed and nothing else is affected: a first
frame that is not a valid hello (or none within ``hello_timeout``), a wrong or
missing token, bytes that are not frames, a frame over the size limit, or a
reader so slow that more than ``max_output_buffer`` bytes queue up for it.

Responses are flow-controlled: while more than half of ``max_output_buffer``
is queued for a connection, the server reads no further requests from it (a
client with many large reads in flight waits; it is not "too slow"). Only
watch events, which the client does not ask for one by one, can push a
connection past the limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import logging
import socket
from collections.abc import Mapping
from typing import Any

from elastrun.errors import (
    ConfigError,
    LeaseNotFound,
    ProtocolError,
    RevisionCompacted,
    StoreError,
)
from elastrun.store import codec
from elastrun.store.base import WatchEvent
from elastrun.store.engine import Engine
from elastrun.store.memory import LeaseReaper

__all__ = ["DEFAULT_PORT", "DISCONNECT_GRACE", "StoreServer"]

log = logging.getLogger(__name__)

DEFAULT_PORT = 29400
# Seconds a lease outlives the end of its owner's connection (never more than
# its TTL left). Long enough for a live client to notice the lost connection,
# reconnect (its first retries come within 0.05 + 0.1 + 0.2 + 0.4 s) and
# renew; short enough that a killed node is seen gone in about 2 s rather than
# after its lease TTL (10 s by default). See docs/store-protocol.md.
DISCONNECT_GRACE = 2.0
_READ_LIMIT_HINT = 64 * 1024


class StoreServer:
    """``server = StoreServer("127.0.0.1", 0, token="s3cret")``;
    ``host, port = await server.start()``; ...; ``await server.stop()``."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        engine: Engine | None = None,
        *,
        hello_timeout: float = 10.0,
        max_output_buffer: int = 16 * 1024 * 1024,
        max_frame: int = codec.MAX_FRAME,
        disconnect_grace: float = DISCONNECT_GRACE,
    ) -> None:
        self.host = host
        self.port = port
        self.token = token or None
        self.engine = engine if engine is not None else Engine()
        self.hello_timeout = hello_timeout
        self.max_output_buffer = max_output_buffer
        self.max_frame = max_frame
        self.disconnect_grace = disconnect_grace
        self._server: asyncio.Server | None = None
        self._reaper: LeaseReaper | None = None
        self._connections: set[_Connection] = set()
        self.address: tuple[str, int] | None = None

    @property
    def connection_count(self) -> int:
        return len(self._connections)

    async def start(self) -> tuple[str, int]:
        """Listen; returns the (host, port) actually bound (port 0: a free one)."""
        if self._server is not None:
            raise RuntimeError("StoreServer already started")
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(
                lambda: _Connection(self), self.host, self.port, reuse_address=True
            )
        except socket.gaierror as exc:
            raise ConfigError(f"cannot listen on {self.host!r}: {exc.strerror}") from None
        except OSError as exc:
            where = _fmt(self.host, self.port)
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"cannot listen on {where}: the port is already in use by another "
                    "program (check with `ss -ltnp`); choose another port or use port 0"
                ) from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise ConfigError(
                    f"cannot listen on {where}: {self.host} is not an address of this machine"
                ) from None
            raise StoreError(f"cannot listen on {where}: {exc.strerror or exc}") from None
        sockname = self._server.sockets[0].getsockname()
        self.address = (str(sockname[0]), int(sockname[1]))
        self._reaper = LeaseReaper(self.engine)
        self._reaper.poke()  # an engine handed over from a previous server may hold leases
        log.info("elastrun store listening on %s", _fmt(*self.address))
        return self.address

    async def stop(self) -> None:
        """Stop listening and drop every connection. The engine (keys, leases,
        history) stays intact: a new server on the same engine continues it.
        Its leases keep their deadlines (no grace: the clients did not go
        away) and lose their owners (this server's connections)."""
        if self._server is not None:
            self._server.close()
        for conn in self._connections:
            self.engine.lease_disown(conn)
        self.disconnect_all()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5.0)
            self._server = None
        if self._reaper is not None:
            await self._reaper.stop()
            self._reaper = None

    def disconnect_all(self) -> None:
        """Drop every client connection (clients reconnect and renew their
        leases within the grace; tests, failover drills)."""
        for conn in list(self._connections):
            conn.abort("server dropped the connection")

    async def __aenter__(self) -> StoreServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    # -- used by connections --------------------------------------------------
    def _poke_reaper(self) -> None:
        if self._reaper is not None:
            self._reaper.poke()


def _fmt(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


_ERROR_CODES: Mapping[type[Exception], str] = {
    LeaseNotFound: "lease_not_found",
    RevisionCompacted: "compacted",
    ProtocolError: "protocol",
    ValueError: "invalid",
    TypeError: "invalid",
}


class _Connection(asyncio.Protocol):
    def __init__(self, server: StoreServer) -> None:
        self.server = server
        self.engine = server.engine
        self.decoder = codec.FrameDecoder(server.max_frame)
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self.authenticated = False
        self.closing = False
        self.watches: dict[int, int] = {}  # client's watch id -> engine watcher id
        # Output may queue up to ``allowance`` bytes: max_output_buffer, plus the
        # size of a watch's history replay until the queue drains again.
        self.allowance = server.max_output_buffer
        self.replaying = False
        # Set while the transport's buffer is above its high-water mark: no
        # request is handled (and nothing read) until it drains.
        self.write_paused = False
        self.reading_paused = False
        self._hello_timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol ------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.peer = _fmt(str(peer[0]), int(peer[1])) if peer else "?"
        high = max(1, self.server.max_output_buffer // 2)
        transport.set_write_buffer_limits(high=high, low=high // 4)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        self.server._connections.add(self)
        loop = asyncio.get_running_loop()
        self._hello_timer = loop.call_later(self.server.hello_timeout, self._hello_expired)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        for watcher in self.watches.values():
            self.engine.remove_watcher(watcher)
        self.watches.clear()
        self.server._connections.discard(self)
        # The owner of these leases is gone: a dead process's kernel closes its
        # socket, so they expire within the grace unless renewed (reconnect).
        gone = self.engine.lease_owner_gone(self, self.server.disconnect_grace)
        if gone:
            log.info(
                "store connection %s ended: %d lease(s) expire within %g s unless renewed",
                self.peer,
                len(gone),
                self.server.disconnect_grace,
            )
            self.server._poke_reaper()  # a deadline moved earlier

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        self.decoder.push(data)
        self._handle_frames()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.reading_paused and not self.closing and self.transport is not None:
            self.reading_paused = False
            self.transport.resume_reading()
            self._handle_frames()

    def _handle_frames(self) -> None:
        while self.transport is not None and not self.transport.is_closing():
            if self.write_paused:
                # Backpressure: the rest waits (in the decoder) until the
                # client has read what is queued for it (resume_writing).
                if not self.reading_paused:
                    self.reading_paused = True
                    self.transport.pause_reading()
                return
            try:
                frame = self.decoder.pop()
            except ProtocolError as exc:
                self.fail("protocol", str(exc))
                return
            if frame is None:
                return
            try:
                self._handle(frame)
            except Exception as exc:  # never let one connection take the server down
                log.exception("store connection %s: internal error", self.peer)
                self.fail("internal", f"internal server error: {type(exc).__name__}")

    def eof_received(self) -> bool | None:
        return None  # close our side too

    # -- closing ---------------------------------------------------------------
    def fail(self, code: str, message: str) -> None:
        """Tell the peer why (best effort), then close after flushing."""
        if self.closing or self.transport is None:
            return
        log.info("store connection %s closed: %s", self.peer, message)
        with contextlib.suppress(ProtocolError):
            self.transport.write(codec.encode_frame(codec.encode_error(code, message)))
        self.closing = True
        self.transport.close()

    def abort(self, reason: str) -> None:
        """Close at once, discarding queued output."""
        if self.transport is None or self.transport.is_closing():
            return
        log.info("store connection %s dropped: %s", self.peer, reason)
        self.closing = True
        self.transport.abort()

    def _hello_expired(self) -> None:
        if not self.authenticated:
            self.fail("protocol", f"no hello within {self.server.hello_timeout:g} s")

    # -- output ----------------------------------------------------------------
    def send(self, message: Mapping[str, Any]) -> None:
        if self.closing or self.transport is None:
            return
        self.transport.write(codec.encode_frame(message))
        if self.replaying:
            return
        queued = self.transport.get_write_buffer_size()
        if queued <= self.server.max_output_buffer:
            self.allowance = self.server.max_output_buffer
        elif queued > self.allowance:
            self.abort(f"client too slow: {queued} bytes queued for it")

    def send_events(self, watch_id: int, events: list[WatchEvent]) -> None:
        """Send one revision's events; split into several frames (all but the
        last marked ``partial``) only when they exceed the frame limit."""
        message = codec.encode_events(watch_id, events)
        try:
            self.send(message)
        except ProtocolError:
            if len(events) == 1:
                self.abort("a single watch event exceeds the frame limit")
                return
            half = len(events) // 2
            first = codec.encode_events(watch_id, events[:half])
            first["partial"] = True
            try:
                self.send(first)
            except ProtocolError:
                self._send_one_by_one(watch_id, events)
                return
            self.send_events(watch_id, events[half:])

    def _send_one_by_one(self, watch_id: int, events: list[WatchEvent]) -> None:
        for i, event in enumerate(events):
            message = codec.encode_events(watch_id, [event])
            if i < len(events) - 1:
                message["partial"] = True
            self.send(message)

    # -- input -----------------------------------------------------------------
    def _handle(self, frame: dict[str, Any]) -> None:
        if not self.authenticated:
            self._handle_hello(frame)
            return
        try:
            request = codec.decode_request(frame)
        except ProtocolError as exc:
            request_id = frame.get("id")
            if type(request_id) is int and frame.get("t") == "req":
                self.send(codec.error_response(request_id, "protocol", str(exc)))
            else:
                self.fail("protocol", str(exc))
            return
        try:
            result = self._execute(request)
        except (StoreError, ValueError, TypeError) as exc:
            code = next((c for t, c in _ERROR_CODES.items() if isinstance(exc, t)), "error")
            self.send(codec.error_response(request.id, code, str(exc)))
            return
        self.send(codec.encode_response(request.id, result))

    def _handle_hello(self, frame: Mapping[str, Any]) -> None:
        if frame.get("t") != "hello":
            self.fail("protocol", "the first frame must be a hello")
            return
        token = frame.get("token")
        if token is not None and not isinstance(token, str):
            self.fail("protocol", "hello 'token' must be a string or null")
            return
        expected = self.server.token
        if expected is not None:
            if not token:
                self.fail(
                    "auth",
                    "this elastrun store requires a token and the client sent none; "
                    "give every node the job's token",
                )
                return
            if not hmac.compare_digest(token.encode(), expected.encode()):
                self.fail(
                    "auth",
                    "the client's token does not match this elastrun store's token; "
                    "give every node the same token",
                )
                return
        self.authenticated = True
        if self._hello_timer is not None:
            self._hello_timer.cancel()
            self._hello_timer = None
        self.send(
            {
                "v": codec.PROTOCOL_VERSION,
                "t": "hello",
                "server_id": self.engine.uid,
                "revision": self.engine.revision,
            }
        )

    def _execute(self, request: codec.Request) -> Any:
        engine = self.engine
        args = request.args
        op = request.op
        if op == "get":
            kv = engine.get(args["key"])
            return {"kv": None if kv is None else codec.encode_kv(kv), "revision": engine.revision}
        if op == "range":
            if "max_create" in args:
                kvs, count = engine.range_newest(args["key"], args["max_create"], args["limit"])
                kvs_json = [codec.encode_kv(kv) for kv in kvs]
                return {"kvs": kvs_json, "count": count, "revision": engine.revision}
            kvs = engine.range(args["key"], prefix=True)
            return {"kvs": [codec.encode_kv(kv) for kv in kvs], "revision": engine.revision}
        if op == "put":
            return {"revision": engine.put(args["key"], args["value"], args["lease"])}
        if op == "delete":
            deleted = engine.delete(args["key"], args["prefix"])
            return {"deleted": deleted, "revision": engine.revision}
        if op == "txn":
            result = engine.txn(args["compares"], args["success"], args["failure"])
            return codec.encode_txn_result(result)
        if op == "lease_grant":
            lease = engine.lease_grant(args["ttl"], owner=self)
            self.server._poke_reaper()
            return {"lease": lease, "ttl": args["ttl"]}
        if op == "lease_keepalive":
            engine.expire_leases()  # an expired lease must not be revived
            ttl = engine.lease_keepalive(args["lease"], owner=self)
            self.server._poke_reaper()
            return {"ttl": ttl}
        if op == "lease_revoke":
            engine.lease_revoke(args["lease"])
            self.server._poke_reaper()
            return {}
        if op == "watch":
            return self._watch(args)
        if op == "watch_cancel":
            watcher = self.watches.pop(args["watch"], None)
            if watcher is not None:
                engine.remove_watcher(watcher)
            return {}
        return {"revision": engine.revision}  # ping

    def _watch(self, args: Mapping[str, Any]) -> Any:
        watch_id: int = args["watch"]
        if watch_id in self.watches:
            raise ValueError(f"watch id {watch_id} is already in use on this connection")

        def deliver(events: list[WatchEvent]) -> None:
            self.send_events(watch_id, events)

        self.watches[watch_id] = -1  # reserve: history may be delivered during registration
        self.replaying = True
        try:
            watcher = self.engine.add_watcher(
                args["key"], args["prefix"], args["start_revision"], deliver
            )
        except BaseException:
            self.watches.pop(watch_id, None)
            raise
        finally:
            self.replaying = False
        if self.transport is not None:
            queued = self.transport.get_write_buffer_size()
            self.allowance = max(self.allowance, queued + self.server.max_output_buffer)
        if self.closing:  # too slow while replaying history
            self.engine.remove_watcher(watcher)
            return {}
        self.watches[watch_id] = watcher
        return {"revision": self.engine.revision}
