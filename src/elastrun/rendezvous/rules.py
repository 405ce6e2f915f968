"""The dynamic rendezvous as a pure state machine: (state, event) -> (state, actions).

Theory of operation
-------------------
Modelled on h11's ``_state.py``: this module does no I/O, owns no clock and
knows nothing of the store. The driver (:mod:`elastrun.rendezvous.dynamic`)
turns what it observes (the job's ``round`` record, join keys, presence keys,
done keys, deadlines passing, calls from the agent) into events -- one class
per event, each with only its own fields (:mod:`.protocol`) -- feeds them to
:meth:`Rules.handle`, and executes the actions it gets back (one class each,
also in :mod:`.protocol`; the table below names them in capitals: ``OPEN_ROUND``
is :class:`~.protocol.OpenRound`).
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
``render_table`` in tests/unit/rdzv_table.py (a unit test keeps the two equal).
``*`` marks conditions; RAISE names the exception raised.

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

from elastrun.errors import RendezvousClosed, RendezvousTimeout, RestartBudgetExhausted
from elastrun.rendezvous.protocol import (
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
    RoundClosed,
    RoundFailed,
    RoundFinished,
    RoundOpen,
    Shutdown,
    State,
    WorkersFailed,
    WorkersSucceeded,
)
from elastrun.rendezvous.rule_steps import (
    Rule,
    barrier_done,
    barrier_leave,
    barrier_lost,
    completing_closed,
    completing_renew,
    decide,
    deciding,
    join,
    join_timeout,
    joiners_changed,
    joining_closed,
    joining_open,
    last_call_expired,
    member_closed,
    member_lease_lost,
    member_lost,
    member_open,
    next_round,
    node_waiting,
    raising,
    renew,
    seeking_closed,
    shutdown,
    stay_in,
    waiting_closed,
    waiting_lost,
    workers_failed,
    workers_succeeded,
)

__all__ = ["RULES", "Rules"]


# States from which next_round() starts over (a call that was cancelled, or a
# member asking for a new round without a change: it opens one).
_RESTARTABLE = (
    State.IDLE,
    State.SEEKING,
    State.JOINING,
    State.DECIDING,
    State.WAITING,
    State.MEMBER,
)

_JOINING_RULES: dict[type[Event], Rule] = {
    JoinersChanged: joiners_changed,
    RoundOpen: joining_open,
    RoundClosed: joining_closed,
    RoundFinished: raising(State.FINISHED, RendezvousClosed),
    RoundFailed: raising(State.FAILED, RestartBudgetExhausted),
    JoinTimeout: join_timeout,
    LeaseLost: renew,
}

RULES: dict[tuple[State, type[Event]], Rule] = {
    **{(s, NextRound): next_round for s in _RESTARTABLE},
    (State.IDLE, WorkersFailed): stay_in(
        State.IDLE, "the round already moved on: not counted twice"
    ),
    (State.SEEKING, RoundOpen): join,
    (State.SEEKING, RoundClosed): seeking_closed,
    (State.SEEKING, RoundFinished): raising(State.FINISHED, RendezvousClosed),
    (State.SEEKING, RoundFailed): raising(State.FAILED, RestartBudgetExhausted),
    (State.SEEKING, JoinTimeout): raising(State.IDLE, RendezvousTimeout),
    (State.SEEKING, LeaseLost): renew,
    **{(State.JOINING, ev): rule for ev, rule in _JOINING_RULES.items()},
    **{(State.DECIDING, ev): deciding(rule) for ev, rule in _JOINING_RULES.items()},
    (State.DECIDING, JoinersChanged): decide,
    (State.DECIDING, LastCallExpired): last_call_expired,
    (State.WAITING, RoundOpen): join,
    (State.WAITING, RoundClosed): waiting_closed,
    (State.WAITING, MemberLost): waiting_lost,
    (State.WAITING, RoundFinished): raising(State.FINISHED, RendezvousClosed),
    (State.WAITING, RoundFailed): raising(State.FAILED, RestartBudgetExhausted),
    (State.WAITING, JoinTimeout): join_timeout,
    (State.WAITING, LeaseLost): renew,
    (State.MEMBER, RoundClosed): member_closed,
    (State.MEMBER, RoundOpen): member_open,
    (State.MEMBER, MemberLost): member_lost,
    (State.MEMBER, NodeWaiting): node_waiting,
    (State.MEMBER, WorkersFailed): workers_failed,
    (State.MEMBER, WorkersSucceeded): workers_succeeded,
    (State.MEMBER, RoundFinished): raising(State.FINISHED, RendezvousClosed),
    (State.MEMBER, RoundFailed): raising(State.FAILED, RestartBudgetExhausted),
    (State.MEMBER, LeaseLost): member_lease_lost,
    (State.COMPLETING, BarrierDone): barrier_done,
    (State.COMPLETING, BarrierTimeout): barrier_leave,
    (State.COMPLETING, MemberLost): barrier_lost,
    (State.COMPLETING, RoundOpen): barrier_leave,
    (State.COMPLETING, RoundClosed): completing_closed,
    (State.COMPLETING, RoundFinished): barrier_leave,
    (State.COMPLETING, RoundFailed): barrier_leave,
    (State.COMPLETING, LeaseLost): completing_renew,
    (State.FINISHED, NextRound): raising(State.FINISHED, RendezvousClosed),
    (State.FAILED, NextRound): raising(State.FAILED, RestartBudgetExhausted),
    (State.FAILED, WorkersFailed): raising(State.FAILED, RestartBudgetExhausted),
    **{(s, Shutdown): shutdown for s in State if s is not State.LEFT},
    (State.LEFT, Shutdown): stay_in(State.LEFT),
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
