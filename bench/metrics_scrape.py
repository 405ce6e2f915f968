"""What a Prometheus scrape costs the agent (agent/metrics_server.py).

A real ``MetricsServer`` on loopback in this process's event loop, its
registry fed as a running agent's is (a round, restarts, failures by cause, a
recovery histogram, goodput figures, a store host), scraped ``--scrapes``
times (default 1000) by a client in another process (``curl``-like, plain
sockets), one at a time. Reported: the agent's time per scrape (the time its
event loop spent in the server's handlers: accepting, reading the request,
rendering, the one non-blocking send), its median and 99th percentile, and the
client's round trip; the target is under 5 ms per scrape. The handlers never
wait: a slow or silent scraper costs a held socket until its deadline.

Run: ``python -m bench.metrics_scrape [--scrapes 1000]``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time

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


async def measure(scrapes: int) -> tuple[list[float], list[float], int]:
    port = free_port()
    server = MetricsServer(_Core(), registry(), port, ("127.0.0.1",))  # type: ignore[arg-type]
    spent: list[float] = []
    # The agent's time per scrape: every handler of the server, timed.
    for name in ("_accept", "_readable"):
        real = getattr(server, name)

        def timed(*args: object, _real: object = real) -> None:
            t0 = time.perf_counter()
            _real(*args)  # type: ignore[operator]
            spent.append(time.perf_counter() - t0)

        setattr(server, name, timed)
    server.start()
    await asyncio.sleep(0.2)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CLIENT, str(port), str(scrapes), stdout=subprocess.PIPE
    )
    out, _ = await proc.communicate()
    await server.close()
    size = len(server.metrics.render())
    return spent, [float(x) for x in out.split()], size


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scrapes", type=int, default=1000)
    args = p.parse_args(argv)
    spent, trips, size = asyncio.run(measure(args.scrapes))
    # Handlers per scrape: one accept (the request is usually there already)
    # or an accept and a read; the agent's cost of a scrape is their sum.
    per = sum(spent) / max(1, len(trips))
    q = statistics.quantiles(spent, n=100)
    print(f"{len(trips)} scrapes of {size} bytes")
    print(f"agent's event loop per scrape: mean {per * 1e3:.3f} ms")
    print(
        f"per handler call: median {statistics.median(spent) * 1e3:.3f} ms, "
        f"p99 {q[98] * 1e3:.3f} ms, max {max(spent) * 1e3:.3f} ms"
    )
    print(f"client round trip: median {statistics.median(trips) * 1e3:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
