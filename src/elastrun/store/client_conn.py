"""One connection of the embedded store's client (:mod:`elastrun.store.client`):
open the socket, say hello, and hold what the client's read loop and requests
share (pending answers by request id, the frame decoder)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

from elastrun.endpoint import Endpoint
from elastrun.errors import AuthenticationError, ProtocolError, StoreUnavailable
from elastrun.store import codec

__all__ = ["Conn", "close_writer", "describe_error", "open_conn"]


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


async def open_conn(host: str, port: int, token: str | None, timeout: float) -> tuple[Conn, str]:
    """Connect and say hello within ``timeout``; returns the connection and the
    store's server id. Raises OSError, TimeoutError or StoreUnavailable (retry),
    AuthenticationError or ProtocolError (do not)."""
    address = str(Endpoint(host, port))
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection(host, port)
        conn = Conn(reader, writer)
        try:
            writer.write(codec.encode_frame(codec.hello(token)))
            await writer.drain()
            while (reply := conn.decoder.pop()) is None:
                data = await reader.read(65536)
                if not data:
                    raise StoreUnavailable("the store closed the connection during the hello")
                conn.decoder.push(data)
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
        raise ProtocolError(f"the elastrun store at {address} refused us: {message}")
    server_id = reply.get("server_id")
    if reply.get("t") != "hello" or not isinstance(server_id, str):
        close_writer(writer)
        raise ProtocolError(f"{address} did not answer like an elastrun store")
    return conn, server_id  # the read loop takes over conn.decoder, with any bytes it holds
