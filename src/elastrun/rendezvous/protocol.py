"""The rendezvous state machine's vocabulary: states, events, actions, timers.

Pure data, shared by the rules (:mod:`.rules`), the planner (:mod:`.plan`) and
the driver (:mod:`.dynamic` and its parts), each of which imports it from
here. As in h11, every event is a class of its own that carries only its own
fields, and so is every action: the rules match on the event's class, the
driver on the action's. See the table in :mod:`.rules` for what each
event does in each state.
"""

from __future__ import annotations

import enum

from elastrun.errors import (
    RendezvousClosed,
    RendezvousTimeout,
    RestartBudgetExhausted,
)
from elastrun.frozen import frozen

__all__ = [
    "ACTIONS",
    "EVENTS",
    "TIMER_EVENTS",
    "Action",
    "Arm",
    "BarrierDone",
    "BarrierTimeout",
    "Cancel",
    "CloseRound",
    "Context",
    "Event",
    "Join",
    "JoinTimeout",
    "JoinersChanged",
    "LastCallExpired",
    "LeaseLost",
    "Leave",
    "LocalProtocolError",
    "MarkFinished",
    "MemberLost",
    "NextRound",
    "NodeWaiting",
    "OpenRound",
    "PutDone",
    "Raise",
    "RaisedError",
    "ReadRound",
    "RenewLease",
    "Return",
    "ReturnChange",
    "ReturnResult",
    "Revoke",
    "RoundClosed",
    "RoundFailed",
    "RoundFinished",
    "RoundOpen",
    "Shutdown",
    "State",
    "Timer",
    "Wait",
    "WorkersFailed",
    "WorkersSucceeded",
]


class LocalProtocolError(Exception):
    """The driver fed an event that is not valid in the current state (a bug)."""


class State(enum.Enum):
    IDLE = "idle"  # between rounds (before next_round, or after a change)
    SEEKING = "seeking"  # reading the job's round record
    JOINING = "joining"  # joined the open round R, not its decider
    DECIDING = "deciding"  # joined the open round R, and its decider
    WAITING = "waiting"  # round R closed without this node: wait for R+1
    MEMBER = "member"  # member of the closed round R (workers running)
    COMPLETING = "completing"  # workers succeeded: at the exit barrier
    FINISHED = "finished"  # this node is done (job finished or left after success)
    FAILED = "failed"  # the job's restart budget is spent
    LEFT = "left"  # shut down


# -- events: one class each, with only its own fields ---------------------------
@frozen
class Event:
    """Base of the rule events (never fed itself)."""


@frozen
class NextRound(Event):
    """The agent called ``next_round()``."""

    now: float  # the node's monotonic clock: the join timeout counts from here


@frozen
class RoundOpen(Event):
    """The job's ``round`` record: round ``round`` is open."""

    round: int
    now: float = 0.0  # this node's clock when it read the record


@frozen
class RoundClosed(Event):
    """The job's ``round`` record: round ``round`` is closed (its result written)."""

    round: int
    member: bool = False  # this node is in the result
    room: bool = False  # the round's world is below max
    lost: str = ""  # a member of the round is gone (how, for people); "" if none
    detail: str = ""  # this node waiting, for people (the reason of a round it opens)


@frozen
class RoundFinished(Event):
    """The job's ``round`` record: the job finished (after round ``round``)."""

    round: int


@frozen
class RoundFailed(Event):
    """The job's ``round`` record: the job failed (its restart budget spent)."""

    round: int


@frozen
class JoinersChanged(Event):
    """The joiners of the open round changed (or were read)."""

    now: float
    count: int  # live joiners of the round
    decider: bool = False  # this node is the round's decider
    all_joined: bool = False  # a re-formed round, and every present node joined
    # A re-formed round, and a member of the previous round is present but has
    # not joined yet: max joined does not close it (the survivor would lose its
    # place to a spare); its joining, its leaving or the last call does.
    # Reported once as many nodes joined as the previous round had members
    # (the rules read it only at max joined).
    members_pending: bool = False


@frozen
class LastCallExpired(Event):
    """The decider's last-call deadline passed."""


@frozen
class JoinTimeout(Event):
    """The join timeout passed before this node became a member."""


@frozen
class MemberLost(Event):
    """A member of this node's round is gone without finishing."""

    detail: str


@frozen
class NodeWaiting(Event):
    """A node waits to join the next round."""

    room: bool  # this node's round's world is below max
    detail: str


@frozen
class WorkersFailed(Event):
    """This node's workers failed (``request_restart()``)."""

    detail: str  # the failure in one line: the new round's detail


@frozen
class WorkersSucceeded(Event):
    """This node's workers all succeeded (``complete()``)."""

    now: float  # the exit barrier's timeout counts from here


@frozen
class BarrierDone(Event):
    """Every member of the round put its done key."""


@frozen
class BarrierTimeout(Event):
    """The exit barrier's timeout passed."""


@frozen
class LeaseLost(Event):
    """This node's lease is gone (expired, revoked, or the store unreachable)."""

    detail: str


@frozen
class Shutdown(Event):
    """The agent called ``shutdown()``: leave."""


EVENTS: tuple[type[Event], ...] = (
    NextRound,
    RoundOpen,
    RoundClosed,
    RoundFinished,
    RoundFailed,
    JoinersChanged,
    LastCallExpired,
    JoinTimeout,
    MemberLost,
    NodeWaiting,
    WorkersFailed,
    WorkersSucceeded,
    BarrierDone,
    BarrierTimeout,
    LeaseLost,
    Shutdown,
)


# -- timers and actions ------------------------------------------------------------
class Timer(enum.Enum):
    JOIN = "join"
    LAST_CALL = "last_call"
    BARRIER = "barrier"


# The event a timer feeds when its deadline passes.
TIMER_EVENTS: dict[Timer, Event] = {
    Timer.JOIN: JoinTimeout(),
    Timer.LAST_CALL: LastCallExpired(),
    Timer.BARRIER: BarrierTimeout(),
}


# What Raise raises: the exception class (the driver writes its message).
RaisedError = type[RendezvousTimeout] | type[RendezvousClosed] | type[RestartBudgetExhausted]


# -- actions: one class each, with only its own fields ---------------------------
# The rules' table (:mod:`.rules`) names each in capitals: ``OPEN_ROUND`` is
# :class:`OpenRound`, ``CANCEL(join)`` is ``Cancel(Timer.JOIN)``.
@frozen(slots=True)
class ReadRound:
    """Read the job's ``round`` record (the SEEKING phase does: no write)."""


@frozen(slots=True)
class Join:
    """Put ``rounds/R/join/me`` (if ``round`` is still open ``R``), drop ``waiting/me``."""

    round: int


@frozen(slots=True)
class Leave:
    """Delete this node's join and waiting keys of round ``round``."""

    round: int


@frozen(slots=True)
class Wait:
    """Put ``waiting/me``: round ``round`` closed without this node."""

    round: int


@frozen(slots=True)
class CloseRound:
    """The decider closes open round ``round`` (CAS ``round``, with its result)."""

    round: int
    reason: str


@frozen(slots=True)
class OpenRound:
    """CAS ``round``: closed ``round`` -> open ``round + 1``."""

    round: int
    reason: str
    detail: str = ""
    counts: bool = False  # the restart counts against the budget


@frozen(slots=True)
class PutDone:
    """Put this node's done key of round ``round`` (the exit barrier)."""

    round: int


@frozen(slots=True)
class MarkFinished:
    """CAS ``round``: closed ``round`` -> finished."""

    round: int


@frozen(slots=True)
class Arm:
    """Arm ``timer`` for ``deadline`` (the node's monotonic clock)."""

    timer: Timer
    deadline: float


@frozen(slots=True)
class Cancel:
    """Cancel ``timer`` (armed or not)."""

    timer: Timer


@frozen(slots=True)
class RenewLease:
    """A new lease and the presence key again (the lease was lost)."""


@frozen(slots=True)
class Revoke:
    """Leave: the ``left`` key, then revoke the lease."""


@frozen(slots=True)
class ReturnResult:
    """End the call with round ``round``'s result."""

    round: int


@frozen(slots=True)
class ReturnChange:
    """End the call with a change (round ``round`` moved on without this node)."""

    round: int
    reason: str = ""  # "" : the round record's own reason
    detail: str = ""


@frozen(slots=True)
class Return:
    """End the call with nothing to return."""


@frozen(slots=True)
class Raise:
    """End the call with ``error`` (its message is the driver's: it reads the
    store for it); ``round``: the round it concerns."""

    round: int
    error: RaisedError


Action = (
    ReadRound
    | Join
    | Leave
    | Wait
    | CloseRound
    | OpenRound
    | PutDone
    | MarkFinished
    | Arm
    | Cancel
    | RenewLease
    | Revoke
    | ReturnResult
    | ReturnChange
    | Return
    | Raise
)
ACTIONS: tuple[type[Action], ...] = (
    ReadRound,
    Join,
    Leave,
    Wait,
    CloseRound,
    OpenRound,
    PutDone,
    MarkFinished,
    Arm,
    Cancel,
    RenewLease,
    Revoke,
    ReturnResult,
    ReturnChange,
    Return,
    Raise,
)


@frozen
class Context:
    min_nodes: int
    max_nodes: int
    max_restarts: int = 0
    join_timeout: float = 600.0
    last_call_timeout: float = 30.0
    exit_barrier_timeout: float = 300.0
    round: int = -1  # the round this node is in (or waits after)
    min_reached_at: float | None = None  # when this node saw >= min joiners of `round`
    count: int = 0  # live joiners last seen
    # --node-unit > 1: a node waiting beside a round it cannot enlarge is a
    # hot spare and waits as long as the job runs (no join timeout);
    # ``spare``: this node waits so now (its join timer is cancelled, and
    # armed again when a round opens).
    spares_wait: bool = False
    spare: bool = False
