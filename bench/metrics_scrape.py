"""What a Prometheus scrape costs the agent (agent/metrics_server.py).

A real ``MetricsServer`` on loopback in this process's event loop, its
registry fed as a running agent's is (a round, restarts, failures by cause, a
recovery histogram, goodput figures, a store host), scraped ``--scrapes``
times (default 1000) by a client in another process (``curl``-like, plain
sockets), one at a time. Reported: the agent's time per scrape (the time its
event loop spent in the server's handlers for it: accepting, reading the
request, rendering, the one non-blocking send), in wall time (which counts
the time the machine ran other processes) and in the thread's CPU time, their
mean, median, 99th percentile and maximum; the CPU time of the agent's thread over all the
scrapes per scrape (the event loop's own work too); and the client's round
trip. The target is under 5 ms per scrape. The handlers never wait: a silent
scraper costs a held socket until its deadline, one that never reads gets
what fit in its socket's buffer and is closed at once
(tests/unit/test_metrics.py).

Run: ``python -m bench.metrics_scrape [--scrapes 1000]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

from bench.harness import free_port
from elastrun.agent.metrics import Metrics
from elastrun.agent.metrics_server import MetricsServer
from elastrun.event_kinds import Restart, RoundJoined, StoreHostFound, WorkerExited
from elastrun.goodput import Goodput

CLIENT = """
import socket, sys, time
port, n = int(sys.argv[1]), int(sys.argv[2])
times = []
for _ in range(n):
    t0 = time.perf_counter()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"GET /metrics HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n")
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    s.close()
    assert data.startswith(b"HTTP/1.0 200"), data[:100]
    times.append(time.perf_counter() - t0)
print(" ".join(f"{t:.6f}" for t in times))
"""


class _Core:
    def __init__(self) -> None:
        self.events = self

    def emit(self, event: object) -> None:
        del event

    def say(self, line: str) -> None:
        print(line)


def registry() -> Metrics:
    m = Metrics()
    m.emit(RoundJoined(12, "n", 0, None, 8, 64, 8, "10.0.0.1:29500", 11))
    for i in range(11):
        m.emit(Restart(count=i, reason="worker_failed", counted=True, round=i))
        m.emit(WorkerExited(i, i, 1, 1, 1000 + i, None, "SIGKILL", "root_cause", False))
        m.recovered(1.0 + i / 10)
    m.emit(StoreHostFound(term=3, host="10.0.0.2:29400", previous_term=2, previous_host="x"))
    m.goodput = lambda: Goodput({"training": 900.0, "restart": 30.0, "saves": 5.0}, failures=11)
    m.step_time = lambda: 0.2
    return m


@dataclass
class Measured:
    per_scrape: list[float]  # s of the agent's handlers, per scrape answered (wall)
    cpu_per_scrape: list[float]  # the same in CPU time of the agent's thread
    trips: list[float]  # the client's round trips (s)
    cpu: float  # the agent thread's CPU time over all the scrapes (s)
    size: int  # bytes of an answer's body


async def measure(scrapes: int) -> Measured:
    port = free_port()
    server = MetricsServer(_Core(), registry(), port, ("127.0.0.1",))  # type: ignore[arg-type]
    per_scrape: list[float] = []
    cpu_per_scrape: list[float] = []
    pending = [0.0, 0.0]  # handler time since the last answer: wall, CPU
    # The agent's time per scrape: every handler of the server, timed, summed
    # until the scrape's answer (one scrape at a time: the client waits; a
    # call that answered several, the client's next request having come while
    # it ran, is shared among them).
    for name in ("_accept", "_readable"):
        real = getattr(server, name)

        def timed(*args: object, _real: object = real) -> None:
            before = server.metrics.scrapes
            t0, c0 = time.perf_counter(), time.thread_time()
            _real(*args)  # type: ignore[operator]
            pending[0] += time.perf_counter() - t0
            pending[1] += time.thread_time() - c0
            answered = server.metrics.scrapes - before
            if answered:  # one call may answer several (the next came meanwhile)
                per_scrape.extend([pending[0] / answered] * answered)
                cpu_per_scrape.extend([pending[1] / answered] * answered)
                pending[:] = [0.0, 0.0]

        setattr(server, name, timed)
    server.start()
    await asyncio.sleep(0.2)
    cpu0 = time.thread_time()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CLIENT, str(port), str(scrapes), stdout=subprocess.PIPE
    )
    out, _ = await proc.communicate()
    cpu = time.thread_time() - cpu0
    await server.close()
    size = len(server.metrics.render())
    return Measured(per_scrape, cpu_per_scrape, [float(x) for x in out.split()], cpu, size)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scrapes", type=int, default=1000)
    args = p.parse_args(argv)
    m = asyncio.run(measure(args.scrapes))
    n = max(1, len(m.trips))
    print(f"{len(m.trips)} scrapes of {m.size} bytes")
    for what, values in (("wall", m.per_scrape), ("CPU", m.cpu_per_scrape)):
        q = statistics.quantiles(values, n=100)
        print(
            f"agent's handlers per scrape ({what}): mean {statistics.fmean(values) * 1e3:.3f} ms, "
            f"median {statistics.median(values) * 1e3:.3f} ms, p99 {q[98] * 1e3:.3f} ms, "
            f"max {max(values) * 1e3:.3f} ms"
        )
    print(
        f"agent's CPU per scrape (its thread, the event loop's own work included): "
        f"{m.cpu / n * 1e3:.3f} ms"
    )
    print(f"client round trip: median {statistics.median(m.trips) * 1e3:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
