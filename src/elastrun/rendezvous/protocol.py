"""The rendezvous state machine's vocabulary: states, events, actions, timers.

Pure data, shared by the rules (:mod:`.rules`, which re-exports every name),
the planner (:mod:`.plan`) and the driver (:mod:`.dynamic` and its parts). As
in h11, every event is a class of its own that carries only its own fields;
the rules match on the class. See the table in :mod:`.rules` for what each
event does in each state.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from elastrun.errors import (
    RendezvousClosed,
    RendezvousTimeout,
    RestartBudgetExhausted,
)

__all__ = [
    "EVENTS",
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
    "RaisedError",
    "RoundClosed",
    "RoundFailed",
    "RoundFinished",
    "RoundOpen",
    "Shutdown",
    "State",
    "Timer",
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
@dataclass(frozen=True)
class Event:
    """Base of the rule events (never fed itself)."""


@dataclass(frozen=True)
class NextRound(Event):
    """The agent called ``next_round()``."""

    now: float  # the node's monotonic clock: the join timeout counts from here


@dataclass(frozen=True)
class RoundOpen(Event):
    """The job's ``round`` record: round ``round`` is open."""

    round: int
    now: float = 0.0  # this node's clock when it read the record


@dataclass(frozen=True)
class RoundClosed(Event):
    """The job's ``round`` record: round ``round`` is closed (its result written)."""

    round: int
    member: bool = False  # this node is in the result
    room: bool = False  # the round's world is below max
    lost: str = ""  # a member of the round is gone (how, for people); "" if none
    detail: str = ""  # this node waiting, for people (the reason of a round it opens)


@dataclass(frozen=True)
class RoundFinished(Event):
    """The job's ``round`` record: the job finished (after round ``round``)."""

    round: int


@dataclass(frozen=True)
class RoundFailed(Event):
    """The job's ``round`` record: the job failed (its restart budget spent)."""

    round: int


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class LastCallExpired(Event):
    """The decider's last-call deadline passed."""


@dataclass(frozen=True)
class JoinTimeout(Event):
    """The join timeout passed before this node became a member."""


@dataclass(frozen=True)
class MemberLost(Event):
    """A member of this node's round is gone without finishing."""

    detail: str


@dataclass(frozen=True)
class NodeWaiting(Event):
    """A node waits to join the next round."""

    room: bool  # this node's round's world is below max
    detail: str


@dataclass(frozen=True)
class WorkersFailed(Event):
    """This node's workers failed (``request_restart()``)."""

    detail: str  # the failure in one line: the new round's detail


@dataclass(frozen=True)
class WorkersSucceeded(Event):
    """This node's workers all succeeded (``complete()``)."""

    now: float  # the exit barrier's timeout counts from here


@dataclass(frozen=True)
class BarrierDone(Event):
    """Every member of the round put its done key."""


@dataclass(frozen=True)
class BarrierTimeout(Event):
    """The exit barrier's timeout passed."""


@dataclass(frozen=True)
class LeaseLost(Event):
    """This node's lease is gone (expired, revoked, or the store unreachable)."""

    detail: str


@dataclass(frozen=True)
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


class Act(enum.Enum):
    READ_ROUND = "read_round"
    JOIN = "join"  # put rounds/R/join/me (if round still open R), drop waiting/me
    LEAVE = "leave"  # delete my join / waiting keys
    WAIT = "wait"  # put waiting/me
    CLOSE_ROUND = "close_round"
    OPEN_ROUND = "open_round"  # CAS round: closed R -> open R+1
    PUT_DONE = "put_done"
    MARK_FINISHED = "mark_finished"
    ARM = "arm"
    CANCEL = "cancel"
    RENEW_LEASE = "renew_lease"
    REVOKE = "revoke"
    RETURN_RESULT = "return_result"
    RETURN_CHANGE = "return_change"
    RETURN = "return"
    RAISE = "raise"


# What RAISE raises: the exception class (the driver writes its message).
RaisedError = type[RendezvousTimeout] | type[RendezvousClosed] | type[RestartBudgetExhausted]


@dataclass(frozen=True)
class Action:
    type: Act
    round: int = -1
    timer: Timer | None = None
    deadline: float = math.inf
    reason: str = ""
    detail: str = ""
    counts: bool = False  # OPEN_ROUND: counts against the restart budget
    error: RaisedError | None = None  # RAISE: what to raise


@dataclass(frozen=True)
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
