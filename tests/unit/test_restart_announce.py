"""Every place that says a restart counted says what the rendezvous charged.

The rendezvous charges a worker failure's restart when the round it opened
closes, with every member of the round before back (rendezvous/rounds.py);
the agent says how its round ended once the next round formed
(agent/restart_charge.py ``RoundEnd``): the console line, the ``restart``
event (and from it the ``elastrun_restarts_total`` metric), and the goodput
ledger's failures. Driven in virtual time over one real in-memory store, the
nodes' real rendezvous, as the agent does: a failure reported (``failed``), or
the change another node's failure made (``changed``), then ``next_round()``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from types import SimpleNamespace
from typing import cast

from elastrun.agent.goodput import GoodputAccounting
from elastrun.agent.hooks import Core
from elastrun.agent.metrics import Metrics
from elastrun.agent.restart_charge import RoundEnd
from elastrun.agent.workers import WorkerGroup
from elastrun.clock import Clock, VirtualTimeLoop, run_virtual
from elastrun.event_kinds import Restart
from elastrun.failure import BROKEN_COLLECTIVE, SIGNAL, FailureRecord
from elastrun.names import RunId
from elastrun.rendezvous.api import RendezvousSettings, RoundResult
from elastrun.rendezvous.dynamic import DynamicRendezvous
from elastrun.store.memory import MemoryStore

MAX_RESTARTS = 3
BOUND = 60.0  # virtual seconds: only a hang reaches it


def clock() -> Clock:
    loop = asyncio.get_running_loop()
    assert isinstance(loop, VirtualTimeLoop)
    return loop.clock


def handler(store: MemoryStore, run_id: str, name: str, nodes: int) -> DynamicRendezvous:
    settings = RendezvousSettings(
        run_id=RunId(run_id),
        host=f"h-{name}",
        addr="127.0.0.1",
        min_nodes=2,
        max_nodes=nodes,
        max_restarts=MAX_RESTARTS,
        last_call_timeout=0.5,
    )
    return DynamicRendezvous(store, settings, node_id=name, clock=clock())


def killed(host: str) -> FailureRecord:
    """A rank that died by itself: the job's root cause."""
    return FailureRecord(host=host, rank=0, signal="SIGKILL", time=1.0, kind=SIGNAL)


def broken(host: str) -> FailureRecord:
    """A rank whose collective broke: a peer failed first."""
    return FailureRecord(host=host, rank=1, exitcode=1, time=1.0, kind=BROKEN_COLLECTIVE)


def said(
    end: RoundEnd, first: RoundResult, result: RoundResult
) -> tuple[str | None, Restart, str, float]:
    """What a node says once ``result`` formed after ``first``: its console
    line, its ``restart`` event, that event in its metric, and its goodput
    failures (the ledger fed this node's two rounds, as the agent does)."""
    metrics = Metrics()
    event = end.restart(result)
    metrics.emit(event)
    (series,) = [ln for ln in metrics.render().decode().splitlines() if "restarts_total{" in ln]
    core = SimpleNamespace(clock=SimpleNamespace(monotonic=lambda: 0.0), metrics=None)
    goodput = GoodputAccounting(cast(Core, core))
    for r in (first, result):
        goodput.round(cast(WorkerGroup, SimpleNamespace(result=r)))
    return end.line(result), event, series, goodput.ledger.failures


def test_two_nodes_reporting_failures_for_one_round_say_its_one_charge() -> None:
    """Node a's rank is killed, node b's collective breaks: both report a
    failure for round 0. Round 1 charges one restart, and both nodes say
    that one: the same line, the same event, the count their workers get."""

    async def scenario() -> tuple[list[RoundEnd], list[RoundResult], list[RoundResult]]:
        store, run_id = MemoryStore(clock=clock()), f"j-{uuid.uuid4().hex[:6]}"
        a, b = (handler(store, run_id, n, 2) for n in ("a", "b"))
        first = await asyncio.wait_for(asyncio.gather(a.next_round(), b.next_round()), BOUND)
        failures = [killed("h-a"), broken("h-b")]
        await asyncio.gather(*(h.request_restart(f) for h, f in zip((a, b), failures, strict=True)))
        jobs = await asyncio.gather(
            *(h.job_failure(f, 15.0) for h, f in zip((a, b), failures, strict=True))
        )
        ends = [RoundEnd.failed(r, job, job) for r, job in zip(first, jobs, strict=True)]
        second = await asyncio.wait_for(asyncio.gather(a.next_round(), b.next_round()), BOUND)
        for h in (a, b):
            await h.shutdown()
        return ends, list(first), list(second)

    ends, first, second = run_virtual(scenario())
    # One charge: round 1's TORCHELASTIC_RESTART_COUNT (agent/env.py) is 1 on both.
    assert [(r.round, r.restart_count, r.charged) for r in second] == [(1, 1, True)] * 2
    told = [said(*x) for x in zip(ends, first, second, strict=True)]
    line = "elastrun: restarting workers (restart 1/3): rank 0 on h-a was killed by SIGKILL"
    assert [t[0] for t in told] == [line, line]
    assert [(t[1].round, t[1].count, t[1].counted, t[1].reason) for t in told] == [
        (0, 1, True, "worker_failed")
    ] * 2
    assert [t[2] for t in told] == [
        'elastrun_restarts_total{reason="worker_failed",counted="true"} 1'
    ] * 2
    assert [t[3] for t in told] == [1, 1]


def test_a_restart_collateral_to_a_lost_node_is_not_said_counted() -> None:
    """Node c vanishes from round 0; node a's collective broke before anyone
    saw c go, and a asks for the restart; b sees the round end for a's
    failure. Round 1 forms without c: nothing is charged (a lost node is no
    failure of the script), and neither a nor b says a counted restart."""

    async def scenario() -> tuple[list[RoundEnd], list[RoundResult], list[RoundResult]]:
        store, run_id = MemoryStore(clock=clock()), f"j-{uuid.uuid4().hex[:6]}"
        a, b, c = (handler(store, run_id, n, 3) for n in ("a", "b", "c"))
        first = await asyncio.wait_for(
            asyncio.gather(a.next_round(), b.next_round(), c.next_round()), BOUND
        )
        change = asyncio.create_task(b.wait_for_change())
        await a.request_restart(broken("h-a"))  # round 1 opens for a failure
        await c.keeper.stop(revoke=True)  # killed: its orphan guard revoked its lease
        ended = await asyncio.wait_for(change, BOUND)
        ends = [RoundEnd.failed(first[0], broken("h-a"), None), RoundEnd.changed(first[1], ended)]
        second = await asyncio.wait_for(asyncio.gather(a.next_round(), b.next_round()), BOUND)
        for h in (a, b, c):
            await h.shutdown()
        return ends, list(first[:2]), list(second)

    ends, first, second = run_virtual(scenario())
    assert ends[1].event.reason == "restart_requested" and ends[1].counts  # b was told of a failure
    assert [(r.round, r.restart_count, r.charged) for r in second] == [(1, 0, False)] * 2
    told = [said(*x) for x in zip(ends, first, second, strict=True)]
    not_counted = "elastrun: restarting workers (not counted: a node or the store's host was lost)"
    assert told[0][0] == f"{not_counted}: workers failed on this node"
    assert told[1][0] == f"{not_counted}: rank 1 on h-a exited with code 1"
    assert [(t[1].round, t[1].count, t[1].counted) for t in told] == [(0, 0, False)] * 2
    assert [t[2] for t in told] == [
        'elastrun_restarts_total{reason="worker_failed",counted="false"} 1',
        'elastrun_restarts_total{reason="restart_requested",counted="false"} 1',
    ]
    assert [t[3] for t in told] == [0, 0]


def test_only_the_round_a_restart_opened_charges_it() -> None:
    """A node that was not in the round its restart opened (it lost its
    lease, it was lost) joins a later one: that round's charge, if any, is of
    another failure, and this node's restart was not charged (a round closes
    charged only with every member of the round before back)."""
    r3 = RoundResult("job", 3, (), 0, "127.0.0.1", 29500, 2, 3, charged=True)
    assert r3.charges(2) and not r3.charges(1)
    assert not dataclasses.replace(r3, charged=False).charges(2)
