"""The dynamic rendezvous as a pure state machine: (state, event) -> (state, actions).

Theory of operation
-------------------
Modelled on h11's ``_state.py``: this module does no I/O, owns no clock and
knows nothing of the store. The driver (:mod:`elastrun.rendezvous.dynamic`)
turns what it observes (the job's ``round`` record, join keys, presence keys,
done keys, deadlines passing, calls from the agent) into :class:`Event` values,
feeds them to :meth:`Rules.handle`, and executes the :class:`Action` values it
gets back. Every write the driver makes to the job's ``round`` record comes back
to it through a watch as an ordinary event, so the machine learns the outcome
of a compare-and-set the same way whether this node or another node won it.

One node's life::

    IDLE --NEXT_ROUND--> SEEKING --ROUND_OPEN--> JOINING <--> DECIDING
                            |                      |  (decider = live joiner
                            |                      |   with the smallest join revision)
                            +--ROUND_CLOSED(not me)--> WAITING --ROUND_OPEN--> JOINING
                                                   |
                         JOINING/DECIDING --ROUND_CLOSED(me)--> MEMBER
    MEMBER --MEMBER_LOST/NODE_WAITING/WORKERS_FAILED--> (opens R+1) --ROUND_OPEN--> IDLE
    MEMBER --WORKERS_SUCCEEDED--> COMPLETING --BARRIER_DONE--> FINISHED
                                  (--MEMBER_LOST--> opens R+1, FINISHED)
    any --SHUTDOWN--> LEFT

Only the decider closes a round: at once when ``max`` nodes joined; when at
least ``min`` joined, after ``last_call_timeout`` counted on its own monotonic
clock from when it saw ``min`` reached -- or at once when this is a re-formed
round (there was a previous round) and every node present in the job has
joined (nobody left to wait for: the USER-PAIN 5 fix).

The exit barrier (COMPLETING) costs O(n) store traffic and watch events per
round, not O(n^2): a member whose workers succeeded puts its done key, then
counts the done keys (one O(1)-byte read); the member whose count reaches the
round's size -- the last to finish, in revision order -- feeds BARRIER_DONE
and marks the job finished (CAS on ``round``). Everyone waits on ``round``
alone, plus one more key: the round's *barrier watcher* is the first member in
rank order whose presence key exists (normally group rank 0). The watcher reads
and watches the done keys and every presence key (O(n) events, for one node):
it finishes the job when the last done key appears (should the last finisher
die before its CAS), and it alone notices a member lost during the barrier
(presence gone, no done key), whereupon it opens R+1 (``member_lost``) so that
the others, which see R+1 on ``round``, leave too. Every other member watches
only the watcher's presence key: gone without a done key, the watcher is lost
(MEMBER_LOST: open R+1, leave); gone with one (it left the barrier: timed out
or shut down), the driver re-reads its phase and the next member in rank order
takes the role. Any member may mark finished or open R+1: both are CAS on a
closed ``round`` R, so two nodes that both believe they are the watcher are
harmless. The role is chosen by the driver (``phases``), as the decider is.

Rules table (state, event) -> next state: actions.  ``*`` marks conditions.

=========== ================= =================================================
state       event             next state: actions
=========== ================= =================================================
IDLE        NEXT_ROUND        SEEKING: CANCEL(last_call), ARM(join), READ_ROUND
                              (also from SEEKING, JOINING, DECIDING, WAITING, MEMBER:
                              a cancelled call, or a member asking again)
IDLE        WORKERS_FAILED    IDLE (round already moved on: not counted twice)
SEEKING     ROUND_OPEN        JOINING: JOIN(R)
SEEKING     ROUND_CLOSED      *me: SEEKING: OPEN_ROUND(rejoin); *not me: WAITING:
                              WAIT (+ OPEN_ROUND(node_waiting) *room, or
                              OPEN_ROUND(member_lost) *a member is gone)
SEEKING     ROUND_FINISHED    FINISHED: RAISE(closed)
SEEKING     ROUND_FAILED      FAILED: RAISE(budget)
SEEKING     JOIN_TIMEOUT      IDLE: RAISE(timeout)
SEEKING     LEASE_LOST        SEEKING: RENEW_LEASE, READ_ROUND
JOINING     JOINERS_CHANGED   *decider: DECIDING: decide; else JOINING
JOINING     ROUND_OPEN        *newer R: JOINING: JOIN(R); else JOINING
JOINING     ROUND_CLOSED      *me: MEMBER: CANCEL(join), RETURN_RESULT;
                              *not me: WAITING: WAIT (+ OPEN_ROUND *room/lost)
JOINING     ROUND_FINISHED    FINISHED: RAISE(closed)
JOINING     ROUND_FAILED      FAILED: RAISE(budget)
JOINING     JOIN_TIMEOUT      IDLE: LEAVE, RAISE(timeout)
JOINING     LEASE_LOST        SEEKING: RENEW_LEASE, READ_ROUND
DECIDING    JOINERS_CHANGED   DECIDING: decide (CLOSE_ROUND, ARM/CANCEL(last_call))
DECIDING    LAST_CALL_EXPIRED DECIDING: CLOSE_ROUND *count >= min
DECIDING    (others)          as JOINING (CANCEL(last_call) when leaving)
WAITING     ROUND_OPEN        JOINING: JOIN(R)
WAITING     ROUND_CLOSED      *newer R, not me: WAITING: WAIT (+ OPEN_ROUND); else WAITING
WAITING     MEMBER_LOST       WAITING: OPEN_ROUND(member_lost)
WAITING     ROUND_FINISHED    FINISHED: RAISE(closed)
WAITING     ROUND_FAILED      FAILED: RAISE(budget)
WAITING     JOIN_TIMEOUT      IDLE: LEAVE, RAISE(timeout)
WAITING     LEASE_LOST        SEEKING: RENEW_LEASE, READ_ROUND
MEMBER      ROUND_CLOSED      *newer R: IDLE: RETURN_CHANGE; else MEMBER
MEMBER      ROUND_OPEN        IDLE: RETURN_CHANGE (someone opened R+1)
MEMBER      MEMBER_LOST       MEMBER: OPEN_ROUND(member_lost)
MEMBER      NODE_WAITING      MEMBER: OPEN_ROUND(node_waiting) *room
MEMBER      WORKERS_FAILED    MEMBER: OPEN_ROUND(restart, counts): the restart is
                              charged when R+1 closes with every member of R back
                              (else a lost node caused it: not counted); a charge
                              past the budget closes R+1 as FAILED
MEMBER      WORKERS_SUCCEEDED COMPLETING: PUT_DONE, ARM(barrier)
MEMBER      ROUND_FINISHED    FINISHED: RAISE(closed)
MEMBER      ROUND_FAILED      FAILED: RAISE(budget)
MEMBER      LEASE_LOST        IDLE: RENEW_LEASE, RETURN_CHANGE(lease_lost)
COMPLETING  BARRIER_DONE      FINISHED: CANCEL(barrier), MARK_FINISHED, RETURN
COMPLETING  BARRIER_TIMEOUT   FINISHED: RETURN
COMPLETING  MEMBER_LOST       FINISHED: CANCEL(barrier), OPEN_ROUND(member_lost),
                              RETURN (the barrier can never complete; opening R+1
                              tells the members that watch only ``round``)
COMPLETING  ROUND_OPEN        FINISHED: CANCEL(barrier), RETURN (others re-formed)
COMPLETING  ROUND_CLOSED      *newer R: FINISHED: RETURN; else COMPLETING
COMPLETING  ROUND_FINISHED    FINISHED: CANCEL(barrier), RETURN
COMPLETING  ROUND_FAILED      FINISHED: CANCEL(barrier), RETURN
COMPLETING  LEASE_LOST        COMPLETING: RENEW_LEASE
FINISHED    NEXT_ROUND        FINISHED: RAISE(closed)
FAILED      NEXT_ROUND        FAILED: RAISE(budget)
FAILED      WORKERS_FAILED    FAILED: RAISE(budget)
any but     SHUTDOWN          LEFT: CANCEL(all), REVOKE
LEFT
LEFT        SHUTDOWN          LEFT
=========== ================= =================================================

Any other (state, event) pair is a bug in the driver and raises
:class:`LocalProtocolError`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from elastrun.rendezvous.protocol import (
    Act,
    Action,
    Context,
    Ev,
    Event,
    LocalProtocolError,
    State,
    Timer,
)

__all__ = [
    "RULES",
    "Act",
    "Action",
    "Context",
    "Ev",
    "Event",
    "LocalProtocolError",
    "Rules",
    "State",
    "Timer",
]


Outcome = tuple[State, Context, list[Action]]
Rule = Callable[[Context, Event], Outcome]

S = State


def _raise(state: State, error: str) -> Rule:
    def rule(ctx: Context, ev: Event) -> Outcome:
        return state, ctx, [Action(Act.RAISE, round=ctx.round, error=error)]

    return rule


def _stay_in(state: State) -> Rule:
    def rule(ctx: Context, ev: Event) -> Outcome:
        return state, ctx, []

    return rule


def _next_round(ctx: Context, ev: Event) -> Outcome:
    deadline = ev.now + ctx.join_timeout
    return (
        S.SEEKING,
        replace(ctx, min_reached_at=None, count=0),
        [
            Action(Act.CANCEL, timer=Timer.LAST_CALL),
            Action(Act.ARM, timer=Timer.JOIN, deadline=deadline),
            Action(Act.READ_ROUND),
        ],
    )


def _join(ctx: Context, ev: Event, pre: list[Action] | None = None) -> Outcome:
    fresh = replace(ctx, round=ev.round, min_reached_at=None, count=0)
    return S.JOINING, fresh, [*(pre or []), Action(Act.JOIN, round=ev.round)]


def _wait(ctx: Context, ev: Event, pre: list[Action] | None = None) -> Outcome:
    acts = [*(pre or []), Action(Act.WAIT, round=ev.round)]
    if ev.lost:
        acts.append(Action(Act.OPEN_ROUND, round=ev.round, reason="member_lost", detail=ev.lost))
    elif ev.room:
        acts.append(Action(Act.OPEN_ROUND, round=ev.round, reason="node_waiting", detail=ev.detail))
    return S.WAITING, replace(ctx, round=ev.round, min_reached_at=None, count=0), acts


def _seeking_open(ctx: Context, ev: Event) -> Outcome:
    return _join(ctx, ev)


def _seeking_closed(ctx: Context, ev: Event) -> Outcome:
    if ev.member:
        # Asked for a new round while a member of the current one (the agent
        # lost its workers without a restart): open the next one.
        act = Action(Act.OPEN_ROUND, round=ev.round, reason="member_rejoined", detail=ev.detail)
        return S.SEEKING, replace(ctx, round=ev.round), [act]
    return _wait(ctx, ev)


def _renew(ctx: Context, ev: Event) -> Outcome:
    return S.SEEKING, ctx, [Action(Act.RENEW_LEASE), Action(Act.READ_ROUND)]


def _decide(ctx: Context, ev: Event) -> Outcome:
    """The decider's rule: close, arm the last call, or wait."""
    count = ev.count
    if count >= ctx.min_nodes:
        reached = ctx.min_reached_at if ctx.min_reached_at is not None else ev.now
        ctx = replace(ctx, min_reached_at=reached, count=count)
        close = Action(Act.CLOSE_ROUND, round=ctx.round)
        cancel = Action(Act.CANCEL, timer=Timer.LAST_CALL)
        if count >= ctx.max_nodes:
            return S.DECIDING, ctx, [cancel, replace(close, reason="max_nodes")]
        if ev.all_joined:
            return S.DECIDING, ctx, [cancel, replace(close, reason="all_rejoined")]
        deadline = reached + ctx.last_call_timeout
        if ev.now >= deadline:
            return S.DECIDING, ctx, [cancel, replace(close, reason="last_call")]
        return S.DECIDING, ctx, [Action(Act.ARM, timer=Timer.LAST_CALL, deadline=deadline)]
    ctx = replace(ctx, min_reached_at=None, count=count)
    return S.DECIDING, ctx, [Action(Act.CANCEL, timer=Timer.LAST_CALL)]


def _joiners_changed(ctx: Context, ev: Event) -> Outcome:
    if ev.decider:
        return _decide(ctx, ev)
    # Track when min was reached (for the record); only the decider acts.
    if ev.count >= ctx.min_nodes:
        reached = ctx.min_reached_at if ctx.min_reached_at is not None else ev.now
    else:
        reached = None
    return S.JOINING, replace(ctx, min_reached_at=reached, count=ev.count), []


def _last_call_expired(ctx: Context, ev: Event) -> Outcome:
    if ctx.count >= ctx.min_nodes:
        return S.DECIDING, ctx, [Action(Act.CLOSE_ROUND, round=ctx.round, reason="last_call")]
    return S.DECIDING, ctx, []


def _joining_open(ctx: Context, ev: Event) -> Outcome:
    if ev.round > ctx.round:
        return _join(ctx, ev, _cancel_last_call(ctx))
    return S.JOINING, ctx, []


def _cancel_last_call(ctx: Context) -> list[Action]:
    return [Action(Act.CANCEL, timer=Timer.LAST_CALL)]


def _joining_closed(ctx: Context, ev: Event) -> Outcome:
    pre = _cancel_last_call(ctx)
    if ev.member:
        return (
            S.MEMBER,
            replace(ctx, round=ev.round),
            [*pre, Action(Act.CANCEL, timer=Timer.JOIN), Action(Act.RETURN_RESULT, round=ev.round)],
        )
    return _wait(ctx, ev, pre)


def _join_timeout(ctx: Context, ev: Event) -> Outcome:
    return (
        S.IDLE,
        ctx,
        [
            *_cancel_last_call(ctx),
            Action(Act.LEAVE, round=ctx.round),
            Action(Act.RAISE, round=ctx.round, error="timeout"),
        ],
    )


def _waiting_open(ctx: Context, ev: Event) -> Outcome:
    return _join(ctx, ev)


def _waiting_closed(ctx: Context, ev: Event) -> Outcome:
    if ev.round > ctx.round and not ev.member:
        return _wait(ctx, ev)
    return S.WAITING, ctx, []


def _waiting_lost(ctx: Context, ev: Event) -> Outcome:
    act = Action(Act.OPEN_ROUND, round=ctx.round, reason="member_lost", detail=ev.detail)
    return S.WAITING, ctx, [act]


def _member_closed(ctx: Context, ev: Event) -> Outcome:
    if ev.round > ctx.round:  # the others re-formed without this node
        return S.IDLE, ctx, [Action(Act.RETURN_CHANGE, round=ev.round)]
    return S.MEMBER, ctx, []


def _completing_closed(ctx: Context, ev: Event) -> Outcome:
    if ev.round > ctx.round:
        return _barrier_leave(ctx, ev)
    return S.COMPLETING, ctx, []


def _member_open(ctx: Context, ev: Event) -> Outcome:
    return S.IDLE, ctx, [Action(Act.RETURN_CHANGE, round=ev.round)]


def _member_lost(ctx: Context, ev: Event) -> Outcome:
    act = Action(Act.OPEN_ROUND, round=ctx.round, reason="member_lost", detail=ev.detail)
    return S.MEMBER, ctx, [act]


def _node_waiting(ctx: Context, ev: Event) -> Outcome:
    if not ev.room:
        return S.MEMBER, ctx, []
    act = Action(Act.OPEN_ROUND, round=ctx.round, reason="node_waiting", detail=ev.detail)
    return S.MEMBER, ctx, [act]


def _workers_failed(ctx: Context, ev: Event) -> Outcome:
    # Always re-form, even with no budget left: whether the failure counts is
    # decided when the next round closes (a lost node excuses it; see
    # records.close_records), and an overspent budget fails the job then.
    act = Action(
        Act.OPEN_ROUND, round=ctx.round, reason="restart_requested", detail=ev.detail, counts=True
    )
    return S.MEMBER, ctx, [act]


def _workers_succeeded(ctx: Context, ev: Event) -> Outcome:
    deadline = ev.now + ctx.exit_barrier_timeout
    return (
        S.COMPLETING,
        ctx,
        [
            Action(Act.PUT_DONE, round=ctx.round),
            Action(Act.ARM, timer=Timer.BARRIER, deadline=deadline),
        ],
    )


def _member_lease_lost(ctx: Context, ev: Event) -> Outcome:
    acts = [
        Action(Act.RENEW_LEASE),
        Action(Act.RETURN_CHANGE, round=ctx.round, reason="lease_lost", detail=ev.detail),
    ]
    return S.IDLE, ctx, acts


def _barrier_done(ctx: Context, ev: Event) -> Outcome:
    acts = [
        Action(Act.CANCEL, timer=Timer.BARRIER),
        Action(Act.MARK_FINISHED, round=ctx.round),
        Action(Act.RETURN),
    ]
    return S.FINISHED, ctx, acts


def _barrier_lost(ctx: Context, ev: Event) -> Outcome:
    # Only the barrier's watcher (or a watcher of the watcher) sees the loss:
    # re-opening the round is how the others, watching ``round``, learn it.
    acts = [
        Action(Act.CANCEL, timer=Timer.BARRIER),
        Action(Act.OPEN_ROUND, round=ctx.round, reason="member_lost", detail=ev.detail),
        Action(Act.RETURN),
    ]
    return S.FINISHED, ctx, acts


def _barrier_leave(ctx: Context, ev: Event) -> Outcome:
    return S.FINISHED, ctx, [Action(Act.CANCEL, timer=Timer.BARRIER), Action(Act.RETURN)]


def _completing_renew(ctx: Context, ev: Event) -> Outcome:
    return S.COMPLETING, ctx, [Action(Act.RENEW_LEASE)]


def _shutdown(ctx: Context, ev: Event) -> Outcome:
    acts = [Action(Act.CANCEL, timer=t) for t in Timer]
    return S.LEFT, ctx, [*acts, Action(Act.REVOKE)]


def _deciding(rule: Rule) -> Rule:
    """A JOINING rule applied in DECIDING (the decider leaves the same ways)."""

    def wrapped(ctx: Context, ev: Event) -> Outcome:
        state, new_ctx, acts = rule(ctx, ev)
        if state is S.JOINING and not any(a.type is Act.JOIN for a in acts):
            state = S.DECIDING
        return state, new_ctx, acts

    return wrapped


# States from which next_round() starts over (a call that was cancelled, or a
# member asking for a new round without a change: it opens one).
_RESTARTABLE = (S.IDLE, S.SEEKING, S.JOINING, S.DECIDING, S.WAITING, S.MEMBER)

_JOINING_RULES: dict[Ev, Rule] = {
    Ev.JOINERS_CHANGED: _joiners_changed,
    Ev.ROUND_OPEN: _joining_open,
    Ev.ROUND_CLOSED: _joining_closed,
    Ev.ROUND_FINISHED: _raise(S.FINISHED, "closed"),
    Ev.ROUND_FAILED: _raise(S.FAILED, "budget"),
    Ev.JOIN_TIMEOUT: _join_timeout,
    Ev.LEASE_LOST: _renew,
}

RULES: dict[tuple[State, Ev], Rule] = {
    **{(s, Ev.NEXT_ROUND): _next_round for s in _RESTARTABLE},
    (S.IDLE, Ev.WORKERS_FAILED): _stay_in(S.IDLE),
    (S.SEEKING, Ev.ROUND_OPEN): _seeking_open,
    (S.SEEKING, Ev.ROUND_CLOSED): _seeking_closed,
    (S.SEEKING, Ev.ROUND_FINISHED): _raise(S.FINISHED, "closed"),
    (S.SEEKING, Ev.ROUND_FAILED): _raise(S.FAILED, "budget"),
    (S.SEEKING, Ev.JOIN_TIMEOUT): _raise(S.IDLE, "timeout"),
    (S.SEEKING, Ev.LEASE_LOST): _renew,
    **{(S.JOINING, ev): rule for ev, rule in _JOINING_RULES.items()},
    **{(S.DECIDING, ev): _deciding(rule) for ev, rule in _JOINING_RULES.items()},
    (S.DECIDING, Ev.JOINERS_CHANGED): _decide,
    (S.DECIDING, Ev.LAST_CALL_EXPIRED): _last_call_expired,
    (S.WAITING, Ev.ROUND_OPEN): _waiting_open,
    (S.WAITING, Ev.ROUND_CLOSED): _waiting_closed,
    (S.WAITING, Ev.MEMBER_LOST): _waiting_lost,
    (S.WAITING, Ev.ROUND_FINISHED): _raise(S.FINISHED, "closed"),
    (S.WAITING, Ev.ROUND_FAILED): _raise(S.FAILED, "budget"),
    (S.WAITING, Ev.JOIN_TIMEOUT): _join_timeout,
    (S.WAITING, Ev.LEASE_LOST): _renew,
    (S.MEMBER, Ev.ROUND_CLOSED): _member_closed,
    (S.MEMBER, Ev.ROUND_OPEN): _member_open,
    (S.MEMBER, Ev.MEMBER_LOST): _member_lost,
    (S.MEMBER, Ev.NODE_WAITING): _node_waiting,
    (S.MEMBER, Ev.WORKERS_FAILED): _workers_failed,
    (S.MEMBER, Ev.WORKERS_SUCCEEDED): _workers_succeeded,
    (S.MEMBER, Ev.ROUND_FINISHED): _raise(S.FINISHED, "closed"),
    (S.MEMBER, Ev.ROUND_FAILED): _raise(S.FAILED, "budget"),
    (S.MEMBER, Ev.LEASE_LOST): _member_lease_lost,
    (S.COMPLETING, Ev.BARRIER_DONE): _barrier_done,
    (S.COMPLETING, Ev.BARRIER_TIMEOUT): _barrier_leave,
    (S.COMPLETING, Ev.MEMBER_LOST): _barrier_lost,
    (S.COMPLETING, Ev.ROUND_OPEN): _barrier_leave,
    (S.COMPLETING, Ev.ROUND_CLOSED): _completing_closed,
    (S.COMPLETING, Ev.ROUND_FINISHED): _barrier_leave,
    (S.COMPLETING, Ev.ROUND_FAILED): _barrier_leave,
    (S.COMPLETING, Ev.LEASE_LOST): _completing_renew,
    (S.FINISHED, Ev.NEXT_ROUND): _raise(S.FINISHED, "closed"),
    (S.FAILED, Ev.NEXT_ROUND): _raise(S.FAILED, "budget"),
    (S.FAILED, Ev.WORKERS_FAILED): _raise(S.FAILED, "budget"),
    **{(s, Ev.SHUTDOWN): _shutdown for s in State if s is not S.LEFT},
    (S.LEFT, Ev.SHUTDOWN): _stay_in(S.LEFT),
}


class Rules:
    """One node's rendezvous state machine."""

    def __init__(self, ctx: Context, state: State = State.IDLE) -> None:
        self.state = state
        self.ctx = ctx

    def handle(self, event: Event) -> list[Action]:
        rule = RULES.get((self.state, event.type))
        if rule is None:
            raise LocalProtocolError(
                f"event {event.type.name} is not valid in state {self.state.name}"
            )
        self.state, self.ctx, actions = rule(self.ctx, event)
        return actions
