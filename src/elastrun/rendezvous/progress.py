"""What a node waiting in ``next_round()`` waits for (it reports; it never prints).

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

from elastrun.events import EventSink
from elastrun.rendezvous.api import RendezvousSettings, WaitingStatus
from elastrun.rendezvous.plan import View
from elastrun.rendezvous.records import RoundState
from elastrun.rendezvous.rules import Rules, State, Timer

__all__ = ["ProgressReporter", "waiting_status"]

log = logging.getLogger(__name__)


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
            detail = f"round {r} trains {_nodes(members)}; waiting as a spare"
        elif round_state is RoundState.CLOSED and members >= settings.max_nodes:
            detail = f"round {r} is full ({members} of max {_nodes(settings.max_nodes)})"
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


def _nodes(n: int) -> str:
    """``1 node``, ``2 nodes``."""
    return f"{n} node" if n == 1 else f"{n} nodes"


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
            "rendezvous_waiting",
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
        cb = self._callback()
        if cb is not None:
            try:
                cb(status)
            except Exception:  # a printer's bug must not break the rendezvous
                log.exception("rendezvous progress callback failed")
