"""The job's root cause across nodes: the first failure any node reported,
unless a later one is stronger evidence.

The rule (``first_failure``, as a table of cases), the round record's
reporters (``rendezvous/root_cause.report`` on a real in-memory store), the
wait for the other members (``settle``), and the summary of a node whose
ranks failed after another node's."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

import pytest

from elastrun.agent.failures import (
    COLLATERAL,
    ROOT_CAUSE,
    WorkerFailure,
    classify,
    elsewhere,
    failure_kind,
    format_summary,
)
from elastrun.failure import (
    BROKEN_COLLECTIVE,
    ERROR,
    HANG,
    SIGNAL,
    FailureRecord,
    first_failure,
    same_failure,
    weight,
)
from elastrun.names import RunId
from elastrun.rendezvous import keys as K
from elastrun.rendezvous import rounds as R
from elastrun.rendezvous.records import JoinRecord, NodeInfo, RoundRecord, RoundState
from elastrun.rendezvous.root_cause import report, settle
from elastrun.store.memory import MemoryStore

KEYS = K.Keys(RunId.parse("job", "--rdzv-id"))


def crash(
    host: str, rank: int, at: float, role: str = ROOT_CAUSE, kind: str = ERROR
) -> FailureRecord:
    return FailureRecord(host=host, rank=rank, exitcode=1, time=at, role=role, kind=kind)


def broke(host: str, rank: int, at: float) -> FailureRecord:
    """A rank whose collective broke (a peer's connection closed)."""
    return crash(host, rank, at, kind=BROKEN_COLLECTIVE)


def killed(host: str, rank: int, at: float) -> FailureRecord:
    """A rank SIGKILLed (an OOM kill): it said nothing before it died."""
    return FailureRecord(host=host, rank=rank, signal="SIGKILL", time=at, role=ROOT_CAUSE,
                         kind=SIGNAL)  # fmt: skip


# The rule, as a table: (kept: the failure the round keeps, reported first in
# the store's order; reported: one reported after it; the job's root cause).
# The records' times are other nodes' wall clocks: they never decide.
CASES = {
    "error": crash("a", 2, 10.0),
    "error later": crash("b", 0, 10.5),
    "error earlier": crash("b", 0, 9.5),
    "error, same time": crash("b", 0, 10.0),
    "killed": killed("b", 1, 10.0),
    "killed, later time": killed("b", 1, 11.0),
    "killed, same time": killed("a", 1, 10.0),
    "broke": broke("a", 0, 10.0),
    "broke, earlier time": broke("a", 0, 9.0),
    "broke, same time": broke("b", 3, 10.0),
    "hang": FailureRecord(
        host="b",
        rank=1,
        time=12.0,
        role=ROOT_CAUSE,
        kind=HANG,
        hang="rank 1 made no progress for 60 s",
    ),
    "stopped": crash("a", 1, 1.0, role=COLLATERAL, kind=SIGNAL),
    "older record": FailureRecord(host="b", rank=0, exitcode=1, time=1.0, role=ROOT_CAUSE),
}
RULE = [
    # A tie, in time or in evidence: the one kept (reported first) stays.
    ("error", "error, same time", "error"),
    ("killed, same time", "error", "killed, same time"),
    ("broke", "broke, same time", "broke"),
    # First reported wins among equals, whatever the clocks say.
    ("error", "error earlier", "error"),
    ("error later", "error", "error later"),
    ("killed, later time", "error", "killed, later time"),
    # A broken collective reported first loses to the failure that broke it.
    ("broke", "killed, later time", "killed, later time"),
    ("broke, earlier time", "error later", "error later"),
    ("broke", "hang", "hang"),
    ("broke", "older record", "older record"),
    # ... and a real failure reported first stays.
    ("killed", "broke, earlier time", "killed"),
    ("error", "broke, earlier time", "error"),
    # A node whose ranks the agent stopped ranks below both.
    ("stopped", "broke", "broke"),
    ("stopped", "killed", "killed"),
    ("broke", "stopped", "broke"),
    ("error", "stopped", "error"),
]


@pytest.mark.parametrize(("kept", "reported", "job"), RULE, ids=[f"{k}+{r}" for k, r, _ in RULE])
def test_the_rule_keeps_the_first_report_unless_a_later_one_is_stronger(
    kept: str, reported: str, job: str
) -> None:
    assert first_failure(CASES[kept], CASES[reported]) is CASES[job]


def test_with_one_record_it_is_the_root_cause() -> None:
    assert first_failure(None, CASES["broke"]) is CASES["broke"]
    assert first_failure(CASES["broke"], None) is CASES["broke"]
    assert first_failure(None, None) is None


def test_the_evidence_of_each_kind() -> None:
    assert [weight(CASES[k]) for k in ("error", "killed", "hang", "older record")] == [0, 0, 0, 0]
    assert weight(CASES["broke"]) == 1
    assert weight(CASES["stopped"]) == 2


def test_a_failure_read_back_from_the_store_is_the_same() -> None:
    rec = killed("b", 1, 10.0)
    back = FailureRecord.from_json(json.loads(json.dumps(rec.to_json())))
    assert same_failure(rec, back)
    assert not same_failure(rec, killed("a", 1, 10.0))
    assert not same_failure(rec, None) and same_failure(None, None)


def test_a_rank_declared_failed_while_it_runs_is_the_same_failure_once_stopped() -> None:
    """A hang or an expired file timer is reported before the rank is stopped
    (no exit yet); the node's record after the stop has the signal. Read back
    from the store, the first is still this node's own failure."""
    declared = FailureRecord(host="a", rank=1, local_rank=1, pid=42, kind=HANG, hang="timer")
    stopped = FailureRecord(
        host="a", rank=1, local_rank=1, pid=42, signal="SIGKILL", kind=HANG, hang="timer"
    )
    back = FailureRecord.from_json(json.loads(json.dumps(declared.to_json())))
    assert same_failure(back, stopped)
    assert not same_failure(back, FailureRecord(host="a", rank=1, local_rank=1, pid=43))


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


def test_a_sigkill_reported_after_the_collective_it_broke_becomes_the_jobs() -> None:
    """The race of the issue: node 0's broken collective reaches the store
    first, with the same time as node 1's SIGKILLed rank; the round keeps
    the killed rank, and both nodes read it."""

    async def run() -> None:
        store = MemoryStore()
        collateral = broke("host0", 0, 10.0)  # reported first
        root = killed("host1", 1, 10.0)  # the same time (milliseconds), reported second
        await _reopened(store, "n0", collateral)
        job = await report(store, KEYS, "n1", 0, root)
        assert job == root
        rec = await _round(store)
        assert rec.pending_failure == root
        assert rec.reporters == ("n0", "n1")
        assert rec.detail == root.describe()
        # A second report changes nothing.
        assert await report(store, KEYS, "n1", 0, crash("host1", 2, 1.0)) == root
        for node in ("n0", "n1"):
            found = await settle(store, KEYS, node, 0, timeout=5.0)
            assert found.failure == root and found.awaited == ()

    asyncio.run(run())


def test_a_failure_reported_later_with_an_earlier_time_does_not_replace_the_first() -> None:
    """Times are other nodes' clocks: the store's order decides."""

    async def run() -> None:
        store = MemoryStore()
        first = crash("host1", 2, 10.0)
        await _reopened(store, "n1", first)
        assert await report(store, KEYS, "n0", 0, crash("host0", 0, 9.0)) == first
        assert (await _round(store)).detail == first.describe()
        assert (await settle(store, KEYS, "n0", 0, timeout=5.0)).failure == first

    asyncio.run(run())


def test_settle_waits_for_a_member_that_has_not_reported() -> None:
    """While the round keeps only a broken collective, the root cause is
    likely a member that has not reported yet (a SIGKILLed rank)."""

    async def run() -> None:
        store = MemoryStore()
        collateral, root = broke("host0", 0, 10.5), killed("host1", 1, 10.0)
        await _reopened(store, "n0", collateral)
        waiting = asyncio.create_task(settle(store, KEYS, "n0", 0, timeout=60.0))
        await asyncio.sleep(0)
        assert not waiting.done()
        await report(store, KEYS, "n1", 0, root)
        found = await asyncio.wait_for(waiting, 30.0)
        assert found.failure == root

    asyncio.run(run())


def test_settle_ends_at_once_when_no_later_report_can_replace_the_failure_kept() -> None:
    async def run() -> None:
        store = MemoryStore()
        root = killed("host1", 1, 10.0)
        await _reopened(store, "n1", root)
        found = await asyncio.wait_for(settle(store, KEYS, "n1", 0, timeout=3600.0), 30.0)
        assert found.failure == root and found.awaited == ("n0",)

    asyncio.run(run())


def test_settle_gives_up_at_its_timeout_and_names_who_did_not_report() -> None:
    async def run() -> None:
        store = MemoryStore()
        late = broke("host0", 0, 10.5)
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


GLOO = (
    "RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
    "closed by peer [127.0.0.1]:2478. This is typically caused by a remote worker crashing."
)


@pytest.mark.parametrize(
    ("rc", "hang", "lines", "kind"),
    [
        (-9, False, (), SIGNAL),  # an OOM kill: nothing said
        (-9, False, ("step 5", "loss 0.1"), SIGNAL),
        (1, False, ("Traceback (most recent call last):", "ValueError: boom"), ERROR),
        (1, False, ("Traceback (most recent call last):", GLOO), BROKEN_COLLECTIVE),
        # The gloo error, then an abort in the teardown: still a broken collective.
        (-6, False, (GLOO, "terminate called without an active exception"), BROKEN_COLLECTIVE),
        (
            1,
            False,
            ("torch.distributed.DistNetworkError: Connection reset by peer",),
            BROKEN_COLLECTIVE,
        ),
        (
            1,
            False,
            ("ncclRemoteError: ... a remote process exiting prematurely.",),
            BROKEN_COLLECTIVE,
        ),
        (
            -6,
            False,
            (
                "[Rank 0] Watchdog caught collective operation timeout: "
                "WorkNCCL(SeqNum=7, OpType=ALLREDUCE) ran for 600000 milliseconds",
            ),
            BROKEN_COLLECTIVE,
        ),
        # An old warning, many lines before the rank's own error, is not its error.
        (1, False, (GLOO, "a", "b", "c", "d", "e", "ValueError: boom"), ERROR),
        (-15, True, (GLOO,), HANG),
    ],
)
def test_the_kind_of_a_ranks_failure(
    rc: int, hang: bool, lines: tuple[str, ...], kind: str
) -> None:
    assert failure_kind(rc, hang=hang, error_lines=lines) == kind


def test_the_record_of_a_rank_whose_collective_broke_says_so() -> None:
    f = classify([replace(_failure(0), stderr_tail=("Traceback ...", GLOO))])[0]
    assert f.record().kind == BROKEN_COLLECTIVE
    assert f.record().role == ROOT_CAUSE  # its node's own: the store decides across nodes
    gone = replace(_failure(1), returncode=-9, stderr_tail=())
    assert classify([gone])[0].record().kind == SIGNAL
