"""``TORCHELASTIC_HEALTH_CHECK_PORT``: the agent answers liveness probes.

torch's agent reads the variable and hands a health-check server an "alive"
callback (the time of its last progress); torch ships no server behind it
(its ``HealthCheckServer.start`` logs "No health check server started").
elastrun serves one: a plain HTTP/1.0 answer on that port, on every
interface (an orchestrator's probe comes from outside the machine)::

    GET / -> 200 {"alive": true, "last_progress": 1700000000, "timeout": 60}

``last_progress`` is the last time the agent's event loop ran this check
(it is event driven: a wedged agent stops answering, or answers late). The
answer holds no job data. What a stranger can make it hold is bounded: at
most ``MAX_CLIENTS`` connections at once (others are closed at once), each
read at most ``MAX_REQUEST`` bytes within ``READ_TIMEOUT`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time

from elastrun.agent.hooks import Core, Feature
from elastrun.untrusted import ascii_int, printable

__all__ = ["PORT_ENV", "HealthCheck", "features"]

PORT_ENV = "TORCHELASTIC_HEALTH_CHECK_PORT"
TIMEOUT = 60  # torch's: seconds without progress before the agent counts as dead
MAX_CLIENTS = 16
MAX_REQUEST = 4096
READ_TIMEOUT = 2.0


def answer(now: float) -> bytes:
    """The HTTP answer for a probe at ``now``."""
    body = json.dumps({"alive": True, "last_progress": int(now), "timeout": TIMEOUT}).encode()
    head = (
        "HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class HealthCheck(Feature):
    """The health-check server of ``TORCHELASTIC_HEALTH_CHECK_PORT``."""

    def __init__(self, core: Core, port: int) -> None:
        self.core = core
        self.port = port
        self.server: asyncio.Server | None = None
        self.clients = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        try:
            self.server = await asyncio.start_server(
                self._client, host=None, port=self.port, limit=MAX_REQUEST
            )
        except OSError as e:
            self.core.say(
                f"elastrun: warning: {PORT_ENV}={self.port}: cannot serve health checks: "
                f"{e.strerror or e}"
            )
            self.core.events.emit("health_check_failed", port=self.port, error=str(e))
            return
        self.core.events.emit("health_check_started", port=self.port)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.clients >= MAX_CLIENTS:
            writer.close()
            return
        self.clients += 1
        try:
            with contextlib.suppress(TimeoutError, OSError, asyncio.IncompleteReadError):
                async with asyncio.timeout(READ_TIMEOUT):
                    await reader.readuntil(b"\n")  # the request line; the rest is ignored
                writer.write(answer(time.time()))
                async with asyncio.timeout(READ_TIMEOUT):
                    await writer.drain()
        except asyncio.LimitOverrunError:
            pass
        finally:
            self.clients -= 1
            writer.close()

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.server.wait_closed(), READ_TIMEOUT)


def features(core: Core) -> list[Feature]:
    """The server, when ``TORCHELASTIC_HEALTH_CHECK_PORT`` is a port number
    (as torch: another value is ignored, and said so)."""
    raw = {**os.environ, **core.spec.env}.get(PORT_ENV)
    if raw is None:
        return []
    port = ascii_int(raw)
    if port is None or not 0 < port < 65536:
        shown = printable(repr(raw[:64]))
        core.say(f"elastrun: warning: {PORT_ENV}={shown} is not a port; no health check served")
        return []
    return [HealthCheck(core, port)]
