"""Warm starts: workers forked from an interpreter that already imported
what they need.

A worker start costs an interpreter, ``import torch`` and whatever the script
imports next (``torch.optim`` alone pulls in some 800 modules: seconds on a
fast disk, far more on a shared filesystem); every restart pays it again, and
N workers starting at once pay it N times over on the node's cores. The agent
keeps one warm interpreter instead, the *zygote* (``worker/_zygote.py``): it
is started with the worker's interpreter, flags, working directory, command
line and environment (less the per-round and per-rank variables), imports
torch and the modules the script imported when it last ran on this machine
(``agent/modcache.py``), and forks the workers when a round starts. A forked
worker has every one of those modules loaded (shared copy-on-write with the
zygote), and runs the script as ``python -u script`` would.

When the zygote is used:

* ready (its imports done): always;
* still importing: for a script that imports the preloaded modules itself
  (its source says so, or its module list was recorded; ``launch(fn)``: the
  source of the function's module, ``PythonModule.source``), it is a head start
  (raised to normal priority): with more workers than usable CPUs the start
  waits for it (at most ``READY_WAIT``: one import beats N fighting for the
  cores); otherwise the workers are forked as soon as it has torch, between
  two of its imports, and import the rest themselves, in parallel;
* never for a script that does not import them: its workers start cold at
  once, and the zygote is kept for a later start.

A zygote that has died, or was started with an environment that differs from
a worker's in anything but the per-round and per-rank variables
(``ROUND_VARS``, ``LOCAL_VARS``: the local rank, torch's file timer pipe; with
``--virtual-local-rank`` also each rank's ``CUDA_VISIBLE_DEVICES``,
``DEVICE_VARS``, set when the worker is forked: the zygote never initialises
CUDA), is discarded and the workers start cold: a
warm start can only save time, never change what runs. The zygote imports at
idle CPU priority where it may return to normal priority afterwards (root or
``CAP_SYS_NICE``), otherwise after a delay, so it does not slow the workers'
own start. It is the agent's child like a worker: own session,
``PR_SET_PDEATHSIG``, registered with the orphan guard, killed when the agent
ends or no start will need it. Workers are forked through an intermediate
process so that they are the agent's children (``agent/children.py``).

A script that sets an environment variable before it imports what the
zygote imports (its source says so: agent/env_first.py) starts cold, with one
line saying why: the zygote would have imported torch without it.

Only a Python command (a script or ``-m`` module, not ``--no-python`` or
``--run-path``) gets a zygote (``WorkerSpec.warm``: :class:`~elastrun.agent.spec.WarmSettings`).

As a feature of the agent (:class:`WarmStarts`, made by :func:`features`):
it starts the zygote when the agent starts (it imports while the rendezvous
runs), forks each round's workers from it (the ``fork`` hook), keeps one for
the next start or kills it when no start will need it (``started``), makes
a node joining a running job wait (bounded) for it before it enters the
round (``before_round``), reaps the zygotes let go (``on_child``). The zygote
process itself: agent/zygote.py. What it imports is learnt from the workers
and the job (agent/modlearn.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from elastrun.agent.children import ForkedProcess
from elastrun.agent.command import Executable
from elastrun.agent.hooks import Core, Feature, RoundHooks
from elastrun.agent.modcache import ModuleCache, cache_key
from elastrun.agent.modlearn import NOTE_TIMEOUT, ModuleLearning
from elastrun.agent.warm_pool import WarmPool
from elastrun.agent.workers import WorkerGroup
from elastrun.event_kinds import WarmJoin
from elastrun.rendezvous.api import RoundResult

__all__ = ["WarmStarts", "features"]


def features(core: Core) -> list[Feature]:
    """Warm starts, and the module learning that feeds them: none for a
    program run as given, or with ``--no-warm``."""
    spec, command, settings = core.spec, core.spec.command, core.spec.warm
    if not settings.enabled or isinstance(command, Executable):
        return []
    cache = None
    if settings.modules != "torch" and settings.cache is not None:
        cache = ModuleCache(settings.cache, cache_key(command, os.getcwd()))
    pool = WarmPool(
        spec,
        command,
        core.events,
        core.guard,
        core.reaper,
        cache=cache,
        scope="all" if settings.modules == "all" else "installed",
        say=core.say,
    )
    if settings.modules == "torch":  # torch alone: nothing to learn
        return [WarmStarts(core, pool)]
    learning = ModuleLearning(core, pool)
    return [learning, WarmStarts(core, pool, learning)]


class WarmStarts(Feature):
    """The warm interpreter as a feature of the agent (see the module doc)."""

    def __init__(self, core: Core, pool: WarmPool, learning: ModuleLearning | None = None) -> None:
        self.core = core
        self.pool = pool
        self.learning = learning

    def start(self) -> None:
        # It starts (and imports torch) while the rendezvous runs; the
        # round's variables come when it closes.
        self.pool.say_cold()  # none for a script that sets its environment first
        self.pool.fixed_ranks = self.core.rendezvous.settings.max_nodes == 1
        self.pool.keep(self.pool.first_env(self.core.rendezvous.settings.max_restarts))

    async def before_round(self) -> None:
        """Before joining a job that trains without this node: wait (bounded)
        for the warm interpreter, so the others pause only for the restart,
        not for this node's imports."""
        pool, timeout = self.pool, self.core.spec.warm.join_timeout
        if timeout <= 0 or not pool.pids:
            return
        if self.learning is not None:
            await self.learning.fetched(NOTE_TIMEOUT)  # what the job imports, first
        if pool.ready or not await self.core.rendezvous.joining_running_job():
            return
        say, clock = self.core.say, self.core.clock
        say(
            f"elastrun: joining a running job: waiting up to {timeout:g}s for the warm "
            "interpreter first, so the others pause only for the restart"
        )
        t0 = clock.monotonic()
        ready = await pool.wait_ready(timeout)
        waited = clock.monotonic() - t0
        self.core.events.emit(WarmJoin(waited_s=round(waited, 3), ready=ready, timeout=timeout))
        if not ready:
            pool.use_unready = False  # too slow to wait for at the start too
            say(f"elastrun: the warm interpreter is not ready after {waited:.0f}s; joining anyway")

    def round(self, group: WorkerGroup) -> RoundHooks:
        return _WarmRound(self, group)

    def on_child(self) -> None:
        self.pool.on_child()

    async def close(self) -> None:
        await self.pool.close()

    def may_restart(self, result: RoundResult) -> bool:
        """Whether these workers can still be started again (restarts left, or
        a membership change, which is never counted)."""
        settings = self.core.rendezvous.settings
        return result.restart_count < result.max_restarts or settings.min_nodes < settings.max_nodes


class _WarmRound(RoundHooks):
    def __init__(self, warm: WarmStarts, group: WorkerGroup) -> None:
        self.warm = warm
        self.group = group

    async def fork(
        self, envs: Mapping[int, Mapping[str, str]], channels: Mapping[int, int]
    ) -> dict[int, ForkedProcess]:
        last = not self.warm.may_restart(self.group.result)
        return await self.warm.pool.fork(envs, channels, last=last)

    def started(self) -> None:
        pool = self.warm.pool
        if self.warm.may_restart(self.group.result):
            pool.keep_all(self.group.envs)  # for the next start
        else:
            pool.drop()
