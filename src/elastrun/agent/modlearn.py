"""Module learning, a feature of the agent: what the warm interpreter imports.

Where the list comes from (every name is checked: agent/modcache.py,
worker/_modnames.py):

* a local worker: its runner reports the modules it imported once it trains
  (a ``Modules`` message on its channel, worker/_runner.py), which the warm
  interpreter's pool (agent/warm_pool.py) records in the module cache and
  imports for the next start;
* the job: group rank 0's agent shares what it learnt as the job's note
  ``modules``; another node reads it once when it starts, and uses it only
  when the store authenticates its clients (otherwise anyone who reaches the
  store could name modules for every node to import), and then only the
  names that resolve to the standard library or an installed package here.

The runners are told which modules they may name (``ELASTRUN_MODULE_SCOPE``:
``installed``, or ``all`` with ``--warm-modules all``).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

from elastrun.agent.hooks import Core, Feature, RoundHooks
from elastrun.agent.workers import Worker, WorkerGroup
from elastrun.agent.zygote import SCOPE_ENV
from elastrun.event_kinds import ModulesNoteIgnored
from elastrun.rendezvous.notes import ModuleReport, Refused
from elastrun.worker._messages import Message, Modules

if TYPE_CHECKING:
    from elastrun.agent.warm_pool import WarmPool

__all__ = ["ModuleLearning"]

WORKER_WHY = frozenset(("optimizer_step", "timer"))  # why a worker reported its modules
NOTE_TIMEOUT = 5.0  # s to read the job's note


class ModuleLearning(Feature):
    """Learns what the script imports, for the warm interpreter's ``pool``."""

    def __init__(self, core: Core, pool: WarmPool) -> None:
        self.core = core
        self.pool = pool
        self.scope = "all" if core.spec.warm.modules == "all" else "installed"
        self._fetch: asyncio.Task[None] | None = None
        self._writes: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        # What the script imports, as the job's other nodes recorded it: a
        # node new to this job (a fresh machine) warms up as the others did.
        self._fetch = asyncio.ensure_future(self._fetch_note())

    async def fetched(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s) until the job's note was read."""
        if self._fetch is not None and not self._fetch.done():
            await asyncio.wait({self._fetch}, timeout=timeout)

    def round(self, group: WorkerGroup) -> RoundHooks:
        return _LearnRound(self, group)

    async def close(self) -> None:
        for task in (self._fetch, *self._writes):
            if task is not None:
                task.cancel()

    def learn(self, message: Modules, group: WorkerGroup) -> None:
        """A local worker's report: learnt, and (group rank 0) shared with the job."""
        report = ModuleReport.listed(
            list(message.modules), message.python, message.torch, self.pool.script
        )
        why = message.why if message.why in WORKER_WHY else "worker"
        if not self.pool.learn(report, why) or group.result.group_rank != 0:
            return
        # One node (group rank 0) shares the list with the job; only over a
        # store that authenticates its clients do the others use it.
        if not self.core.spec.warm.store_authenticated:
            return
        task = asyncio.ensure_future(self.core.rendezvous.write_note(self.pool.note()))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _fetch_note(self) -> None:
        """What the job's other nodes recorded the script imports (the note
        ``modules``): used only when the store authenticates its clients,
        and then only its names that pass the same checks as a local worker's."""
        pool, events = self.pool, self.core.events
        note: ModuleReport | Refused | None = None
        with contextlib.suppress(TimeoutError):
            note = await asyncio.wait_for(
                self.core.rendezvous.find_note(ModuleReport), NOTE_TIMEOUT
            )
        if note is None:
            return
        if not self.core.spec.warm.store_authenticated:
            events.emit(ModulesNoteIgnored(reason="unauthenticated"))
            pool.debug(
                "the job's module note is not used: the rendezvous store does not "
                "authenticate its clients (no token), so anyone who reaches it could "
                "have written it"
            )
            return
        if isinstance(note, Refused):
            events.emit(ModulesNoteIgnored(reason="invalid"))
            pool.debug("the job's module note is not a module list: not used")
            return
        # Its names pass the rule again in learn(), there against this script.
        pool.learn(note, "job", peer=True)


class _LearnRound(RoundHooks):
    def __init__(self, learning: ModuleLearning, group: WorkerGroup) -> None:
        self.learning = learning
        self.group = group

    def worker_env(self, worker: Worker) -> dict[str, str]:
        # Which modules the runner may name (worker/_runner.py).
        return {SCOPE_ENV: self.learning.scope}

    def on_message(self, worker: Worker, message: Message) -> None:
        if isinstance(message, Modules):
            self.learning.learn(message, self.group)
