"""The exit barrier's rule rows (COMPLETING): pure, no store."""

from __future__ import annotations

from dataclasses import replace

import pytest

from elastrun.errors import RendezvousClosed
from elastrun.rendezvous.protocol import (
    Action,
    Arm,
    BarrierDone,
    BarrierTimeout,
    Cancel,
    Context,
    Event,
    LeaseLost,
    MarkFinished,
    MemberLost,
    NextRound,
    OpenRound,
    PutDone,
    Raise,
    RenewLease,
    Return,
    RoundClosed,
    RoundFailed,
    RoundFinished,
    RoundOpen,
    State,
    Timer,
    WorkersSucceeded,
)
from elastrun.rendezvous.rules import Rules

CTX = Context(min_nodes=2, max_nodes=4, exit_barrier_timeout=300.0, round=3)


def completing() -> Rules:
    m = Rules(replace(CTX), State.MEMBER)
    m.handle(WorkersSucceeded(now=10.0))
    return m


def st(m: Rules) -> State:
    return m.state  # (a call, so that mypy does not narrow the state between steps)


def types(actions: list[Action]) -> list[type[Action]]:
    return [type(a) for a in actions]


def test_workers_succeeded_puts_done_and_arms_the_barrier() -> None:
    m = Rules(replace(CTX), State.MEMBER)
    actions = m.handle(WorkersSucceeded(now=10.0))
    assert st(m) is State.COMPLETING
    assert actions == [PutDone(3), Arm(Timer.BARRIER, 310.0)]


def test_barrier_done_marks_the_round_finished_once() -> None:
    m = completing()
    actions = m.handle(BarrierDone())
    assert actions == [Cancel(Timer.BARRIER), MarkFinished(3), Return()]
    assert m.state is State.FINISHED


def test_member_lost_at_the_barrier_reopens_the_round_and_leaves() -> None:
    # The watcher (or a member watching it) is the only one to see the loss:
    # opening R+1 is how the members that watch only ``round`` learn of it.
    m = completing()
    actions = m.handle(MemberLost(detail="node h (n1) lost: lease expired"))
    assert st(m) is State.FINISHED
    opened = OpenRound(3, "member_lost", "node h (n1) lost: lease expired", counts=False)
    assert actions == [Cancel(Timer.BARRIER), opened, Return()]


@pytest.mark.parametrize("ev", [RoundOpen(round=4), RoundFinished(round=3), RoundFailed(round=3)])
def test_what_others_write_on_round_ends_the_barrier_without_writing(ev: Event) -> None:
    m = completing()
    actions = m.handle(ev)
    assert st(m) is State.FINISHED and types(actions) == [Cancel, Return]


def test_own_round_closed_again_keeps_waiting_a_newer_one_leaves() -> None:
    m = completing()
    assert m.handle(RoundClosed(round=3)) == []
    assert st(m) is State.COMPLETING
    actions = m.handle(RoundClosed(round=5))
    assert st(m) is State.FINISHED and types(actions)[-1] is Return


def test_barrier_timeout_leaves_without_finishing_or_reopening() -> None:
    m = completing()
    actions = m.handle(BarrierTimeout())
    assert st(m) is State.FINISHED and types(actions) == [Cancel, Return]


def test_lease_lost_at_the_barrier_renews_and_keeps_waiting() -> None:
    m = completing()
    assert types(m.handle(LeaseLost(detail=""))) == [RenewLease]
    assert st(m) is State.COMPLETING


def test_after_the_barrier_the_job_is_closed_to_this_node() -> None:
    m = completing()
    m.handle(BarrierDone())
    assert m.handle(NextRound(now=0.0)) == [Raise(3, RendezvousClosed)]


def test_docstring_describes_the_barrier_protocol() -> None:
    import elastrun.rendezvous.rules as mod

    doc = " ".join((mod.__doc__ or "").split())
    for words in ("barrier watcher", "O(1)-byte read", "OPEN_ROUND(member_lost)"):
        assert words in doc
