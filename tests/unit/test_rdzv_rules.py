"""The rendezvous rules table: every transition, the decider's choices, and
every (state, event) pair that is not in the table."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from typing import Any

import pytest

from elastrun.errors import RendezvousClosed, RendezvousTimeout, RestartBudgetExhausted
from elastrun.names import RunId
from elastrun.rendezvous.protocol import (
    ACTIONS,
    EVENTS,
    Action,
    Arm,
    BarrierDone,
    BarrierTimeout,
    Cancel,
    CloseRound,
    Context,
    Event,
    Join,
    JoinersChanged,
    JoinTimeout,
    LastCallExpired,
    LeaseLost,
    Leave,
    LocalProtocolError,
    MarkFinished,
    MemberLost,
    NextRound,
    NodeWaiting,
    OpenRound,
    PutDone,
    Raise,
    ReadRound,
    RenewLease,
    Return,
    ReturnChange,
    ReturnResult,
    Revoke,
    RoundClosed,
    RoundFailed,
    RoundFinished,
    RoundOpen,
    Shutdown,
    State,
    Timer,
    Wait,
    WorkersFailed,
    WorkersSucceeded,
)
from elastrun.rendezvous.rules import RULES, Rules

CTX = Context(min_nodes=2, max_nodes=4, max_restarts=1, join_timeout=60, last_call_timeout=5)


def machine(state: State, **ctx: Any) -> Rules:
    return Rules(replace(CTX, round=3, **ctx), state)


def st(m: Rules) -> State:
    return m.state  # (a call, so that mypy does not narrow the state between steps)


def acts(actions: list[Action]) -> list[type[Action]]:
    return [type(a) for a in actions]


# One event of each class, with its fields' plain values.
SAMPLE: dict[type[Event], Event] = {
    NextRound: NextRound(now=100.0),
    RoundOpen: RoundOpen(round=3),
    RoundClosed: RoundClosed(round=3),
    RoundFinished: RoundFinished(round=3),
    RoundFailed: RoundFailed(round=3),
    JoinersChanged: JoinersChanged(now=100.0, count=0),
    LastCallExpired: LastCallExpired(),
    JoinTimeout: JoinTimeout(),
    MemberLost: MemberLost(detail=""),
    NodeWaiting: NodeWaiting(room=False, detail=""),
    WorkersFailed: WorkersFailed(detail=""),
    WorkersSucceeded: WorkersSucceeded(now=100.0),
    BarrierDone: BarrierDone(),
    BarrierTimeout: BarrierTimeout(),
    LeaseLost: LeaseLost(detail=""),
    Shutdown: Shutdown(),
}
TABLE = sorted(RULES, key=lambda k: (k[0].value, k[1].__name__))


def test_every_event_class_is_listed() -> None:
    assert set(SAMPLE) == set(EVENTS) == set(Event.__subclasses__())


@pytest.mark.parametrize(("state", "ev"), TABLE)
def test_every_table_entry_runs(state: State, ev: type[Event]) -> None:
    m = machine(state, count=2)
    actions = m.handle(SAMPLE[ev])
    assert isinstance(m.state, State)
    assert all(isinstance(a, ACTIONS) for a in actions)


BAD = [(s, e) for s, e in itertools.product(State, EVENTS) if (s, e) not in RULES]


@pytest.mark.parametrize(("state", "ev"), BAD)
def test_pairs_outside_the_table_are_errors(state: State, ev: type[Event]) -> None:
    m = machine(state)
    with pytest.raises(LocalProtocolError, match=ev.__name__):
        m.handle(SAMPLE[ev])
    assert st(m) is state


def test_bad_pairs_exist_for_every_terminal_state() -> None:
    assert (State.LEFT, NextRound) in BAD
    assert (State.FINISHED, WorkersFailed) in BAD
    assert (State.JOINING, LastCallExpired) in BAD


def test_next_round_arms_join_timeout_and_seeks() -> None:
    m = machine(State.IDLE)
    actions = m.handle(NextRound(now=10.0))
    assert st(m) is State.SEEKING
    arm = next(a for a in actions if isinstance(a, Arm))
    assert arm.timer is Timer.JOIN and arm.deadline == 70.0


def test_seeking_joins_an_open_round() -> None:
    m = machine(State.SEEKING)
    actions = m.handle(RoundOpen(round=5))
    assert st(m) is State.JOINING and m.ctx.round == 5
    assert acts(actions) == [Join]


def test_closed_round_without_me_waits_and_opens_when_room() -> None:
    m = machine(State.SEEKING)
    actions = m.handle(RoundClosed(round=5, room=True, detail="x waits"))
    assert st(m) is State.WAITING
    assert acts(actions) == [Wait, OpenRound]
    assert actions[1] == OpenRound(5, "node_waiting", "x waits")
    m = machine(State.SEEKING)
    assert acts(m.handle(RoundClosed(round=5, room=False))) == [Wait]


def test_waiting_node_opens_when_a_member_is_gone() -> None:
    m = machine(State.SEEKING)
    actions = m.handle(RoundClosed(round=5, lost="node b lost"))
    assert actions[-1] == OpenRound(5, "member_lost", "node b lost")
    m = machine(State.WAITING)
    actions = m.handle(MemberLost(detail="node b lost"))
    assert actions == [OpenRound(3, "member_lost", "node b lost")]


def test_member_asking_again_opens_a_new_round() -> None:
    m = machine(State.SEEKING)
    actions = m.handle(RoundClosed(round=3, member=True))
    assert st(m) is State.SEEKING
    assert isinstance(actions[0], OpenRound) and actions[0].reason == "member_rejoined"


def test_follower_tracks_but_does_not_act() -> None:
    m = machine(State.JOINING)
    assert m.handle(JoinersChanged(now=1.0, count=3)) == []
    assert st(m) is State.JOINING and m.ctx.min_reached_at == 1.0
    m.handle(JoinersChanged(now=2.0, count=1))
    assert m.ctx.min_reached_at is None


def test_decider_closes_at_max_at_once() -> None:
    m = machine(State.JOINING)
    actions = m.handle(JoinersChanged(now=1.0, count=4, decider=True))
    assert st(m) is State.DECIDING
    assert CloseRound in acts(actions)


def test_decider_waits_the_last_call_from_when_min_was_reached() -> None:
    m = machine(State.DECIDING)
    actions = m.handle(JoinersChanged(now=10.0, count=2, decider=True))
    assert acts(actions) == [Arm]
    assert actions == [Arm(Timer.LAST_CALL, 15.0)]
    # A third joiner does not push the deadline back.
    actions = m.handle(JoinersChanged(now=12.0, count=3, decider=True))
    assert actions == [Arm(Timer.LAST_CALL, 15.0)]
    actions = m.handle(LastCallExpired())
    assert acts(actions) == [CloseRound]


def test_decider_closes_when_the_deadline_already_passed() -> None:
    m = machine(State.DECIDING, min_reached_at=0.0)
    actions = m.handle(JoinersChanged(now=6.0, count=2, decider=True))
    assert CloseRound in acts(actions)


def test_decider_skips_last_call_when_everyone_rejoined() -> None:
    m = machine(State.DECIDING)
    ev = JoinersChanged(now=1.0, count=3, decider=True, all_joined=True)
    actions = m.handle(ev)
    close = next(a for a in actions if isinstance(a, CloseRound))
    assert close.reason == "all_rejoined"


def test_decider_below_min_cancels_last_call() -> None:
    m = machine(State.DECIDING, min_reached_at=1.0, count=2)
    actions = m.handle(JoinersChanged(now=2.0, count=1, decider=True))
    assert acts(actions) == [Cancel] and m.ctx.min_reached_at is None
    assert m.handle(LastCallExpired()) == []


def test_round_closed_with_me_returns_the_result() -> None:
    for state in (State.JOINING, State.DECIDING):
        m = machine(state)
        actions = m.handle(RoundClosed(round=3, member=True))
        assert st(m) is State.MEMBER
        assert acts(actions)[-1] is ReturnResult


def test_round_closed_without_me_while_joining_waits() -> None:
    m = machine(State.DECIDING)
    actions = m.handle(RoundClosed(round=3, member=False, room=False))
    assert st(m) is State.WAITING and Wait in acts(actions)


def test_join_timeout_leaves_and_raises() -> None:
    for state in (State.JOINING, State.DECIDING, State.WAITING):
        m = machine(state)
        actions = m.handle(JoinTimeout())
        assert st(m) is State.IDLE
        assert actions[-2:] == [Leave(3), Raise(3, RendezvousTimeout)]


def test_member_reacts_to_loss_and_waiting_nodes() -> None:
    m = machine(State.MEMBER)
    assert m.handle(MemberLost(detail="d")) == [OpenRound(3, "member_lost", "d")]
    assert m.handle(NodeWaiting(room=False, detail="")) == []
    assert m.handle(NodeWaiting(room=True, detail="")) == [OpenRound(3, "node_waiting", "")]
    assert st(m) is State.MEMBER
    assert acts(m.handle(RoundOpen(round=4))) == [ReturnChange]
    assert st(m) is State.IDLE


def test_member_of_a_superseded_round_returns_a_change() -> None:
    m = machine(State.MEMBER)
    assert m.handle(RoundClosed(round=3)) == []
    assert acts(m.handle(RoundClosed(round=4))) == [ReturnChange]


def test_failed_workers_always_reform_and_the_close_decides_the_charge() -> None:
    m = machine(State.MEMBER)
    for _ in range(3):  # even with the budget spent: a lost node may excuse it
        actions = m.handle(WorkersFailed(detail=""))
        assert actions == [OpenRound(3, "restart_requested", "", counts=True)]
    assert m.handle(RoundFailed(round=3)) == [Raise(3, RestartBudgetExhausted)]
    assert st(m) is State.FAILED
    assert m.handle(NextRound(now=0.0)) == [Raise(3, RestartBudgetExhausted)]


def test_restart_after_the_round_moved_on_is_not_counted() -> None:
    m = machine(State.IDLE)
    assert m.handle(WorkersFailed(detail="")) == []


def test_exit_barrier() -> None:
    m = machine(State.MEMBER)
    actions = m.handle(WorkersSucceeded(now=1.0))
    assert st(m) is State.COMPLETING and acts(actions) == [PutDone, Arm]
    assert actions[1] == Arm(Timer.BARRIER, 1.0 + CTX.exit_barrier_timeout)
    actions = m.handle(BarrierDone())
    assert MarkFinished in acts(actions) and st(m) is State.FINISHED
    assert m.handle(NextRound(now=0.0)) == [Raise(3, RendezvousClosed)]


def test_barrier_timeout_does_not_finish_the_job() -> None:
    m = machine(State.COMPLETING)
    actions = m.handle(BarrierTimeout())
    assert MarkFinished not in acts(actions) and acts(actions)[-1] is Return


def test_shutdown_revokes_from_anywhere_and_is_idempotent() -> None:
    for state in State:
        m = machine(state)
        actions = m.handle(Shutdown())
        assert st(m) is State.LEFT
        if state is not State.LEFT:
            assert acts(actions)[-1] is Revoke
    assert machine(State.LEFT).handle(Shutdown()) == []


def test_lease_lost_while_running_is_a_change() -> None:
    # The change first and nothing before it: the workers stop at once, even
    # while the store is unreachable; the next round's registration renews.
    m = machine(State.MEMBER)
    actions = m.handle(LeaseLost(detail="gone"))
    assert acts(actions) == [ReturnChange] and st(m) is State.IDLE
    m = machine(State.JOINING)
    assert acts(m.handle(LeaseLost(detail=""))) == [RenewLease, ReadRound]
    assert st(m) is State.SEEKING


def test_docstring_lists_every_state() -> None:
    import elastrun.rendezvous.rules as mod

    doc = mod.__doc__ or ""
    for state in State:
        assert state.name in doc
    for ev in EVENTS:
        assert ev.__name__ in doc


def test_close_timeout_is_per_node_not_agreed() -> None:
    from elastrun.rendezvous.api import RendezvousSettings
    from elastrun.rendezvous.records import ConfigRecord
    from elastrun.rendezvous.rounds import config_diff

    a = RendezvousSettings(run_id=RunId("j"), min_nodes=1, max_nodes=2, close_timeout=5.0)
    b = RendezvousSettings(run_id=RunId("j"), min_nodes=1, max_nodes=2, close_timeout=50.0)
    assert "close_timeout" not in a.agreed().to_json()
    assert config_diff("j", a.agreed(), b.agreed()) is None
    # A job record written with close_timeout in it (older nodes) still agrees.
    older = {"settings": {**a.agreed().to_json(), "close_timeout": 60.0}}
    assert config_diff("j", ConfigRecord.from_json(older).settings, b.agreed()) is None


@pytest.mark.parametrize(
    ("rc", "hang"),
    [(1, None), (-9, None), (0, "rank 2 made no progress for 30 s (last step 7)")],
)
def test_the_restart_reason_every_node_prints_is_the_failing_nodes_line(
    rc: int, hang: str | None
) -> None:
    """The new round's detail, built from the failure record in the store, is
    the line the failing node's agent prints (so every node prints the same)."""
    from elastrun.agent.failures import WorkerFailure, failure_record
    from elastrun.failure import FailureRecord, describe_stored

    f = WorkerFailure(
        rank=2, local_rank=0, host="host-a", pid=7, returncode=rc, exit_time=0.0,
        exit_monotonic=0.0, hang=hang,
    )  # fmt: skip
    mine = failure_record([f], "host-a")
    record = json.loads(json.dumps(mine.to_json()))  # as stored and read by another node
    words = {1: "rank 2 on host-a exited with code 1", -9: "rank 2 on host-a was killed by SIGKILL"}
    assert mine.describe() == words.get(rc, f"{hang} on host-a")
    assert describe_stored(record) == mine.describe()
    assert FailureRecord.from_json(record) == mine
    m = machine(State.MEMBER)
    actions = m.handle(WorkersFailed(detail=describe_stored(record)))
    opened = [a for a in actions if isinstance(a, OpenRound)]
    assert [a.detail for a in opened] == [mine.describe()]


def test_the_docstrings_table_is_the_rendering_of_rules() -> None:
    """The module docstring's table is RULES rendered, not a hand-kept copy:
    on a change of the rules, paste ``render_table()``'s output into it."""
    import elastrun.rendezvous.rules as mod
    from tests.unit.rdzv_table import render_table

    table = render_table()
    assert table in (mod.__doc__ or ""), f"the rules table changed; it is now:\n{table}"
    # Every rule has its own words in the table (no row without text).
    assert all(
        len(line.split(None, 2)) == 3 for line in table.splitlines()[3:-1] if line[:1] != " "
    )


def test_the_rendering_follows_the_rules() -> None:
    """A rule changed in RULES shows in the rendering (it is not fixed text)."""
    from tests.unit.rdzv_table import render_table

    def _hold(ctx: Context, ev: Event) -> tuple[State, Context, list[Action]]:
        """MEMBER: nothing at all"""
        return State.MEMBER, ctx, []

    changed: dict[tuple[State, type[Event]], Any] = {**RULES, (State.MEMBER, NodeWaiting): _hold}
    rows = [r for r in render_table(changed).splitlines() if "NodeWaiting" in r]
    assert rows == [f"{'MEMBER':<12} {'NodeWaiting':<16} MEMBER: nothing at all"]


def test_every_action_is_one_class_named_in_the_table() -> None:
    """``Action`` is the union of the action classes (the driver matches on
    it: mypy checks that every class has its case), and the rules' table names
    each in capitals (``OPEN_ROUND``: ``OpenRound``)."""
    import re
    import typing

    import elastrun.rendezvous.rules as mod

    assert set(typing.get_args(Action)) == set(ACTIONS)
    doc = mod.__doc__ or ""
    for cls in ACTIONS:
        assert re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__).upper() in doc, cls
