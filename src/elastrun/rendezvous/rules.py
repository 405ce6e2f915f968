"""The dynamic rendezvous as a pure state machine: (state, event) -> (state, actions).

Theory of operation
-------------------
Modelled on h11's ``_state.py``: this module does no I/O, owns no clock and
knows nothing of the store. The driver (:mod:`elastrun.rendezvous.dynamic`)
turns what it observes (the job's ``round`` record, join keys, presence keys,
done keys, deadlines passing, calls from the agent) into events -- one class
per event, each with only its own fields (:mod:`.protocol`) -- feeds them to
:meth:`Rules.handle`, and executes the :class:`Action` values it gets back.
Every write the driver makes to the job's ``round`` record comes back to it
through a watch as an ordinary event, so the machine learns the outcome of a
compare-and-set the same way whether this node or another node won it.

One node's life::

    IDLE --NextRound--> SEEKING --RoundOpen--> JOINING <--> DECIDING
                           |                      |  (decider = live joiner
                           |                      |   with the smallest join revision)
                           +--RoundClosed(not me)--> WAITING --RoundOpen--> JOINING
                                                  |
                         JOINING/DECIDING --RoundClosed(me)--> MEMBER
    MEMBER --MemberLost/NodeWaiting/WorkersFailed--> (opens R+1) --RoundOpen--> IDLE
    MEMBER --WorkersSucceeded--> COMPLETING --BarrierDone--> FINISHED
                                 (--MemberLost--> opens R+1, FINISHED)
    any --Shutdown--> LEFT

Only the decider closes a round: at once when ``max`` nodes joined (in a
re-formed round, once every present member of the previous round joined
too, so that a survivor never loses its place to a spare); when at least
``min`` joined, after ``last_call_timeout`` counted on its own monotonic
clock from when it saw ``min`` reached -- or at once when this is a re-formed
round (there was a previous round) and every node present in the job has
joined (nobody is left to wait for, so recovery pays no last call).

The exit barrier (COMPLETING) costs O(n) store traffic and watch events per
round, not O(n^2): a member whose workers succeeded puts its done key, then
counts the done keys (one O(1)-byte read); the member whose count reaches the
round's size -- the last to finish, in revision order -- feeds BarrierDone
and marks the job finished (CAS on ``round``). Everyone waits on ``round``
alone, plus one more key: the round's *barrier watcher* is the first member in
rank order whose presence key exists (normally group rank 0). The watcher reads
and watches the done keys and every presence key (O(n) events, for one node):
it finishes the job when the last done key appears (should the last finisher
die before its CAS), and it alone notices a member lost during the barrier
(presence gone, no done key), whereupon it opens R+1 (``member_lost``) so that
the others, which see R+1 on ``round``, leave too. Every other member watches
only the watcher's presence key: gone without a done key, the watcher is lost
(MemberLost: open R+1, leave); gone with one (it left the barrier: timed out
or shut down), the driver sets its phase up again and the next member in rank
order takes the role. Any member may mark finished or open R+1: both are CAS on
a closed ``round`` R, so two nodes that both believe they are the watcher are
harmless. The role is chosen by the planner (:func:`.plan.barrier_step`), as
the decider is (:func:`.plan.join_role`).

Rules table (state, event) -> next state: actions, rendered from ``RULES`` by
:func:`.table.render_table` (a unit test keeps the two equal). ``*`` marks conditions;
RAISE names the exception raised.

============ ================ =====================================================================
state        event            next state: actions
============ ================ =====================================================================
IDLE         NextRound        SEEKING: CANCEL(last_call), ARM(join), READ_ROUND (also from SEEKING,
                              JOINING, DECIDING, WAITING, MEMBER)
IDLE         WorkersFailed    IDLE (the round already moved on: not counted twice)
any but LEFT Shutdown         LEFT: CANCEL(every timer), REVOKE
SEEKING      RoundOpen        JOINING: JOIN(R) (+ ARM(join) *it waited as a spare) (also from
                              WAITING)
SEEKING      RoundClosed      *me: SEEKING: OPEN_ROUND(member_rejoined); *not me: WAITING: WAIT (+
                              OPEN_ROUND(member_lost) *a member is gone, or
                              OPEN_ROUND(node_waiting) *room, or CANCEL(join) *a spare: a node
                              unit, no room)
SEEKING      RoundFinished    FINISHED: RAISE(RendezvousClosed)
SEEKING      RoundFailed      FAILED: RAISE(RestartBudgetExhausted)
SEEKING      JoinTimeout      IDLE: RAISE(RendezvousTimeout)
SEEKING      LeaseLost        SEEKING: RENEW_LEASE, READ_ROUND (also from JOINING, WAITING)
JOINING      RoundOpen        *newer R: JOINING: JOIN(R); else JOINING
JOINING      RoundClosed      *me: MEMBER: CANCEL(join), RETURN_RESULT; *not me: WAITING: WAIT (+
                              OPEN_ROUND *a member is gone or *room, or CANCEL(join) *a spare)
JOINING      RoundFinished    FINISHED: RAISE(RendezvousClosed)
JOINING      RoundFailed      FAILED: RAISE(RestartBudgetExhausted)
JOINING      JoinersChanged   *decider: as DECIDING; else JOINING (notes when min was reached)
JOINING      JoinTimeout      IDLE: LEAVE, RAISE(RendezvousTimeout) (also from WAITING)
DECIDING     RoundOpen        as in JOINING (staying DECIDING where JOINING stays)
DECIDING     RoundClosed      as in JOINING (staying DECIDING where JOINING stays)
DECIDING     RoundFinished    as in JOINING (staying DECIDING where JOINING stays)
DECIDING     RoundFailed      as in JOINING (staying DECIDING where JOINING stays)
DECIDING     JoinersChanged   DECIDING: CLOSE_ROUND *max joined and no present member of the
                              previous round is yet to join, or *a re-formed round that every
                              present node joined, or *min joined and its last call (counted from
                              when min was reached) passed; else ARM(last_call) *min joined, else
                              CANCEL(last_call)
DECIDING     LastCallExpired  DECIDING: CLOSE_ROUND(last_call) *min joined
DECIDING     JoinTimeout      as in JOINING (staying DECIDING where JOINING stays)
DECIDING     LeaseLost        as in JOINING (staying DECIDING where JOINING stays)
WAITING      RoundClosed      *newer R, not me: WAITING: WAIT (+ OPEN_ROUND, or CANCEL(join) *a
                              spare); else WAITING
WAITING      RoundFinished    FINISHED: RAISE(RendezvousClosed)
WAITING      RoundFailed      FAILED: RAISE(RestartBudgetExhausted)
WAITING      MemberLost       WAITING: OPEN_ROUND(member_lost)
MEMBER       RoundOpen        IDLE: RETURN_CHANGE (someone opened R+1)
MEMBER       RoundClosed      *newer R: IDLE: RETURN_CHANGE (re-formed without this node); else
                              MEMBER
MEMBER       RoundFinished    FINISHED: RAISE(RendezvousClosed)
MEMBER       RoundFailed      FAILED: RAISE(RestartBudgetExhausted)
MEMBER       MemberLost       MEMBER: OPEN_ROUND(member_lost)
MEMBER       NodeWaiting      MEMBER: OPEN_ROUND(node_waiting) *room
MEMBER       WorkersFailed    MEMBER: OPEN_ROUND(restart_requested, counts): the restart is charged
                              when R+1 closes with every member of R back (else a lost node caused
                              it: not counted); a charge past the budget closes R+1 as failed
MEMBER       WorkersSucceeded COMPLETING: PUT_DONE, ARM(barrier)
MEMBER       LeaseLost        IDLE: RETURN_CHANGE(lease_lost) (the workers stop at once; the next
                              round's registration gets a new lease)
COMPLETING   RoundOpen        FINISHED: CANCEL(barrier), RETURN
COMPLETING   RoundClosed      *newer R: FINISHED: CANCEL(barrier), RETURN; else COMPLETING
COMPLETING   RoundFinished    FINISHED: CANCEL(barrier), RETURN
COMPLETING   RoundFailed      FINISHED: CANCEL(barrier), RETURN
COMPLETING   MemberLost       FINISHED: CANCEL(barrier), OPEN_ROUND(member_lost), RETURN (the
                              barrier can never complete; opening R+1 tells the members that watch
                              only ``round``)
COMPLETING   BarrierDone      FINISHED: CANCEL(barrier), MARK_FINISHED, RETURN
COMPLETING   BarrierTimeout   FINISHED: CANCEL(barrier), RETURN
COMPLETING   LeaseLost        COMPLETING: RENEW_LEASE
FINISHED     NextRound        FINISHED: RAISE(RendezvousClosed)
FAILED       NextRound        FAILED: RAISE(RestartBudgetExhausted)
FAILED       WorkersFailed    FAILED: RAISE(RestartBudgetExhausted)
LEFT         Shutdown         LEFT
============ ================ =====================================================================

Any other (state, event) pair is a bug in the driver and raises
:class:`LocalProtocolError`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from elastrun.errors import RendezvousClosed, RendezvousTimeout, RestartBudgetExhausted
from elastrun.rendezvous.protocol import (
    EVENTS,
    TIMER_EVENTS,
    Act,
    Action,
    BarrierDone,
    BarrierTimeout,
    Context,
    Event,
    JoinersChanged,
    JoinTimeout,
    LastCallExpired,
    LeaseLost,
    LocalProtocolError,
    MemberLost,
    NextRound,
    NodeWaiting,
    RaisedError,
    RoundClosed,
    RoundFailed,
    RoundFinished,
    RoundOpen,
    Shutdown,
    State,
    Timer,
    WorkersFailed,
    WorkersSucceeded,
)

__all__ = [
    "EVENTS",
    "RULES",
    "TIMER_EVENTS",
    "Act",
    "Action",
    "BarrierDone",
    "BarrierTimeout",
    "Context",
    "Event",
    "JoinTimeout",
    "JoinersChanged",
    "LastCallExpired",
    "LeaseLost",
    "LocalProtocolError",
    "MemberLost",
    "NextRound",
    "NodeWaiting",
    "RoundClosed",
    "RoundFailed",
    "RoundFinished",
    "RoundOpen",
    "Rules",
    "Shutdown",
    "State",
    "Timer",
    "WorkersFailed",
    "WorkersSucceeded",
]


Outcome = tuple[State, Context, list[Action]]
# A rule takes the event of the class it is filed under in RULES. Its
# docstring's first paragraph is its row of the table (see render_table).
Rule = Callable[[Context, Any], Outcome]

S = State


def _raise(state: State, error: RaisedError) -> Rule:
    def rule(ctx: Context, ev: Event) -> Outcome:
        return state, ctx, [Action(Act.RAISE, round=ctx.round, error=error)]

    rule.__doc__ = f"{state.name}: RAISE({error.__name__})"
    return rule


def _stay_in(state: State, why: str = "") -> Rule:
    def rule(ctx: Context, ev: Event) -> Outcome:
        return state, ctx, []

    rule.__doc__ = f"{state.name} ({why})" if why else state.name
    return rule


def _next_round(ctx: Context, ev: NextRound) -> Outcome:
    """SEEKING: CANCEL(last_call), ARM(join), READ_ROUND"""
    deadline = ev.now + ctx.join_timeout
    return (
        S.SEEKING,
        replace(ctx, min_reached_at=None, count=0, spare=False),
        [
            Action(Act.CANCEL, timer=Timer.LAST_CALL),
            Action(Act.ARM, timer=Timer.JOIN, deadline=deadline),
            Action(Act.READ_ROUND),
        ],
    )


def _join(ctx: Context, ev: RoundOpen, pre: list[Action] | None = None) -> Outcome:
    """JOINING: JOIN(R) (+ ARM(join) *it waited as a spare)"""
    fresh = replace(ctx, round=ev.round, min_reached_at=None, count=0, spare=False)
    acts = [*(pre or [])]
    if ctx.spare:
        acts.append(Action(Act.ARM, timer=Timer.JOIN, deadline=ev.now + ctx.join_timeout))
    return S.JOINING, fresh, [*acts, Action(Act.JOIN, round=ev.round)]


def _wait(ctx: Context, ev: RoundClosed, pre: list[Action] | None = None) -> Outcome:
    acts = [*(pre or []), Action(Act.WAIT, round=ev.round)]
    spare = False
    if ev.lost:
        acts.append(Action(Act.OPEN_ROUND, round=ev.round, reason="member_lost", detail=ev.lost))
    elif ev.room:
        acts.append(Action(Act.OPEN_ROUND, round=ev.round, reason="node_waiting", detail=ev.detail))
    elif ctx.spares_wait:
        # A hot spare waits as long as the job runs: no join timeout.
        acts.append(Action(Act.CANCEL, timer=Timer.JOIN))
        spare = True
    waiting = replace(ctx, round=ev.round, min_reached_at=None, count=0, spare=spare)
    return S.WAITING, waiting, acts


def _seeking_closed(ctx: Context, ev: RoundClosed) -> Outcome:
    """*me: SEEKING: OPEN_ROUND(member_rejoined); *not me: WAITING: WAIT
    (+ OPEN_ROUND(member_lost) *a member is gone, or OPEN_ROUND(node_waiting)
    *room, or CANCEL(join) *a spare: a node unit, no room)"""
    if ev.member:
        # Asked for a new round while a member of the current one (the agent
        # lost its workers without a restart): open the next one.
        act = Action(Act.OPEN_ROUND, round=ev.round, reason="member_rejoined", detail=ev.detail)
        return S.SEEKING, replace(ctx, round=ev.round), [act]
    return _wait(ctx, ev)


def _renew(ctx: Context, ev: LeaseLost) -> Outcome:
    """SEEKING: RENEW_LEASE, READ_ROUND"""
    return S.SEEKING, ctx, [Action(Act.RENEW_LEASE), Action(Act.READ_ROUND)]


def _decide(ctx: Context, ev: JoinersChanged) -> Outcome:
    """DECIDING: CLOSE_ROUND *max joined and no present member of the
    previous round is yet to join, or *a re-formed round that every present
    node joined, or *min joined and its last call (counted from when min was
    reached) passed; else ARM(last_call) *min joined, else CANCEL(last_call)"""
    count = ev.count
    if count < ctx.min_nodes:
        ctx = replace(ctx, min_reached_at=None, count=count)
        return S.DECIDING, ctx, [Action(Act.CANCEL, timer=Timer.LAST_CALL)]
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
        return S.DECIDING, ctx, [Action(Act.ARM, timer=Timer.LAST_CALL, deadline=deadline)]
    close = Action(Act.CLOSE_ROUND, round=ctx.round, reason=why)
    return S.DECIDING, ctx, [Action(Act.CANCEL, timer=Timer.LAST_CALL), close]


def _joiners_changed(ctx: Context, ev: JoinersChanged) -> Outcome:
    """*decider: as DECIDING; else JOINING (notes when min was reached)"""
    if ev.decider:
        return _decide(ctx, ev)
    # Track when min was reached (for the waiting line); only the decider acts.
    if ev.count >= ctx.min_nodes:
        reached = ctx.min_reached_at if ctx.min_reached_at is not None else ev.now
    else:
        reached = None
    return S.JOINING, replace(ctx, min_reached_at=reached, count=ev.count), []


def _last_call_expired(ctx: Context, ev: LastCallExpired) -> Outcome:
    """DECIDING: CLOSE_ROUND(last_call) *min joined"""
    if ctx.count >= ctx.min_nodes:
        return S.DECIDING, ctx, [Action(Act.CLOSE_ROUND, round=ctx.round, reason="last_call")]
    return S.DECIDING, ctx, []


def _joining_open(ctx: Context, ev: RoundOpen) -> Outcome:
    """*newer R: JOINING: JOIN(R); else JOINING"""
    if ev.round > ctx.round:
        return _join(ctx, ev, _cancel_last_call(ctx))
    return S.JOINING, ctx, []


def _cancel_last_call(ctx: Context) -> list[Action]:
    return [Action(Act.CANCEL, timer=Timer.LAST_CALL)]


def _joining_closed(ctx: Context, ev: RoundClosed) -> Outcome:
    """*me: MEMBER: CANCEL(join), RETURN_RESULT; *not me: WAITING: WAIT
    (+ OPEN_ROUND *a member is gone or *room, or CANCEL(join) *a spare)"""
    pre = _cancel_last_call(ctx)
    if ev.member:
        return (
            S.MEMBER,
            replace(ctx, round=ev.round),
            [*pre, Action(Act.CANCEL, timer=Timer.JOIN), Action(Act.RETURN_RESULT, round=ev.round)],
        )
    return _wait(ctx, ev, pre)


def _join_timeout(ctx: Context, ev: JoinTimeout) -> Outcome:
    """IDLE: LEAVE, RAISE(RendezvousTimeout)"""
    return (
        S.IDLE,
        ctx,
        [
            *_cancel_last_call(ctx),
            Action(Act.LEAVE, round=ctx.round),
            Action(Act.RAISE, round=ctx.round, error=RendezvousTimeout),
        ],
    )


def _waiting_closed(ctx: Context, ev: RoundClosed) -> Outcome:
    """*newer R, not me: WAITING: WAIT (+ OPEN_ROUND, or CANCEL(join) *a
    spare); else WAITING"""
    if ev.round > ctx.round and not ev.member:
        return _wait(ctx, ev)
    return S.WAITING, ctx, []


def _waiting_lost(ctx: Context, ev: MemberLost) -> Outcome:
    """WAITING: OPEN_ROUND(member_lost)"""
    act = Action(Act.OPEN_ROUND, round=ctx.round, reason="member_lost", detail=ev.detail)
    return S.WAITING, ctx, [act]


def _member_closed(ctx: Context, ev: RoundClosed) -> Outcome:
    """*newer R: IDLE: RETURN_CHANGE (re-formed without this node); else MEMBER"""
    if ev.round > ctx.round:
        return S.IDLE, ctx, [Action(Act.RETURN_CHANGE, round=ev.round)]
    return S.MEMBER, ctx, []


def _member_open(ctx: Context, ev: RoundOpen) -> Outcome:
    """IDLE: RETURN_CHANGE (someone opened R+1)"""
    return S.IDLE, ctx, [Action(Act.RETURN_CHANGE, round=ev.round)]


def _member_lost(ctx: Context, ev: MemberLost) -> Outcome:
    """MEMBER: OPEN_ROUND(member_lost)"""
    act = Action(Act.OPEN_ROUND, round=ctx.round, reason="member_lost", detail=ev.detail)
    return S.MEMBER, ctx, [act]


def _node_waiting(ctx: Context, ev: NodeWaiting) -> Outcome:
    """MEMBER: OPEN_ROUND(node_waiting) *room"""
    if not ev.room:
        return S.MEMBER, ctx, []
    act = Action(Act.OPEN_ROUND, round=ctx.round, reason="node_waiting", detail=ev.detail)
    return S.MEMBER, ctx, [act]


def _workers_failed(ctx: Context, ev: WorkersFailed) -> Outcome:
    """MEMBER: OPEN_ROUND(restart_requested, counts): the restart is charged
    when R+1 closes with every member of R back (else a lost node caused it:
    not counted); a charge past the budget closes R+1 as failed"""
    # Always re-form, even with no budget left: whether the failure counts is
    # decided when the next round closes (a lost node excuses it; see
    # records.close_records), and an overspent budget fails the job then.
    act = Action(
        Act.OPEN_ROUND, round=ctx.round, reason="restart_requested", detail=ev.detail, counts=True
    )
    return S.MEMBER, ctx, [act]


def _workers_succeeded(ctx: Context, ev: WorkersSucceeded) -> Outcome:
    """COMPLETING: PUT_DONE, ARM(barrier)"""
    deadline = ev.now + ctx.exit_barrier_timeout
    return (
        S.COMPLETING,
        ctx,
        [
            Action(Act.PUT_DONE, round=ctx.round),
            Action(Act.ARM, timer=Timer.BARRIER, deadline=deadline),
        ],
    )


def _member_lease_lost(ctx: Context, ev: LeaseLost) -> Outcome:
    """IDLE: RETURN_CHANGE(lease_lost) (the workers stop at once; the next
    round's registration gets a new lease)"""
    acts = [Action(Act.RETURN_CHANGE, round=ctx.round, reason="lease_lost", detail=ev.detail)]
    return S.IDLE, ctx, acts


def _barrier_done(ctx: Context, ev: BarrierDone) -> Outcome:
    """FINISHED: CANCEL(barrier), MARK_FINISHED, RETURN"""
    acts = [
        Action(Act.CANCEL, timer=Timer.BARRIER),
        Action(Act.MARK_FINISHED, round=ctx.round),
        Action(Act.RETURN),
    ]
    return S.FINISHED, ctx, acts


def _barrier_lost(ctx: Context, ev: MemberLost) -> Outcome:
    """FINISHED: CANCEL(barrier), OPEN_ROUND(member_lost), RETURN (the barrier
    can never complete; opening R+1 tells the members that watch only
    ``round``)"""
    acts = [
        Action(Act.CANCEL, timer=Timer.BARRIER),
        Action(Act.OPEN_ROUND, round=ctx.round, reason="member_lost", detail=ev.detail),
        Action(Act.RETURN),
    ]
    return S.FINISHED, ctx, acts


def _barrier_leave(ctx: Context, ev: Event) -> Outcome:
    """FINISHED: CANCEL(barrier), RETURN"""
    return S.FINISHED, ctx, [Action(Act.CANCEL, timer=Timer.BARRIER), Action(Act.RETURN)]


def _completing_closed(ctx: Context, ev: RoundClosed) -> Outcome:
    """*newer R: FINISHED: CANCEL(barrier), RETURN; else COMPLETING"""
    if ev.round > ctx.round:
        return _barrier_leave(ctx, ev)
    return S.COMPLETING, ctx, []


def _completing_renew(ctx: Context, ev: LeaseLost) -> Outcome:
    """COMPLETING: RENEW_LEASE"""
    return S.COMPLETING, ctx, [Action(Act.RENEW_LEASE)]


def _shutdown(ctx: Context, ev: Shutdown) -> Outcome:
    """LEFT: CANCEL(every timer), REVOKE"""
    acts = [Action(Act.CANCEL, timer=t) for t in Timer]
    return S.LEFT, ctx, [*acts, Action(Act.REVOKE)]


def _deciding(rule: Rule) -> Rule:
    """A JOINING rule applied in DECIDING (the decider leaves the same ways)."""

    def wrapped(ctx: Context, ev: Event) -> Outcome:
        state, new_ctx, acts = rule(ctx, ev)
        if state is S.JOINING and not any(a.type is Act.JOIN for a in acts):
            state = S.DECIDING
        return state, new_ctx, acts

    wrapped.__doc__ = "as in JOINING (staying DECIDING where JOINING stays)"
    return wrapped


# States from which next_round() starts over (a call that was cancelled, or a
# member asking for a new round without a change: it opens one).
_RESTARTABLE = (S.IDLE, S.SEEKING, S.JOINING, S.DECIDING, S.WAITING, S.MEMBER)

_JOINING_RULES: dict[type[Event], Rule] = {
    JoinersChanged: _joiners_changed,
    RoundOpen: _joining_open,
    RoundClosed: _joining_closed,
    RoundFinished: _raise(S.FINISHED, RendezvousClosed),
    RoundFailed: _raise(S.FAILED, RestartBudgetExhausted),
    JoinTimeout: _join_timeout,
    LeaseLost: _renew,
}

RULES: dict[tuple[State, type[Event]], Rule] = {
    **{(s, NextRound): _next_round for s in _RESTARTABLE},
    (S.IDLE, WorkersFailed): _stay_in(S.IDLE, "the round already moved on: not counted twice"),
    (S.SEEKING, RoundOpen): _join,
    (S.SEEKING, RoundClosed): _seeking_closed,
    (S.SEEKING, RoundFinished): _raise(S.FINISHED, RendezvousClosed),
    (S.SEEKING, RoundFailed): _raise(S.FAILED, RestartBudgetExhausted),
    (S.SEEKING, JoinTimeout): _raise(S.IDLE, RendezvousTimeout),
    (S.SEEKING, LeaseLost): _renew,
    **{(S.JOINING, ev): rule for ev, rule in _JOINING_RULES.items()},
    **{(S.DECIDING, ev): _deciding(rule) for ev, rule in _JOINING_RULES.items()},
    (S.DECIDING, JoinersChanged): _decide,
    (S.DECIDING, LastCallExpired): _last_call_expired,
    (S.WAITING, RoundOpen): _join,
    (S.WAITING, RoundClosed): _waiting_closed,
    (S.WAITING, MemberLost): _waiting_lost,
    (S.WAITING, RoundFinished): _raise(S.FINISHED, RendezvousClosed),
    (S.WAITING, RoundFailed): _raise(S.FAILED, RestartBudgetExhausted),
    (S.WAITING, JoinTimeout): _join_timeout,
    (S.WAITING, LeaseLost): _renew,
    (S.MEMBER, RoundClosed): _member_closed,
    (S.MEMBER, RoundOpen): _member_open,
    (S.MEMBER, MemberLost): _member_lost,
    (S.MEMBER, NodeWaiting): _node_waiting,
    (S.MEMBER, WorkersFailed): _workers_failed,
    (S.MEMBER, WorkersSucceeded): _workers_succeeded,
    (S.MEMBER, RoundFinished): _raise(S.FINISHED, RendezvousClosed),
    (S.MEMBER, RoundFailed): _raise(S.FAILED, RestartBudgetExhausted),
    (S.MEMBER, LeaseLost): _member_lease_lost,
    (S.COMPLETING, BarrierDone): _barrier_done,
    (S.COMPLETING, BarrierTimeout): _barrier_leave,
    (S.COMPLETING, MemberLost): _barrier_lost,
    (S.COMPLETING, RoundOpen): _barrier_leave,
    (S.COMPLETING, RoundClosed): _completing_closed,
    (S.COMPLETING, RoundFinished): _barrier_leave,
    (S.COMPLETING, RoundFailed): _barrier_leave,
    (S.COMPLETING, LeaseLost): _completing_renew,
    (S.FINISHED, NextRound): _raise(S.FINISHED, RendezvousClosed),
    (S.FAILED, NextRound): _raise(S.FAILED, RestartBudgetExhausted),
    (S.FAILED, WorkersFailed): _raise(S.FAILED, RestartBudgetExhausted),
    **{(s, Shutdown): _shutdown for s in State if s is not S.LEFT},
    (S.LEFT, Shutdown): _stay_in(S.LEFT),
}


class Rules:
    """One node's rendezvous state machine."""

    def __init__(self, ctx: Context, state: State = State.IDLE) -> None:
        self.state = state
        self.ctx = ctx

    def handle(self, event: Event) -> list[Action]:
        rule = RULES.get((self.state, type(event)))
        if rule is None:
            raise LocalProtocolError(
                f"event {type(event).__name__} is not valid in state {self.state.name}"
            )
        self.state, self.ctx, actions = rule(self.ctx, event)
        return actions
