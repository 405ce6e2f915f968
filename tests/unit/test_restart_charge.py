"""When is a worker failure charged against the job's restart budget?

Pure tests of ``rounds.close_records`` / ``next_round_record``: the charge is
made when the round opened for the restart closes, and only if every member
of the previous round is back (a node that vanished breaks its peers'
collectives before its lease expires: their failures are collateral of a
membership change, which never counts).
"""

from __future__ import annotations

import dataclasses

from elastrun.failure import FailureRecord
from elastrun.rendezvous import rounds as R
from elastrun.rendezvous.records import JoinRecord, NodeInfo, ResultRecord, RoundRecord, RoundState
from elastrun.rendezvous.results import ResultHeader, ResultShard, load, stored_form


def joiner(node: str) -> JoinRecord:
    return JoinRecord(NodeInfo(node, node, "127.0.0.1", 1), port=29500)


def closed_round(nodes: list[str], restarts: int = 0) -> tuple[RoundRecord, ResultRecord]:
    rnd = dataclasses.replace(R.first_round(0.0), restarts=restarts)
    return R.close_records(rnd, [joiner(n) for n in nodes], 8, "test", 0.0)


def reopened(nodes: list[str], restarts: int = 0, counts: bool = True) -> RoundRecord:
    closed, result = closed_round(nodes, restarts)
    failure = FailureRecord(rank=1, host="b", exitcode=1)
    return R.next_round_record(
        closed, result, "restart_requested", "", counts=counts, failure=failure, opened_at=0.0
    )


def test_nothing_is_charged_when_the_round_opens() -> None:
    rec = reopened(["a", "b"])
    assert rec.restarts == 0
    assert rec.pending_failure is not None and rec.pending_failure.rank == 1


def test_failure_with_every_member_back_is_charged() -> None:
    closed, result = R.close_records(
        reopened(["a", "b"]), [joiner("a"), joiner("b")], 8, "", 0.0, max_restarts=3
    )
    assert closed.state is RoundState.CLOSED
    assert result.restarts == closed.restarts == 1
    assert result.charged is True
    assert closed.last_failure is not None and closed.last_failure.rank == 1


def test_failure_when_a_member_vanished_is_excused() -> None:
    closed, result = R.close_records(
        reopened(["a", "b", "c"]), [joiner("a"), joiner("b")], 8, "", 0.0, max_restarts=0
    )
    assert closed.state is RoundState.CLOSED  # even with max_restarts=0: the job goes on
    assert result.restarts == 0 and result.charged is False


def test_a_new_node_does_not_excuse_a_failure() -> None:
    rnd = reopened(["a", "b"])
    _, result = R.close_records(
        rnd, [joiner("a"), joiner("b"), joiner("c")], 8, "", 0.0, max_restarts=3
    )
    assert result.charged is True and result.restarts == 1


def test_membership_changes_are_never_charged() -> None:
    rnd = reopened(["a", "b"], counts=False)
    closed, result = R.close_records(rnd, [joiner("a"), joiner("b")], 8, "", 0.0, max_restarts=0)
    assert closed.state is RoundState.CLOSED and result.restarts == 0


def test_overspending_the_budget_fails_the_job() -> None:
    rnd = reopened(["a", "b"], restarts=2)
    closed, _ = R.close_records(rnd, [joiner("a"), joiner("b")], 8, "", 0.0, max_restarts=2)
    assert closed.state is RoundState.FAILED
    assert closed.restarts == 2  # the budget used, never more than the budget
    assert closed.last_failure is not None and closed.last_failure.rank == 1


def test_the_records_survive_the_store_as_they_were_built() -> None:
    """What a node writes is what the next node reads: every record of a
    restart, through its bytes, is equal to the one built."""
    rnd = reopened(["a", "b"])
    closed, result = R.close_records(rnd, [joiner("a"), joiner("b")], 8, "x", 5.0)
    for record in (rnd, closed):
        assert type(record).decode("/elastrun/j/round", record.encode()) == record
    header, (shard,) = stored_form(result, 1)  # the result: a header and its shard
    read = ResultHeader.decode("/elastrun/j/rounds/1/result", header.encode())
    part = ResultShard.decode("/elastrun/j/rounds/1/members/0", shard.encode(), read)
    assert load(read, [part], "the result") == result
