"""Reusing a job id: what a starting node does with what it finds.

The rule (the reuse table of ``rendezvous/register.py``) is pure and table-driven: every
combination of the job's records is checked here against the verdict a user
expects. Then in-process rendezvous handlers on the in-memory store (fast,
no processes) play the cases: a failed job's id, an abandoned job's id, a
finished job's id and a live job's id. The same with real agents on the
embedded store and on etcd: tests/integration/test_id_reuse.py.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest

from elastrun.errors import ConfigMismatch, RendezvousClosed, RestartBudgetExhausted
from elastrun.event_kinds import Event
from elastrun.events import EventSink
from elastrun.failure import FailureRecord
from elastrun.names import RunId
from elastrun.rendezvous.api import RendezvousHooks, RendezvousSettings
from elastrun.rendezvous.dynamic import DynamicRendezvous
from elastrun.rendezvous.records import AgreedSettings, ConfigRecord, RoundRecord, RoundState
from elastrun.rendezvous.register import TABLE, Verdict, classify, describe_reset
from elastrun.store.memory import MemoryStore

T = TypeVar("T")
CONFIG = ConfigRecord(AgreedSettings(1, 1, 1, 600.0, 30.0))
OPEN, CLOSED = RoundState.OPEN, RoundState.CLOSED
FINISHED, FAILED = RoundState.FINISHED, RoundState.FAILED
STATES = [None, OPEN, CLOSED, FINISHED, FAILED]

# (config present, round state, live nodes) -> the verdict a user expects.
EXPECTED: dict[tuple[bool, RoundState | None, int], tuple[Verdict, str]] = {
    # Nothing under the id: a new job.
    (False, None, 0): (Verdict.NEW, ""),
    (False, None, 2): (Verdict.NEW, ""),
    # Round records without settings: a live job is joined, remains are cleared.
    **{(False, s, 0): (Verdict.RESET, "leftover") for s in (OPEN, CLOSED)},
    **{(False, s, 2): (Verdict.JOIN, "") for s in (OPEN, CLOSED)},
    # A finished job stays finished (a pod restarted after completion exits 0).
    **{(c, FINISHED, n): (Verdict.FINISHED, "") for c in (False, True) for n in (0, 2)},
    # A failed job is over, even while its last nodes are still leaving.
    **{(c, FAILED, n): (Verdict.RESET, "failed") for c in (False, True) for n in (0, 2)},
    # Starting, open or running: joined while a node is alive, else abandoned.
    **{(True, s, 2): (Verdict.JOIN, "") for s in (None, OPEN, CLOSED)},
    **{(True, s, 0): (Verdict.RESET, "abandoned") for s in (None, OPEN, CLOSED)},
}


def test_every_combination_has_the_expected_verdict() -> None:
    combos = list(itertools.product([False, True], STATES, [0, 2]))
    assert set(combos) == set(EXPECTED)
    for has_config, state, live in combos:
        rnd = None if state is None else RoundRecord(3, state, restarts=1)
        found = classify(CONFIG if has_config else None, rnd, live)
        assert (found.verdict, found.why) == EXPECTED[(has_config, state, live)], (
            has_config,
            state,
            live,
        )


def test_the_table_rows_are_each_reachable() -> None:
    hit = set()
    for has_config, state, live in EXPECTED:
        rnd = None if state is None else RoundRecord(0, state)
        found = classify(CONFIG if has_config else None, rnd, live)
        hit.add((found.verdict, found.why))
    assert hit == {(row[3], row[4]) for row in TABLE}


def test_reset_lines_say_what_was_left_and_what_happens() -> None:
    failure = FailureRecord(rank=1, host="h", exitcode=3)
    failed = RoundRecord(2, FAILED, restarts=1, last_failure=failure)
    line = describe_reset("J", "failed", CONFIG, failed)
    assert "job 'J'" in line and "failed (1 of 1 restarts used" in line
    assert "rank 1 on h exited with code 3" in line
    assert "restart count 0" in line
    line = describe_reset("J", "abandoned", CONFIG, RoundRecord(4, OPEN, restarts=1))
    assert "no node left (round 4, 1 of 1 restarts used)" in line
    assert "left in the store" in describe_reset("J", "leftover", None, RoundRecord(0, OPEN))


# ---------------------------------------------- driven through real handlers
class Events(EventSink):
    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []

    def emit(self, event: Event) -> None:
        self.seen.append((event.KIND, event.to_json()))


def run(scenario: Callable[[], Awaitable[T]]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(scenario(), 20.0)

    return asyncio.run(bounded())


def handler(
    store: MemoryStore,
    node: str,
    *,
    max_nodes: int = 1,
    max_restarts: int = 1,
    min_nodes: int = 1,
    role: str = "default",
    nproc: int = 1,
    hint: int | None = None,
) -> tuple[DynamicRendezvous, Events, list[str]]:
    events, said = Events(), list[str]()
    h = DynamicRendezvous(
        store,
        RendezvousSettings(
            run_id=RunId("J"),
            min_nodes=min_nodes,
            role=role,
            nproc=nproc,
            node_rank_hint=hint,
            max_nodes=max_nodes,
            max_restarts=max_restarts,
            last_call_timeout=0.0,
            join_timeout=10.0,
            lease_ttl=5.0,
            host=node,
            addr="127.0.0.1",
        ),
        node_id=node,
        events=events,
    )
    h.attach(RendezvousHooks(notice=said.append))
    return h, events, said


async def fail_job(store: MemoryStore, max_restarts: int = 1) -> None:
    """A single-node job that spends its whole restart budget, then leaves."""
    old, _, _ = handler(store, "old", max_restarts=max_restarts)
    for _ in range(max_restarts + 1):
        await old.next_round()
        await old.request_restart(FailureRecord(rank=0, host="old", exitcode=1))
    with pytest.raises(RestartBudgetExhausted):
        await old.next_round()
    await old.shutdown()


def test_a_failed_jobs_id_starts_a_new_job_afresh() -> None:
    async def scenario() -> None:
        store = MemoryStore()
        await fail_job(store)
        # A new job under the same id, with other settings: 2 nodes, 3 restarts.
        new, events, said = handler(store, "new", max_nodes=2, max_restarts=3)
        result = await new.next_round()
        assert result.restart_count == 0 and result.round == 0
        assert result.max_restarts == 3
        assert len(said) == 1 and "failed (1 of 1 restarts used" in said[0]
        kinds = [k for k, _ in events.seen]
        assert "job_reset" in kinds and "config_mismatch" not in kinds
        reset = dict(events.seen)["job_reset"]
        assert reset["reason"] == "failed" and reset["previous_restarts"] == 1
        # Nothing of the old job is left: its rounds and results are gone.
        kvs, _ = await store.get_prefix("/elastrun/J/")
        assert not any("/rounds/1/" in kv.key for kv in kvs)
        # A second node of the new job joins it (no second reset).
        other, other_events, other_said = handler(store, "other", max_nodes=2, max_restarts=3)
        await new.request_restart(FailureRecord(rank=0, host="new", exitcode=1))
        both = await asyncio.gather(new.next_round(), other.next_round())
        assert {r.restart_count for r in both} == {1}
        assert not other_said and "job_reset" not in [k for k, _ in other_events.seen]
        await asyncio.gather(new.shutdown(), other.shutdown())

    run(scenario)


def test_an_abandoned_jobs_id_does_not_inherit_its_restart_count() -> None:
    async def scenario() -> None:
        store = MemoryStore()
        old, _, _ = handler(store, "old", max_restarts=1)
        await old.next_round()
        await old.request_restart(FailureRecord(rank=0, host="old", exitcode=1))
        assert (await old.next_round()).restart_count == 1
        await old.shutdown()  # the job is stopped (its one node is gone)
        new, events, said = handler(store, "new", max_restarts=1)
        result = await new.next_round()
        assert result.restart_count == 0
        assert dict(events.seen)["job_reset"]["reason"] == "abandoned"
        assert "no node left (round 1, 1 of 1 restarts used)" in said[0]
        await new.request_restart(FailureRecord(rank=0, host="new", exitcode=1))
        # Its first crash is its first restart, not the end of the job.
        assert (await new.next_round()).restart_count == 1
        await new.shutdown()

    run(scenario)


def test_a_live_job_is_joined_with_its_restart_count_and_settings() -> None:
    async def scenario() -> None:
        store = MemoryStore()
        a, _, _ = handler(store, "a", max_nodes=2, max_restarts=2)
        await a.next_round()
        await a.request_restart(FailureRecord(rank=0, host="a", exitcode=1))
        b, b_events, b_said = handler(store, "b", max_nodes=2, max_restarts=2)
        ra, rb = await asyncio.gather(a.next_round(), b.next_round())
        assert ra.restart_count == rb.restart_count == 1  # the live job's count
        assert not b_said and "job_reset" not in [k for k, _ in b_events.seen]
        c, _, _ = handler(store, "c", max_nodes=3, max_restarts=2)
        with pytest.raises(ConfigMismatch, match="nnodes: job has 1:2, this node has 1:3"):
            await c.next_round()
        await asyncio.gather(a.shutdown(), b.shutdown(), c.shutdown())

    run(scenario)


def test_nodes_of_other_roles_and_process_counts_form_one_world() -> None:
    """As torchrun: a master with 1 worker and a trainer with 2 are one world
    of 3, with ranks per role; a node with other agreed settings is refused."""

    async def scenario() -> None:
        store = MemoryStore()
        a, _, _ = handler(store, "a", min_nodes=2, max_nodes=2, role="master", nproc=1, hint=0)
        b, _, _ = handler(store, "b", min_nodes=2, max_nodes=2, role="trainer", nproc=2, hint=1)
        ra, rb = await asyncio.gather(a.next_round(), b.next_round())
        assert [(m.role, m.nproc) for m in ra.members] == [("master", 1), ("trainer", 2)]
        places = [
            (r.me.role, r.world_size, r.rank_offset, r.role_rank_offset, r.role_world_size)
            for r in (ra, rb)
        ]
        assert places == [("master", 3, 0, 0, 1), ("trainer", 3, 1, 0, 2)]
        c, _, _ = handler(store, "c", min_nodes=2, max_nodes=2, max_restarts=5, role="master")
        with pytest.raises(ConfigMismatch, match="max_restarts: job has 1, this node has 5"):
            await c.next_round()
        await asyncio.gather(a.shutdown(), b.shutdown(), c.shutdown())

    run(scenario)


def test_a_finished_jobs_id_has_nothing_to_do() -> None:
    async def scenario() -> None:
        store = MemoryStore()
        a, _, _ = handler(store, "a")
        await a.next_round()
        await a.complete()
        await a.shutdown()
        for max_nodes in (1, 4):  # even with other settings
            again, events, said = handler(store, "again", max_nodes=max_nodes)
            with pytest.raises(RendezvousClosed, match="finished earlier; to run it again"):
                await again.next_round()
            assert not said and "job_reset" not in [k for k, _ in events.seen]
            await again.shutdown()
        kv = await store.get("/elastrun/J/round")
        assert kv is not None and RoundRecord.decode(kv.key, kv.value).state is FINISHED

    run(scenario)
