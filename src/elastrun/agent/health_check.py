"""``TORCHELASTIC_HEALTH_CHECK_PORT``: the agent answers liveness probes.

torch's agent reads the variable and hands a health-check server an "alive"
callback (the time of its last progress); torch ships no server behind it
(its ``HealthCheckServer.start`` logs "No health check server started").
elastrun serves one, plain HTTP/1.0 on that port::

    GET / -> 200 {"alive": true, "last_progress": 1700000000, "timeout": 60}

(``HEAD /``: the same head, no body). Only that is served: another path is
``404``, another method on ``/`` is ``405``, a request that is not HTTP/1.x is
``400``, one over ``MAX_REQUEST`` bytes ``431``; each answer closes the
connection. ``last_progress`` is the time the agent's event loop answered
(it is event driven: a wedged agent stops answering, or answers late). The
answer holds no job data.

Where: the loopback addresses (``127.0.0.1`` and ``::1``) unless
``ELASTRUN_HEALTH_CHECK_HOST`` names others (comma-separated addresses or
names, e.g. the node's address for an orchestrator probing from outside, or
``0.0.0.0``; each bound, one that cannot be is a warning).

What a stranger can make it hold is bounded, and a flood of connections
cannot starve probes: at most ``MAX_CLIENTS`` connections at once; one past
that drops the oldest held (all held are still waiting for their request:
an answered connection is closed at once), so a silent connection lasts
until ``MAX_CLIENTS`` newer ones arrive or ``READ_TIMEOUT`` s pass, and a
probe, which sends its request as it connects, is answered as soon as the
request is read: at accept time when it is already there. Each request is
read up to ``MAX_REQUEST`` bytes; at most ``ACCEPT_BATCH`` connections are
accepted per wake-up of the event loop (so that a probe's request is read
before ``MAX_CLIENTS`` newer connections can drop it); the kernel queues at
most ``BACKLOG`` more.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import socket
import time
from typing import Any

from elastrun.agent.hooks import Core, Feature
from elastrun.agent.spec import DEFAULT_HEALTH_CHECK_HOSTS
from elastrun.event_kinds import HealthCheckFailed, HealthCheckStarted
from elastrun.untrusted import ascii_int, printable

__all__ = [
    "HOST_ENV",
    "PORT_ENV",
    "HealthCheck",
    "answer",
    "features",
    "hosts_from",
    "port_from",
    "respond",
]

PORT_ENV = "TORCHELASTIC_HEALTH_CHECK_PORT"
HOST_ENV = "ELASTRUN_HEALTH_CHECK_HOST"
DEFAULT_HOSTS = DEFAULT_HEALTH_CHECK_HOSTS
TIMEOUT = 60  # torch's: seconds without progress before the agent counts as dead
MAX_CLIENTS = 256  # connections held at once; one more drops the oldest
ACCEPT_BATCH = 16  # connections accepted per wake-up
BACKLOG = 1024  # the kernel's queue of connections not yet accepted
MAX_REQUEST = 4096  # bytes of a request: its line and headers
READ_TIMEOUT = 2.0  # seconds a connection may take to send its request
PATH = "/"
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    431: "Request Header Fields Too Large",
}


def answer(status: int, body: bytes = b"", *, head_only: bool = False) -> bytes:
    """An HTTP/1.0 answer that closes the connection."""
    extra = "Allow: GET, HEAD\r\n" if status == 405 else ""
    kind = "application/json" if status == 200 else "text/plain"
    if status != 200:
        body = f"{status} {_REASONS[status]}\n".encode()
    head = (
        f"HTTP/1.0 {status} {_REASONS[status]}\r\nContent-Type: {kind}\r\n"
        f"Content-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n"
    )
    return head.encode() + (b"" if head_only else body)


def respond(request: bytes, now: float) -> bytes | None:
    """The answer to ``request`` (the bytes received so far) at ``now``;
    None while its head (request line and headers) is incomplete."""
    if b"\r\n\r\n" not in request and b"\n\n" not in request:
        return answer(431) if len(request) >= MAX_REQUEST else None
    line = request.split(b"\n", 1)[0].rstrip(b"\r")
    parts = line.split(b" ")
    if len(parts) != 3 or parts[2] not in (b"HTTP/1.0", b"HTTP/1.1") or not parts[1]:
        return answer(400)
    method, target = parts[0], parts[1].split(b"?", 1)[0]
    if target != PATH.encode():
        return answer(404)
    if method not in (b"GET", b"HEAD"):
        return answer(405)
    body = json.dumps({"alive": True, "last_progress": int(now), "timeout": TIMEOUT}).encode()
    return answer(200, body, head_only=method == b"HEAD")


class _Client:
    """A connection waiting for its request."""

    __slots__ = ("data", "deadline", "fd", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.data = b""
        self.deadline: asyncio.TimerHandle | None = None


class HealthCheck(Feature):
    """The health-check server of ``TORCHELASTIC_HEALTH_CHECK_PORT``."""

    def __init__(
        self,
        core: Core,
        port: int,
        hosts: tuple[str, ...] = DEFAULT_HOSTS,
        *,
        max_clients: int = MAX_CLIENTS,
        read_timeout: float = READ_TIMEOUT,
    ) -> None:
        self.core = core
        self.port = port
        self.hosts = hosts
        self.max_clients = max_clients
        self.read_timeout = read_timeout
        self.listeners: list[socket.socket] = []
        # Connections waiting for their request, oldest first (by fd).
        self.clients: collections.OrderedDict[int, _Client] = collections.OrderedDict()
        self.dropped = 0  # connections dropped to make room
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        errors: list[str] = []
        bound: list[str] = []
        for host in self.hosts:
            # The default's IPv6 half is optional: a machine may have no ::1.
            quiet = self.hosts == DEFAULT_HOSTS and host == "::1"
            try:
                infos = await loop.getaddrinfo(
                    host, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
                )
            except (OSError, UnicodeError) as e:
                if not quiet:
                    errors.append(f"{host}: {getattr(e, 'strerror', None) or e}")
                continue
            for family, _, _, _, addr in infos:
                try:
                    sock = _listen(family, addr)
                except OSError as e:
                    if not quiet:
                        errors.append(f"{addr[0]}: {e.strerror or e}")
                    continue
                self.listeners.append(sock)
                bound.append(str(addr[0]))
                loop.add_reader(sock.fileno(), self._accept, sock)
        if errors:
            self.core.say(f"elastrun: warning: {self.describe()} " + "; ".join(errors))
        if not bound:
            self.not_served("; ".join(errors) or "no address")
            return
        self.served(bound)

    # What a server built on this one (agent/metrics.py) answers and says.
    def respond(self, request: bytes) -> bytes | None:
        return respond(request, time.time())

    def describe(self) -> str:
        return f"{PORT_ENV}={self.port}: cannot serve health checks on"

    def served(self, bound: list[str]) -> None:
        self.core.events.emit(HealthCheckStarted(port=self.port, hosts=bound))

    def not_served(self, error: str) -> None:
        self.core.events.emit(HealthCheckFailed(port=self.port, error=error))

    def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        for _ in range(ACCEPT_BATCH):
            try:
                sock, _ = listener.accept()
            except OSError:  # none left (EAGAIN), out of fds, reset before accept: later
                return
            sock.setblocking(False)
            client = _Client(sock)
            if self._read(client):  # done at once: its request was already there
                sock.close()
                continue
            while len(self.clients) >= self.max_clients:
                _, oldest = self.clients.popitem(last=False)
                self.dropped += 1
                self._close(oldest)
            self.clients[client.fd] = client
            client.deadline = loop.call_later(self.read_timeout, self._close, client)
            loop.add_reader(client.fd, self._readable, client)

    def _readable(self, client: _Client) -> None:
        if self._read(client):
            self._close(client)

    def _read(self, client: _Client) -> bool:
        """Read what ``client`` sent, and answer once its request is whole.
        True when the connection is done (answered, closed by the peer, or
        failed): the caller closes it."""
        try:
            data = client.sock.recv(MAX_REQUEST - len(client.data))
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True
        if not data:
            return True
        client.data += data
        reply = self.respond(client.data)
        if reply is None:
            return False
        with contextlib.suppress(OSError):
            # One non-blocking send into an empty send buffer: a few hundred
            # bytes (the metrics: a few KiB); what does not fit is cut.
            client.sock.send(reply)
        return True

    def _close(self, client: _Client) -> None:
        """Stop serving ``client`` (held, or dropped from the table) and close it."""
        if client.deadline is None:  # closed already
            return
        client.deadline.cancel()
        client.deadline = None
        if self.clients.get(client.fd) is client:
            del self.clients[client.fd]
        with contextlib.suppress(ValueError, RuntimeError, OSError):
            asyncio.get_running_loop().remove_reader(client.fd)
        client.sock.close()

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        loop = asyncio.get_running_loop()
        for sock in self.listeners:
            with contextlib.suppress(ValueError, RuntimeError):
                loop.remove_reader(sock.fileno())
            sock.close()
        self.listeners = []
        for client in list(self.clients.values()):
            self._close(client)


def _listen(family: int, addr: tuple[Any, ...]) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(addr)
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def hosts_from(raw: str | None) -> tuple[str, ...]:
    """The addresses of ``ELASTRUN_HEALTH_CHECK_HOST`` (unset or empty: loopback)."""
    hosts = tuple(h.strip().strip("[]") for h in (raw or "").split(",") if h.strip())
    return hosts or DEFAULT_HOSTS


def port_from(raw: str | None) -> tuple[int | None, str | None]:
    """``TORCHELASTIC_HEALTH_CHECK_PORT`` (None: unset): the port, or as
    torch, None for another value, with the warning that says so."""
    if raw is None:
        return None, None
    port = ascii_int(raw)
    if port is None or not 0 < port < 65536:
        shown = printable(repr(raw[:64]))
        return None, f"elastrun: warning: {PORT_ENV}={shown} is not a port; no health check served"
    return port, None


def features(core: Core) -> list[Feature]:
    """The server, when the launcher found a port (HealthCheckSettings)."""
    settings = core.spec.health_check
    if settings.port is None:
        return []
    return [HealthCheck(core, settings.port, settings.hosts)]
