"""The hooks of the agent's core, where its features plug in.

The core (agent/agent.py: the loop, the signals, the rounds; agent/workers.py:
one round's workers, spawned, watched, stopped and reaped) calls two kinds of
hooks, every one a no-op unless a feature overrides it:

* :class:`Feature`: one per feature, for the agent's whole run;
* :class:`RoundHooks` (agent/round_hooks.py, the only part of the hooks
  that agent/workers.py sees): a feature's part in one round, made by
  :meth:`Feature.round` for each :class:`~elastrun.agent.workers.WorkerGroup`
  (per-round state lives there, and goes with the round).

A feature gets what it may use of the agent as a :class:`Core` when it is
made. The hooks run in the order the features were made. ``before_round``
and ``failed`` are raced with the terminating signals (a signal cancels
them); the others run to their end, and must be bounded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import field
from typing import TYPE_CHECKING

from elastrun.agent.children import Reaper
from elastrun.agent.guard import OrphanGuard
from elastrun.agent.metrics import Metrics
from elastrun.agent.round_hooks import RoundHooks
from elastrun.agent.spec import WorkerSpec
from elastrun.clock import Clock
from elastrun.events import EventSink
from elastrun.frozen import frozen
from elastrun.rendezvous.api import Rendezvous

if TYPE_CHECKING:
    from elastrun.agent.workers import WorkerGroup

__all__ = ["Core", "Departure", "Feature", "Leave", "RoundHooks"]


@frozen
class Leave:
    """A feature asked this node to leave the job: ``line``, said on the
    console, and ``reason``, the ``job_failed`` event's."""

    line: str
    reason: str


class Departure:
    """A feature's request that this node leave the job now, while its
    workers train (a straggler replaced by a spare: agent/straggler_replacement.py).
    The agent's loop races :meth:`wait` with the workers' end and the round's
    changes; a request is dropped when a new round's workers start
    (:meth:`reset`)."""

    def __init__(self) -> None:
        self._leave: Leave | None = None
        self._event = asyncio.Event()

    def request(self, leave: Leave) -> None:
        if self._leave is None:
            self._leave = leave
            self._event.set()

    def reset(self) -> None:
        self._leave = None
        self._event.clear()

    async def wait(self) -> Leave:
        await self._event.wait()
        assert self._leave is not None
        return self._leave


@frozen
class Core:
    """What a feature may use of the agent: the spec, the rendezvous (its
    notes), the event log, the clock, the orphan guard and the reaper its
    own children must be registered with, and the console."""

    spec: WorkerSpec
    rendezvous: Rendezvous
    events: EventSink
    clock: Clock
    guard: OrphanGuard
    reaper: Reaper
    say: Callable[[str], None]
    # The Prometheus registry (agent/metrics.py) features feed; None: none.
    metrics: Metrics | None = None
    # Where a feature asks this node to leave the job (the agent's loop waits on it).
    departure: Departure = field(default_factory=Departure)


class Feature:
    """A part of the agent outside its core (see agent/agent.py)."""

    def start(self) -> None:
        """The agent starts (in its event loop, the orphan guard up), before
        it first joins the rendezvous."""

    async def before_round(self) -> None:
        """Before each round is joined."""

    def round(self, group: WorkerGroup) -> RoundHooks | None:
        """The feature's hooks for ``group``'s round (None: none), made
        before its workers start."""
        del group
        return None

    def on_child(self) -> None:
        """A child of the agent changed state (SIGCHLD, once for a burst)."""

    async def close(self) -> None:
        """The agent ends: stop and reap what the feature started (bounded)."""
