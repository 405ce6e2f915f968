"""The health check of ``TORCHELASTIC_HEALTH_CHECK_PORT`` (agent/health_check.py):
what it answers, where it listens, and that silent connections past its
bound drop the oldest instead of turning probes away. Real sockets on
loopback; the agent's own end-to-end test is in
tests/integration/test_torchrun_flags.py."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

import pytest

from elastrun.agent.health_check import (
    DEFAULT_HOSTS,
    MAX_REQUEST,
    HealthCheck,
    hosts_from,
    respond,
)
from elastrun.event_kinds import Event
from tests.helpers import free_port


def status_of(reply: bytes | None) -> int | None:
    return None if reply is None else int(reply.split(b" ", 2)[1])


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\nUser-Agent: kubelet\r\n\r\n", 200),
        (b"GET /?probe=1 HTTP/1.0\r\n\r\n", 200),
        (b"HEAD / HTTP/1.1\r\n\r\n", 200),
        (b"POST /shutdown HTTP/1.1\r\nContent-Length: 0\r\n\r\n", 404),
        (b"GET /metrics HTTP/1.1\r\n\r\n", 404),
        (b"POST / HTTP/1.1\r\n\r\n", 405),
        (b"DELETE / HTTP/1.1\r\n\r\n", 405),
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\n\n", 400),  # TLS, then garbage
        (b"garbage\r\n\r\n", 400),
        (b"GET / SSH-2.0\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: x\r\n", None),  # not whole yet
        (b"GET / HTTP/1.1\r\nX: " + b"a" * MAX_REQUEST, 431),
    ],
    ids=[
        "get",
        "query",
        "head",
        "shutdown",
        "other-path",
        "post",
        "delete",
        "tls",
        "garbage",
        "not-http",
        "partial",
        "too-long",
    ],
)
def test_only_a_get_of_the_served_path_is_answered_ok(request_bytes: bytes, status: int) -> None:
    reply = respond(request_bytes, 1_700_000_000.5)
    assert status_of(reply) == status
    if status == 200 and reply is not None and not request_bytes.startswith(b"HEAD"):
        body = json.loads(reply.split(b"\r\n\r\n", 1)[1])
        assert body == {"alive": True, "last_progress": 1_700_000_000, "timeout": 60}
    if request_bytes.startswith(b"HEAD") and reply is not None:
        assert reply.endswith(b"\r\n\r\n") and b"Content-Length: " in reply


def test_the_host_knob_defaults_to_loopback() -> None:
    assert hosts_from(None) == hosts_from(" ") == DEFAULT_HOSTS == ("127.0.0.1", "::1")
    assert hosts_from("10.0.0.5, [::]") == ("10.0.0.5", "::")


class _Events:
    def __init__(self) -> None:
        self.emitted: list[tuple[str, dict[str, Any]]] = []

    def emit(self, event: Event) -> None:
        self.emitted.append((event.KIND, event.to_json()))


class _Core:
    def __init__(self) -> None:
        self.events = _Events()
        self.lines: list[str] = []

    def say(self, line: str) -> None:
        self.lines.append(line)


def listening(port: int) -> set[str]:
    """The local addresses of the sockets listening on ``port`` (from /proc)."""
    found = set()
    for name in ("tcp", "tcp6"):
        path = Path("/proc/net") / name
        if not path.exists():
            continue
        for row in path.read_text().splitlines()[1:]:
            local, state = row.split()[1], row.split()[3]
            addr, hexport = local.split(":")
            if state == "0A" and int(hexport, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(addr)
                if len(raw) == 4:
                    found.add(socket.inet_ntop(socket.AF_INET, raw[::-1]))
                else:  # four little-endian 32-bit words
                    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                    found.add(socket.inet_ntop(socket.AF_INET6, words))
    return found


async def _until(check: Any, what: str, steps: int = 2000) -> None:
    """Let the loop run until ``check()`` (bounded by a count of loop turns)."""
    for _ in range(steps):
        if check():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never: {what}")


async def _probe(port: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\nHost: probe\r\n\r\n")
    try:
        return await asyncio.wait_for(reader.read(), 60)
    finally:
        writer.close()


def test_it_listens_on_loopback_and_a_flood_drops_its_oldest_not_the_probes() -> None:
    port = free_port()

    async def main() -> None:
        core = _Core()
        # (no read deadline within the test: only the bound drops connections)
        server = HealthCheck(core, port, max_clients=16, read_timeout=3600)  # type: ignore[arg-type]
        server.start()
        await _until(lambda: core.events.emitted, "the server started")
        assert core.events.emitted[0][0] == "health_check_started", core.events.emitted
        assert listening(port) and listening(port) <= {"127.0.0.1", "::1"}
        try:
            # 40 silent connections: only the 16 newest are held.
            flood = []
            for _ in range(40):
                s = socket.socket()
                s.setblocking(False)
                s.connect_ex(("127.0.0.1", port))
                flood.append(s)
            await _until(lambda: server.dropped == 40 - 16, "the oldest silent ones dropped")
            assert len(server.clients) == 16
            # Probes still get their answers (a probe held before its request
            # is read drops the oldest silent one in turn).
            for _ in range(5):
                reply = await _probe(port)
                assert reply.startswith(b"HTTP/1.0 200 OK"), reply
            assert len(server.clients) >= 16 - 5 and server.dropped <= 40 - 16 + 5

            # The dropped are the oldest, closed (end of file); the newest still held.
            def closed(s: socket.socket) -> bool:
                try:
                    return s.recv(1) == b""
                except BlockingIOError:
                    return False
                except OSError:
                    return True

            assert all(closed(s) for s in flood[: 40 - 16])
            assert not any(closed(s) for s in flood[-16 + 5 :])
            for s in flood:
                s.close()
        finally:
            await server.close()
        assert not listening(port)

    asyncio.run(main())


def test_a_port_taken_on_loopback_is_a_warning() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]

        async def main() -> _Core:
            core = _Core()
            server = HealthCheck(core, port, ("127.0.0.1",))  # type: ignore[arg-type]
            server.start()
            await _until(lambda: core.events.emitted, "the server gave up")
            await server.close()
            return core

        core = asyncio.run(main())
    assert core.events.emitted[0][0] == "health_check_failed"
    assert "cannot serve health checks on 127.0.0.1" in core.lines[0]
