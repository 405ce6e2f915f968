"""The Prometheus endpoint (agent/metrics.py, agent/metrics_server.py): the
registry fed by events, the text it writes, bounded label values, the flag's
grammar, and a real server on loopback: 1000 scrapes leave the agent's memory
(traced and resident) and open files where they were, a scraper that sends
nothing is cut off at the deadline, and one that never reads at once."""

from __future__ import annotations

import asyncio
import gc
import os
import re
import socket
import tracemalloc
from typing import Any

import pytest

from elastrun.agent.memory import saves_since
from elastrun.agent.metrics import MAX_LABEL_VALUES, Metrics
from elastrun.agent.metrics_server import MetricsServer, respond, settings_from
from elastrun.errors import ConfigError
from elastrun.event_kinds import (
    Event,
    MemoryCheckpointPersisted,
    Restart,
    RoundClosed,
    RoundJoined,
    StoreHostFound,
    Straggler,
    WorkerExited,
)
from elastrun.goodput import Goodput
from elastrun.launcher.config import LaunchConfig
from elastrun.launcher.plan import resolve
from elastrun.worker.snapshot import SaveTotals
from tests.helpers import free_port

# One sample line of the text format: a name, optional labels, a number.
SAMPLE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-z_]+="([^"\\]|\\.)*",?)*\})? -?[0-9.e+-]+$')


def fed() -> Metrics:
    m = Metrics()
    for event in (
        RoundJoined(3, "n1", 0, None, 2, 4, 2, "127.0.0.1:1", 1),
        RoundClosed(3, "max_nodes", ["a", "b"], {"a": 0, "b": 1}, [], ["c"]),
        Restart(count=1, reason="worker_failed", counted=True, round=2),
        WorkerExited(2, 0, 1, 1, 99, 1, None, "root_cause", False),
        Straggler(rank=1, own_time_s=0.3, median_s=0.2, round=3),
        StoreHostFound(term=2, host='10.0.0.2:29400"\n', previous_term=1, previous_host="x"),
        MemoryCheckpointPersisted(0, 0, 50, "/ckpt-50.pt", 4096, 0.5),
    ):
        m.emit(event)
    m.recovered(1.5)
    m.saved(3, 0.25, 3072)
    m.saved(1, 0.05, 1024)
    m.goodput = lambda: Goodput({"training": 90.0, "restart": 10.0, "startup": 5.0}, failures=1)
    m.step_time = lambda: 0.05
    return m


def samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.match(r"^# (HELP|TYPE) elastrun_[a-z_]+ .+$", line), line
            continue
        assert SAMPLE.match(line), line
        name, value = line.rsplit(" ", 1)
        out[name] = float(value)
    return out


def test_the_exposition_holds_what_the_agent_saw() -> None:
    got = samples(fed().render().decode())
    assert got["elastrun_round"] == 3 and got["elastrun_world_size"] == 4
    assert got["elastrun_members"] == 2 and got["elastrun_spares"] == 1
    assert got['elastrun_restarts_total{reason="worker_failed",counted="true"}'] == 1
    assert got['elastrun_worker_failures_total{cause="root_cause"}'] == 1
    assert got['elastrun_recovery_seconds_bucket{le="1"}'] == 0
    assert got['elastrun_recovery_seconds_bucket{le="2"}'] == 1
    assert got['elastrun_recovery_seconds_bucket{le="+Inf"}'] == 1
    assert got["elastrun_recovery_seconds_sum"] == 1.5
    assert got["elastrun_goodput_ratio"] == 0.9
    assert got['elastrun_goodput_seconds{cause="restart"}'] == 10
    assert got["elastrun_step_rate"] == 20
    assert got["elastrun_straggler_score"] == pytest.approx(1.5)
    assert got["elastrun_store_term"] == 2
    # A host from the store is one series, escaped.
    assert [k for k in got if k.startswith("elastrun_store_host_info")] == [
        'elastrun_store_host_info{host="10.0.0.2:29400\\"\\n"}'
    ]
    assert got["elastrun_memory_checkpoint_persist_bytes_total"] == 4096
    assert got["elastrun_memory_checkpoint_saves_total"] == 4
    assert got["elastrun_memory_checkpoint_save_blocked_seconds_total"] == pytest.approx(0.3)
    assert got["elastrun_memory_checkpoint_save_bytes_total"] == 4096


def test_the_workers_saves_are_counted_once_across_looks_and_restarts() -> None:
    a1, a2 = SaveTotals(100, 3, 0.3, 300), SaveTotals(100, 5, 0.5, 500)
    assert saves_since(None, a1) == a1  # the first look: all of them
    assert saves_since(a1, a1).saves == 0  # the same note again: none
    grown = saves_since(a1, a2)
    assert (grown.pid, grown.saves, grown.nbytes) == (100, 2, 200)
    assert grown.blocked_s == pytest.approx(0.2)
    b = SaveTotals(101, 1, 0.1, 100)  # a restarted worker counts from 0
    assert saves_since(a2, b) == b


def test_label_values_are_bounded() -> None:
    m = Metrics()
    for i in range(1000):
        m.emit(Restart(count=i, reason=f"reason_{i}", counted=False, round=i))
    m.emit(Restart(count=0, reason="Not A Word {}", counted=False, round=0))
    restarts = [k for k in samples(m.render().decode()) if k.startswith("elastrun_restarts_total")]
    assert len(restarts) == MAX_LABEL_VALUES + 1  # the first ones, and "other"
    assert 'elastrun_restarts_total{reason="other",counted="false"}' in restarts


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", 200),
        (b"HEAD /metrics HTTP/1.0\r\n\r\n", 200),
        (b"GET / HTTP/1.1\r\n\r\n", 404),
        (b"POST /metrics HTTP/1.1\r\n\r\n", 405),
        (b"garbage\r\n\r\n", 400),
        (b"GET /metrics HTTP/1.1\r\n", None),
        (b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 5000, 431),
    ],
    ids=["get", "head", "other-path", "post", "garbage", "partial", "too-long"],
)
def test_only_a_get_of_metrics_is_answered(request_bytes: bytes, status: int | None) -> None:
    reply = respond(request_bytes, Metrics())
    assert (None if reply is None else int(reply.split(b" ", 2)[1])) == status


@pytest.mark.parametrize(
    ("text", "port", "hosts"),
    [
        ("9400", 9400, ("127.0.0.1", "::1")),
        ("0.0.0.0:9400", 9400, ("0.0.0.0",)),
        ("10.0.0.1,[::1]:9400", 9400, ("10.0.0.1", "::1")),
        ("", None, ("127.0.0.1", "::1")),
    ],
)
def test_the_flag(text: str, port: int | None, hosts: tuple[str, ...]) -> None:
    got = settings_from(text)
    assert (got.port, got.hosts) == (port, hosts)


@pytest.mark.parametrize("text", ["x", "70000", ":9400", "0", "a:b", "٩٤٠٠"])
def test_a_bad_flag_is_refused_naming_it(text: str) -> None:
    with pytest.raises(ConfigError, match="--metrics-port"):
        settings_from(text)


def test_the_rdzv_conf_key_serves_metrics_and_the_flag_wins() -> None:
    conf = {"metrics_port": "0.0.0.0:9400"}
    got = resolve(LaunchConfig(rdzv_configs=conf)).workers.metrics
    assert (got.port, got.hosts) == (9400, ("0.0.0.0",))
    got = resolve(LaunchConfig(rdzv_configs=conf, metrics_port="9500")).workers.metrics
    assert (got.port, got.hosts) == (9500, ("127.0.0.1", "::1"))
    assert resolve(LaunchConfig()).workers.metrics.port is None
    with pytest.raises(ConfigError, match="--rdzv-conf metrics_port: expected PORT"):
        resolve(LaunchConfig(rdzv_configs={"metrics_port": "http"}))


class _Events:
    def __init__(self) -> None:
        self.emitted: list[str] = []

    def emit(self, event: Event) -> None:
        self.emitted.append(event.KIND)


class _Core:
    def __init__(self) -> None:
        self.events = _Events()
        self.lines: list[str] = []

    def say(self, line: str) -> None:
        self.lines.append(line)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rss() -> int:
    """This process's resident memory (bytes)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def _scrape(port: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    try:
        return await asyncio.wait_for(reader.read(), 60)
    finally:
        writer.close()
        await writer.wait_closed()


async def _until(check: Any, what: str, steps: int = 4000) -> None:
    for _ in range(steps):
        if check():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never: {what}")


def test_scrapes_do_not_grow_memory_and_a_silent_scraper_is_cut_off() -> None:
    port = free_port()

    async def main() -> None:
        core = _Core()
        server = MetricsServer(core, fed(), port, ("127.0.0.1",))  # type: ignore[arg-type]
        server.read_timeout = 0.5  # a scraper that sends nothing is dropped then
        server.start()
        await _until(lambda: core.events.emitted, "the server up")
        assert core.events.emitted == ["metrics_started"]
        try:
            first = await _scrape(port)
            assert first.startswith(b"HTTP/1.0 200 OK") and b"elastrun_round 3" in first
            for _ in range(50):  # warm: the allocator's and asyncio's own caches
                await _scrape(port)
            gc.collect()
            rss, fds = _rss(), _fds()
            tracemalloc.start()
            before = tracemalloc.take_snapshot()
            for _ in range(1000):
                assert (await _scrape(port)).startswith(b"HTTP/1.0 200")
            gc.collect()
            after = tracemalloc.take_snapshot()
            tracemalloc.stop()
            grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
            assert grown < 64 * 1024, f"{grown} bytes more after 1000 scrapes"
            # The process as the kernel sees it: no socket left open, and its
            # resident memory where it was (about 0.1 MiB more here, the
            # tracer's own; one answer kept per scrape would be 4.5 MiB).
            assert _fds() == fds
            assert _rss() - rss < 2 << 20, f"{_rss() - rss} bytes more resident"
            assert server.metrics.scrapes == 1051
            # A scraper that connects and sends nothing is cut off.
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                assert await asyncio.wait_for(reader.read(), 60) == b""  # closed by the server
            finally:
                writer.close()
            assert not server.clients
        finally:
            await server.close()

    asyncio.run(main())


def test_a_scraper_that_never_reads_is_cut_off_and_blocks_nothing() -> None:
    """Scrapers that send their request and never read, with the smallest
    receive buffer, against the smallest send buffer (the answer does not
    fit): the agent answers each with what fits, closes it at once (not at
    the read deadline), and serves a real scrape meanwhile."""
    port = free_port()
    clients = 20

    async def main() -> None:
        core = _Core()
        server = MetricsServer(core, fed(), port, ("127.0.0.1",))  # type: ignore[arg-type]
        server.read_timeout = 600.0  # no connection is closed by the deadline here
        server.start()
        await _until(lambda: core.events.emitted, "the server up")
        for listener in server.listeners:  # accepted sockets take the listener's size
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1)
        full = await _scrape(port)
        base = _fds()
        stuck = []
        try:
            for _ in range(clients):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)
                s.settimeout(60)
                s.connect(("127.0.0.1", port))
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                stuck.append(s)
            # The agent's loop is not held: a scrape is answered in full.
            answer = await _scrape(port)
            assert answer.startswith(b"HTTP/1.0 200 OK") and answer.endswith(b"\n"), answer[-200:]
            # Every stuck scraper's connection is closed by the agent (only
            # the clients' own sockets are left open here), none held.
            await _until(lambda: _fds() == base + clients, "the stuck connections closed")
            assert not server.clients and server.metrics.scrapes == 2 + clients
            for s in stuck:  # each got what fit (a part of an answer), then the end
                got = b""
                while chunk := await asyncio.to_thread(s.recv, 65536):
                    got += chunk
                assert got.startswith(b"HTTP/1.0 200 OK") and len(got) <= len(full) + 64, got
        finally:
            for s in stuck:
                s.close()
            await server.close()

    asyncio.run(main())
