"""The rendezvous state machine's vocabulary: states, events, actions, timers.

Pure data, shared by the rules (:mod:`.rules`, which re-exports every name)
and the driver (:mod:`.dynamic` and its parts). See the table in
:mod:`.rules` for what each event does in each state.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

__all__ = [
    "Act",
    "Action",
    "Context",
    "Ev",
    "Event",
    "LocalProtocolError",
    "State",
    "Timer",
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


class Ev(enum.Enum):
    NEXT_ROUND = "next_round"
    ROUND_OPEN = "round_open"
    ROUND_CLOSED = "round_closed"
    ROUND_FINISHED = "round_finished"
    ROUND_FAILED = "round_failed"
    JOINERS_CHANGED = "joiners_changed"
    LAST_CALL_EXPIRED = "last_call_expired"
    JOIN_TIMEOUT = "join_timeout"
    MEMBER_LOST = "member_lost"
    NODE_WAITING = "node_waiting"
    WORKERS_FAILED = "workers_failed"
    WORKERS_SUCCEEDED = "workers_succeeded"
    BARRIER_DONE = "barrier_done"
    BARRIER_TIMEOUT = "barrier_timeout"
    LEASE_LOST = "lease_lost"
    SHUTDOWN = "shutdown"


class Timer(enum.Enum):
    JOIN = "join"
    LAST_CALL = "last_call"
    BARRIER = "barrier"


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


@dataclass(frozen=True)
class Event:
    type: Ev
    now: float = 0.0  # the node's monotonic clock when observed
    round: int = -1  # ROUND_*: the round number in the record
    member: bool = False  # ROUND_CLOSED: this node is in the result
    room: bool = False  # ROUND_CLOSED / NODE_WAITING: the closed round's world < max
    lost: str = ""  # ROUND_CLOSED: a member of the round is gone (detail)
    count: int = 0  # JOINERS_CHANGED: live joiners of the round
    decider: bool = False  # JOINERS_CHANGED: this node is the round's decider
    all_joined: bool = False  # JOINERS_CHANGED: re-formed round, every present node joined
    restarts: int = 0  # WORKERS_FAILED: restarts of the job used so far
    detail: str = ""


@dataclass(frozen=True)
class Action:
    type: Act
    round: int = -1
    timer: Timer | None = None
    deadline: float = math.inf
    reason: str = ""
    detail: str = ""
    counts: bool = False  # OPEN_ROUND: counts against the restart budget
    error: str = ""  # RAISE: "timeout" | "closed" | "budget"


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
