"""One connection of the embedded store's client (:mod:`elastrun.store.client`):
open the socket, say hello, and hold what the client's read loop and requests
share (pending answers by request id, the frame decoder); and a one-frame
exchange on a connection of its own (:func:`exchange`: a vote, a vouch)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Mapping
from typing import Any

from elastrun.endpoint import Endpoint
from elastrun.errors import AuthenticationError, NotHost, ProtocolError, StoreUnavailable
from elastrun.store import codec
from elastrun.untrusted import printable

__all__ = [
    "HELLO_TIMEOUT",
    "Conn",
    "HelloUnanswered",
    "close_writer",
    "describe_error",
    "exchange",
    "not_host",
    "open_conn",
]

# An elastrun store answers a hello at once (a refusal too: busy, not the host,
# a wrong token); a listener silent this long after accepting is taken for
# another program (after NOT_A_STORE_AFTER such tries in a row, client_link).
HELLO_TIMEOUT = 10.0


class HelloUnanswered(StoreUnavailable):
    """What listens at the store's address accepted the connection, then said
    nothing (``silent``) or closed it, without answering the hello: retried,
    as a store starting or stopping may; many in a row mean another program."""

    def __init__(self, message: str, *, silent: bool) -> None:
        super().__init__(message)
        self.silent = silent


def describe_error(exc: BaseException) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve the host name ({exc.strerror})"
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return str(exc) or type(exc).__name__


def close_writer(writer: asyncio.StreamWriter) -> None:
    """Close without waiting; the close's outcome (a reset, say) is consumed
    in the background, not reported later as "never retrieved"."""
    writer.close()
    with contextlib.suppress(RuntimeError):  # no running loop: nothing to consume
        waiter = asyncio.ensure_future(writer.wait_closed())
        waiter.add_done_callback(_consume)


async def exchange(
    host: str, port: int, frame: Mapping[str, Any], timeout: float
) -> dict[str, Any] | None:
    """Send ``frame`` to the store at ``host:port`` on a connection of its own
    and read one frame back (None: not reached, closed, malformed, or no answer
    within ``timeout`` seconds). The answer is bounded (4 KiB frames)."""
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
            try:
                writer.write(codec.encode_frame(frame))
                await writer.drain()
                decoder = codec.FrameDecoder(4096)
                while (reply := decoder.pop()) is None:
                    data = await reader.read(4096)
                    if not data:
                        return None
                    decoder.push(data)
            finally:
                close_writer(writer)
    except (OSError, TimeoutError, ProtocolError):
        return None
    return reply


def _consume(task: asyncio.Future[None]) -> None:
    if not task.cancelled():
        task.exception()


class Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.decoder = codec.FrameDecoder()
        self.task: asyncio.Task[None] | None = None
        self.alive = True
        self.reason = "connection closed by the store"
        self.term = 0  # a failover store's term (its hello's)


async def open_conn(
    host: str,
    port: int,
    token: str | None,
    timeout: float,
    hello: Mapping[str, Any] | None = None,
) -> tuple[Conn, str]:
    """Connect and say hello within ``timeout``; returns the connection and the
    store's server id. ``hello``: more fields of the hello (a failover store's
    ``term`` and ``candidate``). Raises OSError, TimeoutError or
    StoreUnavailable (retry; NotHost: a candidate host that does not serve),
    AuthenticationError or ProtocolError (do not)."""
    address = str(Endpoint(host, port))
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection(host, port)
    conn = Conn(reader, writer)
    wait = min(max(0.0, end - loop.time()), HELLO_TIMEOUT)
    try:
        async with asyncio.timeout(wait):
            writer.write(codec.encode_frame({**codec.hello(token), **(hello or {})}))
            await writer.drain()
            while (reply := conn.decoder.pop()) is None:
                data = await reader.read(65536)
                if not data:
                    raise HelloUnanswered(
                        f"{address} closed the connection without answering the hello",
                        silent=False,
                    )
                conn.decoder.push(data)
    except ConnectionError as exc:  # reset, broken pipe: closed on us mid-hello
        close_writer(writer)
        raise HelloUnanswered(
            f"{address} closed the connection without answering the hello ({describe_error(exc)})",
            silent=False,
        ) from None
    except TimeoutError:
        close_writer(writer)
        if wait < HELLO_TIMEOUT:
            raise  # the caller's deadline
        raise HelloUnanswered(
            f"{address} accepted the connection but did not answer the hello within "
            f"{HELLO_TIMEOUT:g} s",
            silent=True,
        ) from None
    except BaseException:
        close_writer(writer)
        raise
    if reply.get("t") == "error":
        close_writer(writer)
        code = reply.get("code")
        message = str(reply.get("message", "refused"))
        if code == "auth":
            raise AuthenticationError(f"the elastrun store at {address}: {message}")
        if code == "busy":  # too many connections for now: retried
            raise StoreUnavailable(f"the elastrun store at {address} is busy: {message}")
        if code == "not_host":
            raise not_host(address, message, reply)
        raise ProtocolError(f"the elastrun store at {address} refused us: {message}")
    server_id = reply.get("server_id")
    if reply.get("t") != "hello" or not isinstance(server_id, str):
        close_writer(writer)
        raise ProtocolError(f"{address} did not answer like an elastrun store")
    term = reply.get("term")
    conn.term = term if type(term) is int and term >= 0 else 0
    return conn, server_id  # the read loop takes over conn.decoder, with any bytes it holds


def not_host(address: str, message: str, reply: Mapping[str, Any]) -> NotHost:
    """A candidate host's refusal (untrusted: bounded, typed)."""
    role, term, host = reply.get("role"), reply.get("term"), reply.get("host")
    voted = reply.get("voted")
    return NotHost(
        f"the elastrun store at {address}: {message:.300}",
        role=role if role in ("standby", "fenced", "host") else "standby",
        term=term if type(term) is int and term >= 0 else 0,
        host=printable(host[:300]) if isinstance(host, str) else "",
        voted=voted if type(voted) is int and voted >= 0 else 0,
    )
