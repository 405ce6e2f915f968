"""What a round costs each node in store requests: a few, and the same at any size.

Real handlers (``DynamicRendezvous``) on a real ``elastrun store serve``, each
with its own connection as each agent has; every request a handler's client
sends is counted by operation. A whole job's life is measured: registration,
the round, the exit barrier and leaving.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from elastrun.names import RunId
from elastrun.rendezvous.api import RendezvousSettings
from elastrun.rendezvous.dynamic import DynamicRendezvous
from elastrun.rendezvous.keys import Keys
from elastrun.store import codec
from elastrun.store.client import TcpStore
from tests.store.conftest import ServerProcess, start_server_process, stop_process


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = start_server_process()
    yield proc
    stop_process(proc.proc)


def counted(store: TcpStore, tally: Counter[str]) -> None:
    """Count ``store``'s requests by operation (its client's one send path)."""
    send = store._send

    async def counting(conn: Any, deadline: float, request: Any, decode: Any) -> Any:
        tally[request.OP] += 1
        answer = await send(conn, deadline, request, decode)
        tally["answer bytes"] += len(json.dumps(codec.encode_answer(answer)))
        return answer

    store._send = counting  # type: ignore[method-assign]


def requests(tally: Counter[str]) -> int:
    return sum(v for k, v in tally.items() if k != "answer bytes")


def handler(store: TcpStore, run_id: RunId, n: int, i: int) -> DynamicRendezvous:
    settings = RendezvousSettings(
        run_id=run_id, min_nodes=n, max_nodes=n, host=f"h{i}", addr="127.0.0.1"
    )
    return DynamicRendezvous(store, settings, node_id=f"n{i}")


async def job(host: str, port: int, n: int) -> list[Counter[str]]:
    """``n`` nodes: a round, the exit barrier, leave; each node's requests.
    A node that finished leaves no ``left`` key (its done key says it)."""
    run_id = RunId(f"cost-{uuid.uuid4().hex[:8]}")
    stores = [await TcpStore.connect(host, port, timeout=30.0) for _ in range(n)]
    tallies: list[Counter[str]] = [Counter() for _ in range(n)]
    try:
        for store, tally in zip(stores, tallies, strict=True):
            counted(store, tally)
        handlers = [handler(store, run_id, n, i) for i, store in enumerate(stores)]
        results = await asyncio.gather(*(h.next_round() for h in handlers))
        assert sorted(r.group_rank for r in results) == list(range(n))
        await asyncio.gather(*(h.complete() for h in handlers))
        await asyncio.gather(*(h.shutdown() for h in handlers))
        left, _ = await stores[0].get_prefix(Keys(run_id).root + "left/")
        assert left == [], left
    finally:
        for store in stores:
            await store.close()
    return tallies


def test_a_round_costs_each_node_a_few_requests_whatever_the_size(server: ServerProcess) -> None:
    costs = {}
    for n in (8, 40):
        tallies = asyncio.run(asyncio.wait_for(job(server.host, server.port, n), 120))
        each = [requests(t) for t in tallies]
        costs[n] = statistics.mean(each)
        watches = statistics.mean(t["watch"] for t in tallies)
        # 11 for most: a lease, register (one txn creates a new job, one more
        # joins it), one watch on round for every phase, the join, the
        # follower's read and watch, its place in the result, the done txn,
        # the barrier's watch, the lease revoked.
        assert costs[n] <= 12.5, (n, each, tallies)
        assert watches <= 3.25, (n, tallies)
        assert max(each) <= 24, (n, each)  # the decider: its reads and watches (17-18)
    assert abs(costs[40] - costs[8]) <= 1.5, costs  # constant in the number of nodes


def test_a_node_that_leaves_before_it_finished_says_so(server: ServerProcess) -> None:
    """A member that stops before its round finished puts its ``left`` key:
    the others say it left, not that it was lost."""

    async def main() -> list[str]:
        run_id = RunId(f"left-{uuid.uuid4().hex[:8]}")
        stores = [await TcpStore.connect(server.host, server.port, timeout=30.0) for _ in "ab"]
        try:
            a, b = (handler(store, run_id, 2, i) for i, store in enumerate(stores))
            await asyncio.gather(a.next_round(), b.next_round())
            await b.shutdown()
            await a.shutdown()
            left, _ = await stores[0].get_prefix(Keys(run_id).root + "left/")
            return [kv.key.rsplit("/", 1)[-1] for kv in left]
        finally:
            for store in stores:
                await store.close()

    assert asyncio.run(asyncio.wait_for(main(), 60)) == ["n0", "n1"]


async def training(host: str, port: int, n: int) -> tuple[list[Counter[str]], int]:
    """``n`` members train (``wait_for_change()``) until the last one leaves:
    what each one's watch cost, and which one is group rank 0."""
    run_id = RunId(f"train-{uuid.uuid4().hex[:8]}")
    stores = [await TcpStore.connect(host, port, timeout=30.0) for _ in range(n)]
    tallies: list[Counter[str]] = [Counter() for _ in range(n)]
    try:
        handlers = [handler(store, run_id, n, i) for i, store in enumerate(stores)]
        results = await asyncio.gather(*(h.next_round() for h in handlers))
        for store, tally in zip(stores, tallies, strict=True):
            counted(store, tally)
        # The member that leaves: the last in rank order, never the round's
        # watcher (group rank 0, which every other member watches): the
        # ranks follow the join order, which the machine's load decides.
        last = max(range(n), key=lambda i: results[i].group_rank)
        stay = [h for i, h in enumerate(handlers) if i != last]
        watching = [asyncio.ensure_future(h.wait_for_change()) for h in stay]
        while sum(map(requests, tallies)) < 4 * (n - 1):  # each one's watch set up
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        await handlers[last].shutdown()  # left: every other member sees it
        changes = await asyncio.gather(*watching)
        assert {c.reason for c in changes} == {"member_lost"}, changes
        await asyncio.gather(*(h.shutdown() for h in stay))
    finally:
        for store in stores:
            await store.close()
    ranks = [r.group_rank for i, r in enumerate(results) if i != last]
    return [t for i, t in enumerate(tallies) if i != last], ranks.index(0)


def test_training_members_watch_one_key_whatever_the_size(server: ServerProcess) -> None:
    """While the members train, one of them (group rank 0, the round's
    watcher) watches every presence key; each other member reads and watches
    its presence alone (and ``waiting/``): the same requests and bytes at 8
    and at 40 members."""
    worst = {}
    for n in (8, 40):
        tallies, watcher = asyncio.run(asyncio.wait_for(training(server.host, server.port, n), 120))
        others = [t for i, t in enumerate(tallies) if i != watcher]
        # Its presence read and watch, waiting/ read and watch; leaving: the
        # left key and the lease.
        assert max(requests(t) for t in others) <= 7, (n, others)
        worst[n] = max(t["answer bytes"] for t in others)
        assert worst[n] < 2048, (n, others)
        # The watcher reads the whole membership and every presence key.
        assert tallies[watcher]["answer bytes"] > worst[n], (n, tallies[watcher])
    assert worst[40] <= worst[8] + 512, worst  # O(1) bytes per member
