"""A store client in its own process, for tests: ``python -m tests.store.client_proc``.

``race HOST PORT PREFIX ROUNDS NAME``: wait for PREFIX+"go", then try to create
PREFIX+"race/<i>" for each round; print one JSON line ``{"won": [rounds]}``.

``hold HOST PORT PREFIX TTL``: grant a lease, put PREFIX+"a" and PREFIX+"b"
with it, print ``ready``, keep the lease alive until killed.
"""

from __future__ import annotations

import asyncio
import json
import sys

from elastrun.store.client import TcpStore


async def race(host: str, port: int, prefix: str, rounds: int, name: str) -> None:
    store = await TcpStore.connect(host, port, timeout=20.0)
    watch = await store.watch(prefix + "go")
    await store.put(f"{prefix}ready/{name}", b"")
    if await store.get(prefix + "go") is None:
        await asyncio.wait_for(watch.__anext__(), 30.0)
    won = [i for i in range(rounds) if await store.create(f"{prefix}race/{i}", name.encode())]
    print(json.dumps({"won": won}), flush=True)
    await store.close()


async def hold(host: str, port: int, prefix: str, ttl: float) -> None:
    store = await TcpStore.connect(host, port, timeout=20.0)
    lease = await store.lease_grant(ttl)
    await store.put(prefix + "a", b"held", lease)
    await store.put(prefix + "b", b"held", lease)
    print("ready", flush=True)
    while True:
        await asyncio.sleep(ttl / 4)
        await store.lease_keepalive(lease)


def main(argv: list[str]) -> int:
    mode, host, port, prefix = argv[0], argv[1], int(argv[2]), argv[3]
    if mode == "race":
        asyncio.run(race(host, port, prefix, int(argv[4]), argv[5]))
    else:
        asyncio.run(hold(host, port, prefix, float(argv[4])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
