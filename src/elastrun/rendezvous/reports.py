"""What a node tells its operator about where it stands in the rendezvous
(pure: it reports and explains; it never reads the store, never prints).

Why a call gave up: :func:`call_error`, the message of the error a ``Raise``
action raises. Why a node waits: :func:`waiting_reason`, the ``node_waiting``
event's reason; what it waits for while ``next_round()`` runs:
:func:`waiting_status`, reported by :class:`ProgressReporter`.

The driver calls :meth:`ProgressReporter.update` each time it is about to wait
for its inbox (so: after every event it handled). The reporter derives a
:class:`~.api.WaitingStatus` from the machine's state, its armed deadlines and
the view, and reports it -- as a ``rendezvous_waiting`` event and to the
node's progress callback -- only when something a person would read changed:
the state, the round, the joined count or which deadline is next. The seconds
left are the reader's to count down (the console printer does).

Counts: the round's decider watches every join, so its count is live. The
others watch only their predecessor (O(n) watch events per round), so their
count is the one they read when they joined (``live`` false). Likewise only the
decider has the last-call deadline; the others estimate it from when they saw
``min`` reached.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping

from elastrun.errors import RendezvousClosed, RendezvousTimeout, RestartBudgetExhausted
from elastrun.event_kinds import RendezvousWaiting
from elastrun.events import EventSink
from elastrun.failure import describe_stored
from elastrun.rendezvous.api import RendezvousSettings, WaitingStatus
from elastrun.rendezvous.plan import View
from elastrun.rendezvous.protocol import Raise, State, Timer
from elastrun.rendezvous.records import RoundRecord, RoundState
from elastrun.rendezvous.rules import Rules
from elastrun.untrusted import printable

__all__ = ["ProgressReporter", "call_error", "nodes", "spare", "waiting_reason", "waiting_status"]

log = logging.getLogger(__name__)


# -- why a node waits, why a call gave up ----------------------------------------
def nodes(n: int) -> str:
    """``1 node``, ``2 nodes``."""
    return f"{n} node" if n == 1 else f"{n} nodes"


def spare(s: RendezvousSettings, n: int) -> bool:
    """Whether a node waits as a spare beside a round of ``n`` members (0:
    unknown): the round is at a size it cannot enlarge by joining."""
    return n > 0 and not s.sizes().room(n, 1)


def waiting_reason(s: RendezvousSettings, r: int, n: int) -> str:
    """Why a node waits after round ``r`` (of ``n`` members; 0: unknown)
    closed without it."""
    max_nodes = s.max_nodes
    if not n:
        return f"round {r} closed without this node"
    if s.node_unit > 1 and spare(s, n):
        return (
            f"round {r} has {nodes(n)} ({s.sizes().describe()}); waiting as a spare "
            "to replace a lost node"
        )
    if n >= max_nodes:
        return f"round {r} is full ({n} of max {nodes(max_nodes)}); waiting for a free place"
    return f"round {r} closed without this node ({n} of max {nodes(max_nodes)}); joining the next"


def call_error(
    a: Raise,
    s: RendezvousSettings,
    rnd: RoundRecord | None,
    current: int,
    joiner_hosts: Mapping[tuple[int, str], str],
) -> BaseException:
    """The error a call raises for the rules' ``Raise`` action ``a``:
    ``rnd``, the round record as this node last read it; ``current``, the
    round this node is in; ``joiner_hosts``, everyone seen joining, (round,
    node id) -> host."""
    if a.error is RendezvousClosed:
        return RendezvousClosed(f"job {s.run_id!r} has finished: there will be no further rounds")
    if a.error is RestartBudgetExhausted:
        # Another node's record: escaped, as the message reaches a terminal.
        last = printable(describe_stored(rnd.last_failure if rnd is not None else None))
        return RestartBudgetExhausted(
            f"job {s.run_id!r} used its restart budget ({s.max_restarts} "
            f"restart{'' if s.max_restarts == 1 else 's'}, "
            f"--max-restarts); last failure: {last}"
        )
    return _timeout_error(a.round, s, rnd, current, joiner_hosts)


def _timeout_error(
    r: int,
    s: RendezvousSettings,
    rnd: RoundRecord | None,
    current: int,
    joiner_hosts: Mapping[tuple[int, str], str],
) -> RendezvousTimeout:
    # Other nodes' host names: escaped, as the message reaches a terminal.
    joins = sorted(printable(h) for (jr, _), h in joiner_hosts.items() if jr == r)
    if current == r and rnd is not None and rnd.state is not RoundState.OPEN:
        return RendezvousTimeout(
            f"round {r} closed without this node and no new round opened before "
            f"join_timeout={s.join_timeout:g}s (job is full: max {nodes(s.max_nodes)})"
        )
    least = s.sizes().smallest or s.min_nodes
    unit = f" ({s.sizes().describe()})" if s.node_unit > 1 else ""
    return RendezvousTimeout(
        f"{len(joins)} of min {nodes(least)}{unit} joined before "
        f"join_timeout={s.join_timeout:g}s: {', '.join(joins) or 'none'}"
    )


# -- what a waiting node waits for ----------------------------------------------
def waiting_status(
    rules: Rules,
    timers: Mapping[Timer, float],
    view: View,
    settings: RendezvousSettings,
    now: float,
) -> WaitingStatus | None:
    """The node's waiting status, or None when it is not waiting to be a member."""
    state, ctx = rules.state, rules.ctx
    join_at = timers.get(Timer.JOIN, math.inf)
    if state in (State.JOINING, State.DECIDING):
        live = state is State.DECIDING
        joined = ctx.count
        deadline, at = "join_timeout", join_at
        last_call = timers.get(Timer.LAST_CALL)
        # The decider's timer is gone once it fired (the round is closing):
        # its last call still ends the wait, not the join timeout.
        if last_call is None and ctx.min_reached_at is not None:
            last_call = ctx.min_reached_at + settings.last_call_timeout
        if joined >= settings.min_nodes and last_call is not None and last_call <= at:
            deadline, at = "last_call", last_call
        return WaitingStatus(
            round=ctx.round,
            state="joining",
            joined=joined,
            min_nodes=settings.min_nodes,
            max_nodes=settings.max_nodes,
            deadline=deadline,
            seconds_left=_left(at, now),
            live=live,
        )
    if state is State.WAITING:
        rec = view.round
        r = rec.round if rec is not None else ctx.round
        round_state = rec.state if rec is not None else RoundState.CLOSED
        result = view.results.get(r)
        members = len(result.members) if result else 0
        if ctx.spare:
            detail = f"round {r} trains {nodes(members)}; waiting as a spare"
        elif round_state is RoundState.CLOSED and members >= settings.max_nodes:
            detail = f"round {r} is full ({members} of max {nodes(settings.max_nodes)})"
        else:
            detail = f"round {r} is {round_state.value}"
        return WaitingStatus(
            round=r,
            state="waiting",
            joined=members,
            min_nodes=settings.min_nodes,
            max_nodes=settings.max_nodes,
            deadline="join_timeout",
            seconds_left=_left(join_at, now),
            live=True,
            detail=detail,
        )
    return None


def _left(deadline: float, now: float) -> float:
    return math.inf if math.isinf(deadline) else round(max(0.0, deadline - now), 3)


class ProgressReporter:
    """Reports a node's waiting status on each change (see the module doc)."""

    def __init__(
        self,
        events: EventSink,
        node_id: str,
        callback: Callable[[], Callable[[WaitingStatus], None] | None],
    ) -> None:
        self.events = events
        self.node_id = node_id
        self._callback = callback  # read at each report: the caller may set it late
        self._last: tuple[object, ...] | None = None

    def update(self, status: WaitingStatus | None) -> None:
        if status is None:
            self._last = None
            return
        key = (status.round, status.state, status.joined, status.deadline, status.detail)
        if key == self._last:
            return
        self._last = key
        self.events.emit(
            RendezvousWaiting(
                node=self.node_id,
                round=status.round,
                state=status.state,
                joined=status.joined,
                min=status.min_nodes,
                max=status.max_nodes,
                deadline=status.deadline,
                seconds_left=None if math.isinf(status.seconds_left) else status.seconds_left,
                live=status.live,
                detail=status.detail,
            )
        )
        cb = self._callback()
        if cb is not None:
            try:
                cb(status)
            except Exception:  # a printer's bug must not break the rendezvous
                log.exception("rendezvous progress callback failed")
