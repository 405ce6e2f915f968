"""One connection of the embedded store's server (:mod:`elastrun.store.server`).

What a connection may make the server hold is bounded
(:class:`~elastrun.store.limits.StoreLimits`):

* Before its hello: one frame of at most ``PRE_HELLO_FRAME`` bytes, within
  ``hello_timeout``. A first frame that is not a valid hello, a wrong or
  missing token, bytes that are not frames: an error frame, then closed. A
  candidate host's store (docs/failover.md) also takes a ``vote`` as first
  frame (answered, then closed), refuses a hello with ``not_host`` while it
  does not serve, and holds requests while its server says so.
* After: frames of at most ``MAX_FRAME``; each frame begun must be complete
  within ``frame_timeout``. The bytes of incomplete frames count against the
  server's ``max_partial_bytes`` for all connections together
  (:class:`~elastrun.store.budgets.InputBudget`).
* Output: queued by reference (:class:`~elastrun.store.server_output.OutputQueue`:
  a watch event's encoded events are one object for all the watches of its
  revision) and handed to the transport a chunk at a time as the kernel takes
  it. While more than ``output_high_water`` bytes are queued for it, its
  requests wait unread and its watches stop taking live events: they catch up
  from the engine's history as the queue drains (a watch that falls behind
  the compacted history is cancelled with a ``cancel`` frame, code
  ``compacted``). A watch whose unsent bytes (queued unread, plus the history
  it has yet to catch up on) pass ``slow_watch_bytes`` is cancelled, code
  ``slow``. A peer that does not read for ``stall_timeout`` is dropped. What is
  queued counts against the server's ``max_output_bytes`` for all connections
  together, a shared piece once (:class:`~elastrun.store.budgets.OutputBudget`).
* Answers: range answers come in pages of at most ``max_response`` bytes (for
  clients that ask for pages; others get an error past it), a txn whose
  answer could be larger is refused unapplied.

Requests are executed by :mod:`elastrun.store.server_ops`, watches streamed
by :mod:`elastrun.store.server_watch`. What a connection needs of its server
(admission, the budgets, the token, the lease reaper) is
:class:`ConnectionHost`: the server (:mod:`elastrun.store.server`) imports
this module, never the other way round.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import socket
import struct
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from elastrun.endpoint import Endpoint
from elastrun.errors import ProtocolError
from elastrun.store import codec
from elastrun.store.abuse_log import AbuseLog
from elastrun.store.budgets import InputBudget, OutputBudget
from elastrun.store.codec import WatchCancelRequest, WatchRequest
from elastrun.store.engine import Engine
from elastrun.store.limits import PRE_HELLO_FRAME, StoreLimits
from elastrun.store.server_ops import execute
from elastrun.store.server_watch import SLOW_CHECK_INTERVAL, WatchStreams

__all__ = ["Connection", "ConnectionHost"]

log = logging.getLogger("elastrun.store.server")

# SO_LINGER on, 0 s: close() resets the connection, dropping unsent bytes.
_RESET = struct.pack("ii", 1, 0)
# Seconds a closed connection may take to flush its last frames before it is dropped.
CLOSE_LINGER = 5.0


class ConnectionHost(Protocol):
    """What a :class:`Connection` needs of its server
    (:class:`~elastrun.store.server.StoreServer`)."""

    engine: Engine
    limits: StoreLimits
    token: str | None
    max_frame: int
    disconnect_grace: float
    abuse: AbuseLog
    input: InputBudget[Connection]
    output: OutputBudget[Connection]
    slow_watches: int

    def admit(self, conn: Connection) -> str | None:
        """Count ``conn`` in; None, or why it is refused."""

    def hello_done(self, conn: Connection) -> None:
        """``conn`` said hello (it no longer counts as pending)."""

    def gone(self, conn: Connection) -> None:
        """``conn`` ended."""

    def poke_reaper(self) -> None:
        """A lease deadline may have moved."""

    def term_hello(self, frame: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
        """A hello's term fields, and why it is refused (None: it is not)."""

    def take_vote(self, frame: Mapping[str, Any], answer: Callable[[dict[str, Any]], None]) -> None:
        """A candidate's vote: counted (once vouched for, without a token),
        then ``answer`` gets the reply."""

    def take_candidate(self, conn: Connection, candidate: int, nonce: object) -> None:
        """A hello names the client's agent as candidate ``candidate``: set
        ``conn.candidate`` once that is known to be true."""

    def vouch(self, nonce: object) -> dict[str, Any]:
        """The answer to a ``vouch`` frame (store/vouch.py)."""

    def serving(self) -> bool:
        """Whether requests are served (a candidate host of a failover store
        stands by or stepped down otherwise)."""

    def heard(self, candidate: int) -> None:
        """A candidate's connection sent something."""

    def holding(self, conn: Connection) -> bool:
        """Whether ``conn``'s requests wait (the host does not hear from a
        majority of the candidates right now); it is then released later."""


class Connection(WatchStreams, asyncio.Protocol):
    def __init__(self, server: ConnectionHost) -> None:
        self.server = server
        self.engine = server.engine
        self.limits = server.limits
        self.decoder = codec.FrameDecoder(PRE_HELLO_FRAME)
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self.peer_ip = "?"
        self.authenticated = False
        self.closing = False
        self.lost = False
        self.aborted = False
        self.admitted = False
        self.candidate: int | None = None  # a candidate host's connection (failover)
        self.watches: dict[int, int] = {}  # client's watch id -> engine watcher id
        # Watches catching up from history (client's id -> engine watcher id).
        self.lagging: dict[int, int] = {}
        self._pump_scheduled = False
        self._slow_check_soon = False
        self.init_output(server.output)
        self.reading_paused = False
        self._hello_timer: asyncio.TimerHandle | None = None
        self._frame_timer: asyncio.TimerHandle | None = None
        self._stall_timer: asyncio.TimerHandle | None = None
        self._slow_timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol ------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peer = transport.get_extra_info("peername")
        if peer:
            self.peer_ip = str(peer[0])
            self.peer = str(Endpoint(self.peer_ip, int(peer[1])))
        # pause_writing as soon as the kernel does not take a whole chunk,
        # resume_writing once it took all of it (the queue holds the rest).
        transport.set_write_buffer_limits(high=0, low=0)
        refused = self.server.admit(self)
        if refused is not None:
            self.refuse(f"refused: {refused}")
            return
        self.admitted = True
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.limits.socket_send_buffer)
        loop = asyncio.get_running_loop()
        self._hello_timer = loop.call_later(self.limits.hello_timeout, self._hello_expired)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.lost = True
        self.decoder.clear()
        self.server.input.forget(self)
        self.out.clear()
        self.server.output.forget(self)
        for timer in (self._hello_timer, self._frame_timer, self._stall_timer, self._slow_timer):
            if timer is not None:
                timer.cancel()
        for watcher in self.watches.values():
            self.engine.remove_watcher(watcher)
        self.watches.clear()
        self.lagging.clear()
        self.server.gone(self)
        if not self.admitted:
            return
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
            self.server.poke_reaper()  # a deadline moved earlier

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        if self.candidate is not None:
            self.server.heard(self.candidate)
        self.decoder.push(data)
        self._handle_frames()

    def eof_received(self) -> bool | None:
        return None  # close our side too

    def _backed_up(self) -> None:
        self.write_paused = True
        if self._stall_timer is None and not self.closing:
            loop = asyncio.get_running_loop()
            self._stall_timer = loop.call_later(self.limits.stall_timeout, self._stalled)
            self._slow_timer = loop.call_later(SLOW_CHECK_INTERVAL, self._slow_check)

    def _drained(self) -> None:
        self.write_paused = False
        for timer in (self._stall_timer, self._slow_timer):
            if timer is not None:
                timer.cancel()
        self._stall_timer = self._slow_timer = None
        if self.closing or self.transport is None:
            return
        if self.reading_paused:
            self.reading_paused = False
            self.transport.resume_reading()
            self._handle_frames()
        self._schedule_pump()

    # -- input -----------------------------------------------------------------
    def release(self) -> None:
        """Handle the frames held while the server was holding requests."""
        if not self.closing:
            self._handle_frames()

    def _handle_frames(self) -> None:
        taken = self._take_frames()
        self._after_input(taken)

    def _take_frames(self) -> bool:
        """Handle the whole frames received; True if any was taken."""
        taken = False
        while self.transport is not None and not self.transport.is_closing():
            if self.write_paused:
                # Backpressure: the rest waits (in the decoder) until the
                # client has read what is queued for it (resume_writing).
                if not self.reading_paused:
                    self.reading_paused = True
                    self.transport.pause_reading()
                return taken
            if self.authenticated and self.server.holding(self):
                return taken  # the rest waits (in the decoder) until it is released
            try:
                frame = self.decoder.pop()
            except ProtocolError as exc:
                self.fail("protocol", str(exc))
                return taken
            if frame is None:
                return taken
            taken = True
            try:
                self._handle(frame)
            except Exception as exc:  # never let one connection take the server down
                self.server.abuse.warn(
                    f"connection {self.peer}: internal error handling a frame: {exc!r}"
                )
                self.fail("internal", f"internal server error: {type(exc).__name__}")
                return taken
        return taken

    def _after_input(self, taken: bool) -> None:
        """Count what the decoder holds against the server's budget, and give
        a frame begun the frame timeout (before the hello, the hello timeout
        covers it). ``taken``: a frame was completed, so what is held now
        belongs to a new one."""
        if self.closing:
            return
        pending = self.decoder.pending
        if not self.authenticated and pending > PRE_HELLO_FRAME:
            self.fail("protocol", f"more than {PRE_HELLO_FRAME} bytes before the hello")
            return
        self.server.input.update(self, pending, taken)
        if self.closing or not self.authenticated:
            return
        if self._frame_timer is not None and (taken or not pending):
            self._frame_timer.cancel()
            self._frame_timer = None
        if pending and self._frame_timer is None:
            loop = asyncio.get_running_loop()
            self._frame_timer = loop.call_later(self.limits.frame_timeout, self._frame_expired)

    def _frame_expired(self) -> None:
        self._frame_timer = None
        if self.closing or not self.decoder.pending:
            return
        if self.reading_paused:  # our backpressure, not the client's fault
            self._after_input(True)
            return
        self.fail("protocol", f"a frame was not completed within {self.limits.frame_timeout:g} s")

    def _handle(self, frame: dict[str, Any]) -> None:
        if not self.authenticated:
            self._handle_hello(frame)
            return
        if not self.server.serving():
            if self.closing:  # it stepped down just now: every connection was dropped
                return
            fields, refused = self.server.term_hello({})
            self._close_with("not_host", refused or "not the store's host", fields)
            return
        try:
            request_id, request = codec.decode_request(frame)
        except ProtocolError as exc:
            raw_id = frame.get("id")
            if type(raw_id) is int and frame.get("t") == "req":
                self.send(codec.error_response(raw_id, "protocol", str(exc)))
            else:
                self.fail("protocol", str(exc))
            return
        match request:
            case WatchRequest():
                self._watch(request_id, request)
            case WatchCancelRequest(watch=watch_id):
                watcher = self.watches.pop(watch_id, None)
                self.lagging.pop(watch_id, None)
                if watcher is not None:
                    self.engine.remove_watcher(watcher)
                self.send(codec.encode_response(request_id, codec.EmptyAnswer()))
            case _:
                answer = execute(
                    self.engine,
                    request_id,
                    request,
                    owner=self,
                    max_response=self.limits.max_response,
                    leases_moved=self.server.poke_reaper,
                )
                self.send_answer(request_id, answer)

    def send_answer(self, request_id: int, message: Mapping[str, Any]) -> None:
        """Send a response; one too large for a frame becomes a ``limit`` error."""
        try:
            data = codec.encode_frame(message)
        except ProtocolError as exc:
            data = codec.encode_frame(
                codec.error_response(request_id, "limit", f"the answer is too large: {exc}")
            )
        self._write(data)

    def _handle_hello(self, frame: Mapping[str, Any]) -> None:
        if frame.get("t") not in ("hello", "vote", "vouch"):
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
        if frame.get("t") == "vote":  # a candidate's vote: answered, then closed
            self.closing = True  # nothing more is read from it
            self.server.take_vote(frame, self._answer_vote)
            return
        if frame.get("t") == "vouch":  # a candidate asks what this one's agent said
            self._close_with_answer(self.server.vouch(frame.get("nonce")))
            return
        fields, refused = self.server.term_hello(frame)
        if refused is not None:
            self._close_with("not_host", refused, fields)
            return
        candidate = frame.get("candidate")
        if type(candidate) is int and fields:
            self.server.take_candidate(self, candidate, frame.get("nonce"))
        self.authenticated = True
        self.decoder.max_frame = self.server.max_frame
        self.server.hello_done(self)
        if self._hello_timer is not None:
            self._hello_timer.cancel()
            self._hello_timer = None
        self.send(
            {
                "v": codec.PROTOCOL_VERSION,
                "t": "hello",
                "server_id": self.engine.uid,
                "revision": self.engine.revision,
                **fields,
            }
        )

    # -- output ----------------------------------------------------------------
    def send(self, message: Mapping[str, Any]) -> None:
        if self.closing or self.transport is None:
            return
        self._write(codec.encode_frame(message))

    def slow_watch_cancelled(self, watch_id: int, message: str) -> None:
        self.server.slow_watches += 1
        self.server.abuse.warn(f"cancelled slow watch {watch_id} of {self.peer}: {message}")

    # -- closing ---------------------------------------------------------------
    def fail(self, code: str, message: str) -> None:
        """Tell the peer why (best effort), then close after flushing."""
        if self.closing or self.transport is None:
            return
        self.server.abuse.warn(f"closed connection {self.peer}: {message}")
        self._close_with(code, message)

    def refuse(self, message: str) -> None:
        """Admission refused it (or evicted it): tell it why and close."""
        if self.closing or self.transport is None:
            return
        self.server.abuse.warn(f"connection {self.peer} {message}")
        self._close_with("busy", message)

    def _close_with(self, code: str, message: str, extra: Mapping[str, Any] | None = None) -> None:
        self._close_with_answer({**codec.encode_error(code, message), **(extra or {})})

    def _answer_vote(self, answer: Mapping[str, Any]) -> None:
        if not self.lost and self.transport is not None:
            self._close_with_answer(answer)

    def _close_with_answer(self, answer: Mapping[str, Any]) -> None:
        assert self.transport is not None
        with contextlib.suppress(ProtocolError):
            self.out.append(codec.encode_frame(answer))
        self.closing = True
        self.close_when_flushed = True
        self.decoder.clear()
        self.server.input.forget(self)
        self._feed()
        if self.output_size():
            # Flushing what is queued needs the peer to read: bounded.
            loop = asyncio.get_running_loop()
            loop.call_later(CLOSE_LINGER, self.abort, "did not read its last frames")

    def abort(self, reason: str) -> None:
        """Close at once, discarding queued output (also a connection already
        closing, whose peer does not read what it still had to flush)."""
        if self.transport is None or self.lost or self.aborted:
            return
        self.aborted = True
        if reason != "server dropped the connection":
            self.server.abuse.warn(f"dropped connection {self.peer}: {reason}")
            # A reset, so that the kernel drops what it still holds for the peer too.
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
        self.closing = True
        self.decoder.clear()
        self.server.input.forget(self)
        self.out.clear()
        self.server.output.forget(self)
        self.transport.abort()

    def _hello_expired(self) -> None:
        if not self.authenticated:
            self.fail("protocol", f"no hello within {self.limits.hello_timeout:g} s")

    def _stalled(self) -> None:
        self._stall_timer = None
        if self.write_paused:
            self.abort(f"not reading: output queued for {self.limits.stall_timeout:g} s")
