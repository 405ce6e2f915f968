"""``--metrics-port``: the agent's Prometheus endpoint, ``GET /metrics``.

The bounded server of agent/health_check.py (at most ``MAX_CLIENTS``
connections, the oldest dropped for a new one; a request of at most
``MAX_REQUEST`` bytes, read within ``READ_TIMEOUT`` seconds; one non-blocking
send, then the connection is closed: a scraper that never reads gets what fit
in its socket's buffer and is cut off), answering with the registry's text
(agent/metrics.py). Loopback unless ``--metrics-port`` names addresses.
"""

from __future__ import annotations

from elastrun.agent.health_check import MAX_REQUEST, HealthCheck
from elastrun.agent.hooks import Core, Feature
from elastrun.agent.metrics import CONTENT_TYPE, Metrics
from elastrun.agent.spec import MetricsSettings
from elastrun.errors import ConfigError
from elastrun.event_kinds import MetricsFailed, MetricsStarted
from elastrun.untrusted import ascii_int, printable

__all__ = ["PATH", "MetricsServer", "features", "respond", "settings_from"]

PATH = "/metrics"


def _answer(status: str, body: bytes, kind: str, *, head_only: bool) -> bytes:
    head = (
        f"HTTP/1.0 {status}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + (b"" if head_only else body)


def respond(request: bytes, metrics: Metrics) -> bytes | None:
    """The answer to ``request`` (the bytes received so far); None while
    its head is incomplete."""
    if b"\r\n\r\n" not in request and b"\n\n" not in request:
        if len(request) >= MAX_REQUEST:
            return _answer(
                "431 Request Header Fields Too Large", b"431\n", "text/plain", head_only=False
            )
        return None
    parts = request.split(b"\n", 1)[0].rstrip(b"\r").split(b" ")
    if len(parts) != 3 or parts[2] not in (b"HTTP/1.0", b"HTTP/1.1") or not parts[1]:
        return _answer("400 Bad Request", b"400\n", "text/plain", head_only=False)
    method, target = parts[0], parts[1].split(b"?", 1)[0]
    if target != PATH.encode():
        return _answer("404 Not Found", b"404\n", "text/plain", head_only=False)
    if method not in (b"GET", b"HEAD"):
        return _answer("405 Method Not Allowed", b"405\n", "text/plain", head_only=False)
    metrics.scrapes += 1
    return _answer("200 OK", metrics.render(), CONTENT_TYPE, head_only=method == b"HEAD")


class MetricsServer(HealthCheck):
    """``--metrics-port``: the bounded server of agent/health_check.py,
    answering ``GET /metrics`` with :meth:`Metrics.render`."""

    def __init__(self, core: Core, metrics: Metrics, port: int, hosts: tuple[str, ...]) -> None:
        super().__init__(core, port, hosts)
        self.metrics = metrics

    def respond(self, request: bytes) -> bytes | None:
        return respond(request, self.metrics)

    def describe(self) -> str:
        return f"--metrics-port {self.port}: cannot serve metrics on"

    def served(self, bound: list[str]) -> None:
        self.core.events.emit(MetricsStarted(port=self.port, hosts=bound))

    def not_served(self, error: str) -> None:
        self.core.events.emit(MetricsFailed(port=self.port, error=error))


def features(core: Core) -> list[Feature]:
    """The server, with ``--metrics-port``."""
    settings = core.spec.metrics
    if settings.port is None or core.metrics is None:
        return []
    return [MetricsServer(core, core.metrics, settings.port, settings.hosts)]


MAX_HOSTS = 16


def settings_from(raw: str | None, flag: str = "--metrics-port") -> MetricsSettings:
    """``--metrics-port``: ``PORT`` (loopback) or ``HOST[,HOST...]:PORT``
    (``[::1]:PORT`` for an IPv6 address; ``0.0.0.0:PORT`` for every
    address); None or empty: not served. ConfigError naming ``flag``."""
    if raw is None or not raw.strip():
        return MetricsSettings()
    text = raw.strip()
    head, sep, tail = text.rpartition(":")
    port = ascii_int(tail if sep else text)
    hosts = tuple(h.strip().strip("[]") for h in head.split(",") if h.strip()) if sep else ()
    if port is None or not 0 < port < 65536 or (sep and not hosts) or len(hosts) > MAX_HOSTS:
        raise ConfigError(
            f"{flag}: expected PORT or HOST[,HOST...]:PORT (at most {MAX_HOSTS} hosts), "
            f"got {printable(repr(text[:100]))}"
        )
    return MetricsSettings(port=port, hosts=hosts) if hosts else MetricsSettings(port=port)
