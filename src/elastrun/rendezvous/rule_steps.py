"""What each rule of the rendezvous machine does: one pure function per row
of :data:`.rules.RULES`, (context, event) -> (state, context, actions).

A rule's docstring's first paragraph is its row of the table in
:mod:`.rules`' docstring (rendered by tests/unit/rdzv_table.py, kept equal by
a test), which names each action in capitals (``OPEN_ROUND``: :class:`~.protocol.OpenRound`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from elastrun.errors import RendezvousTimeout
from elastrun.rendezvous.protocol import (
    Action,
    Arm,
    BarrierDone,
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
    MarkFinished,
    MemberLost,
    NextRound,
    NodeWaiting,
    OpenRound,
    PutDone,
    Raise,
    RaisedError,
    ReadRound,
    RenewLease,
    Return,
    ReturnChange,
    ReturnResult,
    Revoke,
    RoundClosed,
    RoundOpen,
    Shutdown,
    State,
    Timer,
    Wait,
    WorkersFailed,
    WorkersSucceeded,
)

__all__ = [
    "Rule",
    "Step",
    "barrier_done",
    "barrier_leave",
    "barrier_lost",
    "cancel_last_call",
    "completing_closed",
    "completing_renew",
    "decide",
    "deciding",
    "join",
    "join_timeout",
    "joiners_changed",
    "joining_closed",
    "joining_open",
    "last_call_expired",
    "member_closed",
    "member_lease_lost",
    "member_lost",
    "member_open",
    "next_round",
    "node_waiting",
    "raising",
    "renew",
    "seeking_closed",
    "shutdown",
    "stay_in",
    "wait",
    "waiting_closed",
    "waiting_lost",
    "workers_failed",
    "workers_succeeded",
]

# What a rule returns: the next state, the next context, the actions to carry out.
Step = tuple[State, Context, list[Action]]
# A rule takes the event of the class it is filed under in RULES. Its
# docstring's first paragraph is its row of the table (see render_table).
Rule = Callable[[Context, Any], Step]

S = State


def raising(state: State, error: RaisedError) -> Rule:
    def rule(ctx: Context, ev: Event) -> Step:
        return state, ctx, [Raise(round=ctx.round, error=error)]

    rule.__doc__ = f"{state.name}: RAISE({error.__name__})"
    return rule


def stay_in(state: State, why: str = "") -> Rule:
    def rule(ctx: Context, ev: Event) -> Step:
        return state, ctx, []

    rule.__doc__ = f"{state.name} ({why})" if why else state.name
    return rule


def next_round(ctx: Context, ev: NextRound) -> Step:
    """SEEKING: CANCEL(last_call), ARM(join), READ_ROUND"""
    deadline = ev.now + ctx.join_timeout
    return (
        S.SEEKING,
        replace(ctx, min_reached_at=None, count=0, spare=False),
        [
            Cancel(timer=Timer.LAST_CALL),
            Arm(timer=Timer.JOIN, deadline=deadline),
            ReadRound(),
        ],
    )


def join(ctx: Context, ev: RoundOpen, pre: list[Action] | None = None) -> Step:
    """JOINING: JOIN(R) (+ ARM(join) *it waited as a spare)"""
    fresh = replace(ctx, round=ev.round, min_reached_at=None, count=0, spare=False)
    acts = [*(pre or [])]
    if ctx.spare:
        acts.append(Arm(timer=Timer.JOIN, deadline=ev.now + ctx.join_timeout))
    return S.JOINING, fresh, [*acts, Join(round=ev.round)]


def wait(ctx: Context, ev: RoundClosed, pre: list[Action] | None = None) -> Step:
    acts = [*(pre or []), Wait(round=ev.round)]
    spare = False
    if ev.lost:
        acts.append(OpenRound(round=ev.round, reason="member_lost", detail=ev.lost))
    elif ev.room:
        acts.append(OpenRound(round=ev.round, reason="node_waiting", detail=ev.detail))
    elif ctx.spares_wait:
        # A hot spare waits as long as the job runs: no join timeout.
        acts.append(Cancel(timer=Timer.JOIN))
        spare = True
    waiting = replace(ctx, round=ev.round, min_reached_at=None, count=0, spare=spare)
    return S.WAITING, waiting, acts


def seeking_closed(ctx: Context, ev: RoundClosed) -> Step:
    """*me: SEEKING: OPEN_ROUND(member_rejoined); *not me: WAITING: WAIT
    (+ OPEN_ROUND(member_lost) *a member is gone, or OPEN_ROUND(node_waiting)
    *room, or CANCEL(join) *a spare: a node unit, no room)"""
    if ev.member:
        # Asked for a new round while a member of the current one (the agent
        # lost its workers without a restart): open the next one.
        act = OpenRound(round=ev.round, reason="member_rejoined", detail=ev.detail)
        return S.SEEKING, replace(ctx, round=ev.round), [act]
    return wait(ctx, ev)


def renew(ctx: Context, ev: LeaseLost) -> Step:
    """SEEKING: RENEW_LEASE, READ_ROUND"""
    return S.SEEKING, ctx, [RenewLease(), ReadRound()]


def decide(ctx: Context, ev: JoinersChanged) -> Step:
    """DECIDING: CLOSE_ROUND *max joined and no present member of the
    previous round is yet to join, or *a re-formed round that every present
    node joined, or *min joined and its last call (counted from when min was
    reached) passed; else ARM(last_call) *min joined, else CANCEL(last_call)"""
    count = ev.count
    if count < ctx.min_nodes:
        ctx = replace(ctx, min_reached_at=None, count=count)
        return S.DECIDING, ctx, [Cancel(timer=Timer.LAST_CALL)]
    reached = ctx.min_reached_at if ctx.min_reached_at is not None else ev.now
    ctx = replace(ctx, min_reached_at=reached, count=count)
    deadline = reached + ctx.last_call_timeout
    if count >= ctx.max_nodes and not ev.members_pending:
        why = "max_nodes"
    elif ev.all_joined:
        why = "all_rejoined"
    elif ev.now >= deadline:
        why = "last_call"
    else:
        return S.DECIDING, ctx, [Arm(timer=Timer.LAST_CALL, deadline=deadline)]
    close = CloseRound(round=ctx.round, reason=why)
    return S.DECIDING, ctx, [Cancel(timer=Timer.LAST_CALL), close]


def joiners_changed(ctx: Context, ev: JoinersChanged) -> Step:
    """*decider: as DECIDING; else JOINING (notes when min was reached)"""
    if ev.decider:
        return decide(ctx, ev)
    # Track when min was reached (for the waiting line); only the decider acts.
    if ev.count >= ctx.min_nodes:
        reached = ctx.min_reached_at if ctx.min_reached_at is not None else ev.now
    else:
        reached = None
    return S.JOINING, replace(ctx, min_reached_at=reached, count=ev.count), []


def last_call_expired(ctx: Context, ev: LastCallExpired) -> Step:
    """DECIDING: CLOSE_ROUND(last_call) *min joined"""
    if ctx.count >= ctx.min_nodes:
        return S.DECIDING, ctx, [CloseRound(round=ctx.round, reason="last_call")]
    return S.DECIDING, ctx, []


def joining_open(ctx: Context, ev: RoundOpen) -> Step:
    """*newer R: JOINING: JOIN(R); else JOINING"""
    if ev.round > ctx.round:
        return join(ctx, ev, cancel_last_call(ctx))
    return S.JOINING, ctx, []


def cancel_last_call(ctx: Context) -> list[Action]:
    return [Cancel(timer=Timer.LAST_CALL)]


def joining_closed(ctx: Context, ev: RoundClosed) -> Step:
    """*me: MEMBER: CANCEL(join), RETURN_RESULT; *not me: WAITING: WAIT
    (+ OPEN_ROUND *a member is gone or *room, or CANCEL(join) *a spare)"""
    pre = cancel_last_call(ctx)
    if ev.member:
        return (
            S.MEMBER,
            replace(ctx, round=ev.round),
            [*pre, Cancel(timer=Timer.JOIN), ReturnResult(round=ev.round)],
        )
    return wait(ctx, ev, pre)


def join_timeout(ctx: Context, ev: JoinTimeout) -> Step:
    """IDLE: LEAVE, RAISE(RendezvousTimeout)"""
    return (
        S.IDLE,
        ctx,
        [
            *cancel_last_call(ctx),
            Leave(round=ctx.round),
            Raise(round=ctx.round, error=RendezvousTimeout),
        ],
    )


def waiting_closed(ctx: Context, ev: RoundClosed) -> Step:
    """*newer R, not me: WAITING: WAIT (+ OPEN_ROUND, or CANCEL(join) *a
    spare); else WAITING"""
    if ev.round > ctx.round and not ev.member:
        return wait(ctx, ev)
    return S.WAITING, ctx, []


def waiting_lost(ctx: Context, ev: MemberLost) -> Step:
    """WAITING: OPEN_ROUND(member_lost)"""
    act = OpenRound(round=ctx.round, reason="member_lost", detail=ev.detail)
    return S.WAITING, ctx, [act]


def member_closed(ctx: Context, ev: RoundClosed) -> Step:
    """*newer R: IDLE: RETURN_CHANGE (re-formed without this node); else MEMBER"""
    if ev.round > ctx.round:
        return S.IDLE, ctx, [ReturnChange(round=ev.round)]
    return S.MEMBER, ctx, []


def member_open(ctx: Context, ev: RoundOpen) -> Step:
    """IDLE: RETURN_CHANGE (someone opened R+1)"""
    return S.IDLE, ctx, [ReturnChange(round=ev.round)]


def member_lost(ctx: Context, ev: MemberLost) -> Step:
    """MEMBER: OPEN_ROUND(member_lost)"""
    act = OpenRound(round=ctx.round, reason="member_lost", detail=ev.detail)
    return S.MEMBER, ctx, [act]


def node_waiting(ctx: Context, ev: NodeWaiting) -> Step:
    """MEMBER: OPEN_ROUND(node_waiting) *room"""
    if not ev.room:
        return S.MEMBER, ctx, []
    act = OpenRound(round=ctx.round, reason="node_waiting", detail=ev.detail)
    return S.MEMBER, ctx, [act]


def workers_failed(ctx: Context, ev: WorkersFailed) -> Step:
    """MEMBER: OPEN_ROUND(restart_requested, counts): the restart is charged
    when R+1 closes with every member of R back (else a lost node caused it:
    not counted); a charge past the budget closes R+1 as failed"""
    # Always re-form, even with no budget left: whether the failure counts is
    # decided when the next round closes (a lost node excuses it; see
    # records.close_records), and an overspent budget fails the job then.
    act = OpenRound(round=ctx.round, reason="restart_requested", detail=ev.detail, counts=True)
    return S.MEMBER, ctx, [act]


def workers_succeeded(ctx: Context, ev: WorkersSucceeded) -> Step:
    """COMPLETING: PUT_DONE, ARM(barrier)"""
    deadline = ev.now + ctx.exit_barrier_timeout
    return (
        S.COMPLETING,
        ctx,
        [
            PutDone(round=ctx.round),
            Arm(timer=Timer.BARRIER, deadline=deadline),
        ],
    )


def member_lease_lost(ctx: Context, ev: LeaseLost) -> Step:
    """IDLE: RETURN_CHANGE(lease_lost) (the workers stop at once; the next
    round's registration gets a new lease)"""
    return S.IDLE, ctx, [ReturnChange(round=ctx.round, reason="lease_lost", detail=ev.detail)]


def barrier_done(ctx: Context, ev: BarrierDone) -> Step:
    """FINISHED: CANCEL(barrier), MARK_FINISHED, RETURN"""
    return S.FINISHED, ctx, [Cancel(timer=Timer.BARRIER), MarkFinished(round=ctx.round), Return()]


def barrier_lost(ctx: Context, ev: MemberLost) -> Step:
    """FINISHED: CANCEL(barrier), OPEN_ROUND(member_lost), RETURN (the barrier
    can never complete; opening R+1 tells the members that watch only
    ``round``)"""
    acts: list[Action] = [
        Cancel(timer=Timer.BARRIER),
        OpenRound(round=ctx.round, reason="member_lost", detail=ev.detail),
        Return(),
    ]
    return S.FINISHED, ctx, acts


def barrier_leave(ctx: Context, ev: Event) -> Step:
    """FINISHED: CANCEL(barrier), RETURN"""
    return S.FINISHED, ctx, [Cancel(timer=Timer.BARRIER), Return()]


def completing_closed(ctx: Context, ev: RoundClosed) -> Step:
    """*newer R: FINISHED: CANCEL(barrier), RETURN; else COMPLETING"""
    if ev.round > ctx.round:
        return barrier_leave(ctx, ev)
    return S.COMPLETING, ctx, []


def completing_renew(ctx: Context, ev: LeaseLost) -> Step:
    """COMPLETING: RENEW_LEASE"""
    return S.COMPLETING, ctx, [RenewLease()]


def shutdown(ctx: Context, ev: Shutdown) -> Step:
    """LEFT: CANCEL(every timer), REVOKE"""
    acts = [Cancel(timer=t) for t in Timer]
    return S.LEFT, ctx, [*acts, Revoke()]


def deciding(rule: Rule) -> Rule:
    """A JOINING rule applied in DECIDING (the decider leaves the same ways)."""

    def wrapped(ctx: Context, ev: Event) -> Step:
        state, new_ctx, acts = rule(ctx, ev)
        if state is S.JOINING and not any(isinstance(a, Join) for a in acts):
            state = S.DECIDING
        return state, new_ctx, acts

    wrapped.__doc__ = "as in JOINING (staying DECIDING where JOINING stays)"
    return wrapped
