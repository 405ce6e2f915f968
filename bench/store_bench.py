"""Round-trip latency and throughput of the embedded store on loopback.

``python -m bench.store_bench [--n N]``: starts a StoreServer in this process
and prints median/p99 latency and ops/s for get, CAS (txn) and watch
notification. Client and server share one event loop, so each figure includes
both sides' CPU. For the record; not a timed test.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable

from elastrun.store.client import TcpStore
from elastrun.store.server import StoreServer


def report(name: str, samples: list[float], wall: float) -> None:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    print(
        f"{name:<20} median {statistics.median(ordered) * 1e6:8.1f} us"
        f"   p99 {p99 * 1e6:8.1f} us   {len(samples) / wall:9.0f} ops/s"
    )


async def timed(n: int, op: Callable[[int], Awaitable[object]]) -> tuple[list[float], float]:
    samples = []
    start = time.perf_counter()
    for i in range(n):
        t0 = time.perf_counter()
        await op(i)
        samples.append(time.perf_counter() - t0)
    return samples, time.perf_counter() - start


async def main(n: int) -> None:
    async with StoreServer("127.0.0.1", 0) as server:
        host, port = server.address or ("127.0.0.1", 0)
        a = await TcpStore.connect(host, port)
        b = await TcpStore.connect(host, port)
        await a.put("/bench/k", b"x" * 64)

        report("get", *await timed(n, lambda i: a.get("/bench/k")))

        async def cas(i: int) -> None:
            kv = await a.get("/bench/cas")
            ok = await a.compare_and_set("/bench/cas", kv.mod_revision if kv else 0, b"%d" % i)
            assert ok

        report("get + CAS", *await timed(n, cas))

        watch = await b.watch("/bench/w")

        async def notify(i: int) -> None:
            await a.put("/bench/w", b"%d" % i)
            await watch.__anext__()

        report("put -> watch event", *await timed(n, notify))

        # pipelined throughput: many requests in flight on one connection
        start = time.perf_counter()
        await asyncio.gather(*(a.get("/bench/k") for _ in range(n)))
        wall = time.perf_counter() - start
        print(f"{'pipelined get':<20} {n / wall:9.0f} ops/s ({n} in flight)")
        await watch.close()
        await a.close()
        await b.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000, help="operations per measurement")
    asyncio.run(main(parser.parse_args().n))
