"""The agent's end of the sockets to the processes it starts, read as untrusted.

A worker runs the user's code, and a warm interpreter imports it: what they
send is decoded within bounds of size and depth (``elastrun.untrusted``),
then as one of the typed messages of ``worker/_messages.py``; anything else
is dropped. :class:`RunnerChannel` is a worker runner's channel (JSON lines
on a stream socket), bounded in what a worker may send over its life.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable

from elastrun.untrusted import UntrustedData, loads
from elastrun.worker._messages import BadMessage, Go, Message, encode_line, from_json

__all__ = ["CHANNEL_BYTES_PER_S", "CHANNEL_ENV", "MAX_CHANNEL_BYTES", "RunnerChannel", "decode"]

CHANNEL_ENV = "ELASTRUN_CHANNEL_FD"  # read by worker/_runner.py
MAX_CHANNEL_BYTES = 1 << 20  # what one worker may send the agent over its channel at once
# ... plus this much per second it has run (the progress it relays while its
# file cannot be written: at most a record of a few hundred bytes per interval).
CHANNEL_BYTES_PER_S = 4096


def decode(data: bytes, *, max_bytes: int, what: str) -> Message | None:
    """The message in ``data``; None when it is not one (too big, too deep,
    not JSON, not of the protocol)."""
    try:
        return from_json(loads(data, max_bytes=max_bytes, what=what))
    except (UntrustedData, BadMessage):
        return None


class RunnerChannel:
    """The agent's end of one worker's channel, watched on the event loop.

    ``on_message`` gets each message the runner sends; ``on_close`` is
    called once when the channel is gone: the runner closed it (it exited,
    or a write of its did not fit) or it sent more than ``MAX_CHANNEL_BYTES``
    plus ``CHANNEL_BYTES_PER_S`` for each second since :meth:`watch`."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock: socket.socket | None = sock
        self._buf = bytearray()
        self._read = 0
        self._opened = 0.0
        self._now: Callable[[], float] = lambda: 0.0
        self._on_message: Callable[[Message], None] = lambda _m: None
        self._on_close: Callable[[], None] = lambda: None

    @property
    def open(self) -> bool:
        return self.sock is not None

    def watch(
        self,
        now: Callable[[], float],
        on_message: Callable[[Message], None],
        on_close: Callable[[], None],
    ) -> None:
        sock = self.sock
        if sock is None:
            return
        self._now, self._on_message, self._on_close = now, on_message, on_close
        self._opened = now()
        sock.setblocking(False)
        asyncio.get_running_loop().add_reader(sock.fileno(), self._readable)

    def go(self) -> None:
        """A forked worker is registered: it may run its script."""
        self.send(Go())

    def send(self, message: Message) -> bool:
        """Send ``message`` to the runner (a few hundred bytes: the socket's
        buffer takes it); False when the channel is gone or full."""
        if self.sock is None:
            return False
        try:
            data = encode_line(message)
            return self.sock.send(data) == len(data)
        except OSError:
            return False

    def rebind(self, on_message: Callable[[Message], None], on_close: Callable[[], None]) -> None:
        """Another owner (the next round's group, in-process restarts) gets
        the messages from now on."""
        self._on_message, self._on_close = on_message, on_close

    def _readable(self) -> None:
        sock = self.sock
        if sock is None:
            return
        try:
            data = sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        self._read += len(data)
        budget = MAX_CHANNEL_BYTES + CHANNEL_BYTES_PER_S * (self._now() - self._opened)
        if not data or self._read > budget:
            self.close()
            self._on_close()
            return
        self._buf += data
        while b"\n" in self._buf:
            line, _, rest = bytes(self._buf).partition(b"\n")
            self._buf = bytearray(rest)
            message = decode(line, max_bytes=MAX_CHANNEL_BYTES, what="a channel message")
            if message is not None:
                self._on_message(message)

    def close(self) -> None:
        sock, self.sock = self.sock, None
        if sock is None:
            return
        with contextlib.suppress(RuntimeError, ValueError, OSError):
            asyncio.get_running_loop().remove_reader(sock.fileno())
        sock.close()
