"""The job's root cause across nodes: the first failure any node reported.

The order of two nodes' failures (``first_failure``), the round record's
reporters (``rendezvous/root_cause.report`` on a real in-memory store), the
wait for the other members (``settle``), and the summary of a node whose
ranks failed after another node's."""

from __future__ import annotations

import asyncio
from typing import Any

from elastrun.agent.failures import (
    COLLATERAL,
    ROOT_CAUSE,
    WorkerFailure,
    classify,
    elsewhere,
    format_summary,
)
from elastrun.failure import FailureRecord, first_failure
from elastrun.names import RunId
from elastrun.rendezvous import keys as K
from elastrun.rendezvous import rounds as R
from elastrun.rendezvous.records import JoinRecord, NodeInfo, RoundRecord, RoundState
from elastrun.rendezvous.root_cause import report, settle
from elastrun.store.memory import MemoryStore

KEYS = K.Keys(RunId.parse("job", "--rdzv-id"))


def crash(host: str, rank: int, at: float, role: str = ROOT_CAUSE) -> FailureRecord:
    return FailureRecord(host=host, rank=rank, exitcode=1, time=at, role=role)


def test_the_earlier_failure_is_first_whichever_is_given_first() -> None:
    a, b = crash("a", 2, 100.0), crash("b", 0, 100.5)
    assert first_failure(a, b) is a
    assert first_failure(b, a) is a
    assert first_failure(None, b) is b and first_failure(a, None) is a


def test_a_failure_the_agent_caused_never_comes_first() -> None:
    stopped = crash("a", 1, 1.0, role=COLLATERAL)
    own = crash("b", 0, 9.0)
    assert first_failure(stopped, own) is own


def test_on_a_tie_the_record_kept_stays() -> None:
    a, b = crash("a", 0, 5.0), crash("b", 1, 5.0)
    assert first_failure(a, b) is a


def test_reporters_round_trip_through_the_record() -> None:
    rec = RoundRecord(round=3, state=RoundState.OPEN, counts=True, reporters=("n1", "n2"))
    assert RoundRecord.from_json(rec.to_json()).reporters == ("n1", "n2")


async def _reopened(store: MemoryStore, opener: str, failure: FailureRecord) -> None:
    """Round 0 closed with members n0 and n1; ``opener`` opened round 1 for ``failure``."""
    joins = [JoinRecord(NodeInfo(n, n, "127.0.0.1", 1), port=1) for n in ("n0", "n1")]
    closed, result = R.close_records(R.first_round(0.0), joins, 8, "test", 0.0)
    new = R.next_round_record(
        closed,
        result,
        "restart_requested",
        failure.describe(),
        counts=True,
        failure=failure,
        opened_at=0.0,
        reporter=opener,
    )
    await store.put(KEYS.round, new.encode())
    for n in ("n0", "n1"):
        await store.put(KEYS.node(n), b"{}")


async def _round(store: MemoryStore) -> RoundRecord:
    kv = await store.get(KEYS.round)
    assert kv is not None
    return RoundRecord.decode(kv.key, kv.value)


def test_a_later_report_of_an_earlier_failure_becomes_the_jobs() -> None:
    async def run() -> None:
        store = MemoryStore()
        late = crash("host0", 0, 10.5)  # its collective broke: reported first
        first = crash("host1", 2, 10.0)  # the crash: reported second
        await _reopened(store, "n0", late)
        job = await report(store, KEYS, "n1", 0, first)
        assert job == first
        rec = await _round(store)
        assert rec.pending_failure == first
        assert rec.reporters == ("n0", "n1")
        assert rec.detail == first.describe()
        # A second report changes nothing; a later failure does not replace it.
        assert await report(store, KEYS, "n1", 0, crash("host1", 2, 1.0)) == first
        found = await settle(store, KEYS, "n0", 0, timeout=5.0)
        assert found.failure == first and found.awaited == ()

    asyncio.run(run())


def test_a_later_failure_does_not_replace_the_first() -> None:
    async def run() -> None:
        store = MemoryStore()
        first = crash("host1", 2, 10.0)
        await _reopened(store, "n1", first)
        assert await report(store, KEYS, "n0", 0, crash("host0", 0, 10.5)) == first
        assert (await _round(store)).detail == first.describe()

    asyncio.run(run())


def test_settle_waits_for_a_member_that_has_not_reported() -> None:
    async def run() -> None:
        store = MemoryStore()
        late, first = crash("host0", 0, 10.5), crash("host1", 2, 10.0)
        await _reopened(store, "n0", late)
        waiting = asyncio.create_task(settle(store, KEYS, "n0", 0, timeout=60.0))
        await asyncio.sleep(0)
        assert not waiting.done()
        await report(store, KEYS, "n1", 0, first)
        found = await asyncio.wait_for(waiting, 30.0)
        assert found.failure == first

    asyncio.run(run())


def test_settle_gives_up_at_its_timeout_and_names_who_did_not_report() -> None:
    async def run() -> None:
        store = MemoryStore()
        late = crash("host0", 0, 10.5)
        await _reopened(store, "n0", late)
        found = await settle(store, KEYS, "n0", 0, timeout=0.0)
        assert found.failure == late and found.awaited == ("n1",)
        # A member that is gone (no presence key) is not waited for.
        await store.delete(KEYS.node("n1"))
        found = await settle(store, KEYS, "n0", 0, timeout=60.0)
        assert found.awaited == ()

    asyncio.run(run())


def test_a_round_opened_for_a_membership_change_takes_no_report() -> None:
    async def run() -> None:
        store = MemoryStore()
        await _reopened(store, "n0", crash("host0", 0, 1.0))
        rec = await _round(store)
        changed = RoundRecord(round=rec.round, state=rec.state, prev=rec.prev, counts=False)
        await store.put(KEYS.round, changed.encode())
        assert await report(store, KEYS, "n1", 0, crash("host1", 2, 0.5)) is None
        assert (await _round(store)).pending_failure is None

    asyncio.run(run())


def _failure(rank: int) -> WorkerFailure:
    return WorkerFailure(
        rank=rank,
        local_rank=0,
        host="host0",
        pid=100 + rank,
        returncode=1,
        exit_time=1.0,
        exit_monotonic=1.0,
        stderr_tail=("RuntimeError: Connection closed by peer",),
    )


def test_summary_names_the_other_nodes_rank_as_the_root_cause() -> None:
    peer = FailureRecord(
        host="host1",
        rank=2,
        exitcode=1,
        time=1.0,
        role=ROOT_CAUSE,
        message="ValueError: boom",
        stderr_tail=("Traceback ...", "ValueError: boom"),
        stderr_log="/logs/2/stderr.log",
    )
    failures = elsewhere(classify([_failure(0)]))
    assert [f.role for f in failures] == [COLLATERAL]
    text = format_summary(failures, "header", peer=peer)
    assert "[ROOT CAUSE] on another node: rank 2 on host1 exited with code 1" in text
    assert "  error: ValueError: boom" in text
    assert "full log on host1: /logs/2/stderr.log" in text
    assert "[collateral (failed after the root cause)] rank 0" in text
    assert text.index("[ROOT CAUSE]") < text.index("[collateral")


def test_summary_shows_the_ranks_last_output_not_stale_stderr() -> None:
    f = WorkerFailure(
        rank=1,
        local_rank=1,
        host="h",
        pid=7,
        returncode=3,
        exit_time=1.0,
        exit_monotonic=1.0,
        stderr_tail=("warming up",),
        stdout_tail=("step 1", "step 2 loss nan"),
        output_tail=("warming up", "step 1", "step 2 loss nan"),
    )
    text = format_summary(classify([f]), "header")
    block = text.split("[ROOT CAUSE]", 1)[1]
    assert "last 3 lines of its output (stdout and stderr, in order):" in block
    assert block.index("warming up") < block.index("step 2 loss nan")


def test_the_error_not_the_teardown_noise_after_it_is_the_message() -> None:
    """A rank whose script raised, then aborted in its teardown (a C++ thread
    still joinable): its record says the error."""
    f = WorkerFailure(
        rank=2,
        local_rank=1,
        host="h",
        pid=7,
        returncode=-6,
        exit_time=1.0,
        exit_monotonic=1.0,
        stderr_tail=(
            "Traceback (most recent call last):",
            "ValueError: boom",
            "terminate called without an active exception",
        ),
    )
    assert f.record().message == "ValueError: boom"


class StuckStore(MemoryStore):
    """A store that stopped answering (etcd without quorum): reads never return."""

    async def txn(self, compares: Any, success: Any, failure: Any = ()) -> Any:
        await asyncio.Event().wait()


def test_settle_is_bounded_when_the_store_stops_answering() -> None:
    async def run() -> None:
        found = await asyncio.wait_for(settle(StuckStore(), KEYS, "n0", 0, timeout=0.1), 30.0)
        assert found.failure is None

    asyncio.run(run())
