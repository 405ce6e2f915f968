"""The first host's election among candidate hosts (store/failover.py
``FailoverClient.connect``), with real candidate stores on loopback addresses
(127.0.0.1/.2/.3, one port) and short timings: who hosts term 1 when the first
candidate is down, and how a split election settles in the next term."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from elastrun.endpoint import Endpoint
from elastrun.events import ListSink
from elastrun.store.failover import Candidates, FailoverClient
from elastrun.store.server import StoreServer
from elastrun.store.term import FailoverTiming, Role, TermState
from tests.helpers import port_on_every

# vote_after = 1.2 * 1.01 / 0.99 + 0.1 = 1.32 s; start_wait longer, as by default.
TIMING = FailoverTiming(heartbeat=0.2, silence=1.0, suspect=0.6, fence=1.2, margin=0.1,
                        start_wait=1.5)  # fmt: skip
BOUND = 20.0


@contextlib.asynccontextmanager
async def candidate(endpoints: tuple[Endpoint, ...], me: int) -> AsyncIterator[FailoverClient]:
    """Candidate ``me``: its store standing by, and its agent's client."""
    state = TermState(me, len(endpoints), timing=TIMING)
    host, port = endpoints[me]
    server = StoreServer([host], port, failover=state, candidates=[str(e) for e in endpoints])
    await server.start()
    client = FailoverClient(
        Candidates(endpoints, me), server=server, timing=TIMING, events=ListSink()
    )
    try:
        yield client
    finally:
        for task in watches.pop(id(client), []):
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        if client.store is not None:
            await client.store.close()
        await server.stop()


watches: dict[int, list[asyncio.Task[Any]]] = {}


async def connect(client: FailoverClient) -> None:
    """Connect as an agent does, then ping the host as its watch does (the
    host hears from its candidates: it keeps hosting)."""
    await client.connect(BOUND)
    task = asyncio.get_running_loop().create_task(client.watch())
    watches.setdefault(id(client), []).append(task)


def endpoints() -> tuple[Endpoint, ...]:
    port = port_on_every()
    return tuple(Endpoint(f"127.0.0.{i}", port) for i in (1, 2, 3))


def events(client: FailoverClient, kind: str) -> list[dict[str, Any]]:
    sink = client.events
    assert isinstance(sink, ListSink)
    return [e for e in sink.events if e["kind"] == kind]


def run(body: Any) -> None:
    async def main() -> None:
        async with asyncio.timeout(BOUND * 2):
            await body()

    asyncio.run(main())


def test_without_the_first_candidate_the_second_hosts_term_1_and_the_first_joins_later() -> None:
    eps = endpoints()

    async def body() -> None:
        async with candidate(eps, 1) as b, candidate(eps, 2) as c:
            await asyncio.gather(connect(b), connect(c))
            assert (b.host, b.term, c.host, c.term) == (1, 1, 1, 1)
            assert b.server is not None and b.server.failover is not None
            assert b.server.failover.role is Role.HOST
            for client in (b, c):
                gone = events(client, "store_candidate_unreachable")
                assert [e["candidate"] for e in gone] == [str(eps[0])], gone
                assert gone[0]["answer"] == "refused"
            async with candidate(eps, 0) as a:  # the first candidate, late
                await connect(a)
                assert (a.host, a.term) == (1, 1)
                assert a.server is not None and a.server.failover is not None
                assert a.server.failover.role is Role.STANDBY
                assert not events(a, "store_vote")  # a host served: it voted for nobody

    run(body)


def test_a_split_first_election_settles_in_the_next_term() -> None:
    """The third candidate starts alone: after the wait it passes the first
    two over and votes for itself in term 1. The second starts then: the
    first is still down, it votes for itself in term 1 too. Nobody has a
    majority; one vote_after later both vote in term 2 for the first live
    candidate, the second: it hosts term 2 (a later term on a slow machine),
    the only host."""
    eps = endpoints()

    async def body() -> None:
        async with candidate(eps, 2) as c:
            alone = asyncio.ensure_future(connect(c))
            for _ in range(400):  # bounded: its vote comes after the start wait
                if events(c, "store_vote"):
                    break
                await asyncio.sleep(0.05)
            assert [(e["term"], e["candidate"]) for e in events(c, "store_vote")] == [
                (1, str(eps[2]))
            ]
            async with candidate(eps, 1) as b:
                await asyncio.gather(connect(b), alone)
                # One host, the second, agreed on by both: in term 2, or a term
                # later on a machine so slow that a vote_after ran out once more.
                assert (b.host, c.host) == (1, 1) and b.term == c.term >= 2
                assert c.server is not None and c.server.failover is not None
                assert c.server.failover.role is Role.STANDBY
                votes = [(e["term"], e["candidate"]) for e in events(b, "store_vote")]
                # For itself: in term 1, or straight in term 2 when the third's
                # term-2 vote for it came first (it joins the term it holds a vote in).
                assert votes[-1] == (b.term, str(eps[1])), votes
                assert {v[1] for v in votes} == {str(eps[1])}, votes

    run(body)
