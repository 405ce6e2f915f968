"""The warm interpreter of a node, across rounds (agent/warm.py says when
and why it is used): it starts the zygote (agent/zygote.py) with the stable
part of a worker's environment, forks workers from it, learns what it should
import (``learn``, fed by agent/modlearn.py), keeps it compatible with the
workers it will fork, and discards and reaps it. For packages that read a
rank variable when imported it also keeps one per local rank
(agent/warm_ranks.py), and forks a rank's worker from it when the rank's
variables are the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence

from elastrun.agent.channel import CHANNEL_ENV
from elastrun.agent.children import ForkedProcess, Reaper
from elastrun.agent.command import PythonCommand, with_local_rank
from elastrun.agent.env import ROUND_ENV_VARS, stable_env
from elastrun.agent.env_first import EnvFirst, env_set_first
from elastrun.agent.file_timers import TIMER_FILE_ENV
from elastrun.agent.guard import OrphanGuard
from elastrun.agent.modcache import (
    ModuleCache,
    ModuleList,
    installed_only,
    merged,
    skipped,
    valid_names,
)
from elastrun.agent.spawn import entry_file, imports_any, launcher_stdin
from elastrun.agent.spec import WorkerSpec
from elastrun.agent.stacks import STACK_SIGNAL_ENV, STACKS_ENV
from elastrun.agent.warm_ranks import RANK_VARS, RankZygotes, rank_part
from elastrun.agent.watchdog import HEARTBEAT_ENV, HEARTBEAT_INTERVAL_ENV, heartbeat_interval
from elastrun.agent.zygote import SCOPE_ENV, Bounds, Zygote, promote
from elastrun.errors import WorkerError
from elastrun.event_kinds import (
    ModulesRecorded,
    WarmDiscarded,
    WarmFailed,
    WarmReady,
    WarmStarted,
    WarmUsed,
)
from elastrun.events import EventSink
from elastrun.rendezvous.notes import ModuleReport
from elastrun.untrusted import printable
from elastrun.worker._messages import PreloadPlan, Ready, Unsafe
from elastrun.worker._modnames import script_module
from elastrun.worker._restart import ROUND_ENV
from elastrun.worker.local_main import ENV as LOCAL_MAIN_ENV
from elastrun.worker.snapshot import ENV as MEMORY_CHECKPOINT_ENV
from elastrun.worker.snapshot import REPLICA_ENV as MEMORY_REPLICA_ENV

__all__ = [
    "DEBUG_ENV",
    "DEVICE_VARS",
    "LOCAL_VARS",
    "ROUND_VARS",
    "WarmPool",
    "compatible",
    "local_vars",
    "usable_cpus",
]

DEBUG_ENV = "ELASTRUN_DEBUG"  # read by the launcher: WarmSettings.debug

PRELOAD = ("torch",)
UNPRIVILEGED_DELAY = 3.0  # s: without idle priority, let cold workers import first
PRELOAD_BUDGET = 120.0  # s a zygote may spend importing
PRELOAD_MAX_RSS = 4096  # MiB a zygote may grow to while importing
IMPORT_TIMEOUT = 60.0  # s one import may take in a zygote (then: unsafe)
READY_WAIT = 60.0  # s a start of more workers than CPUs waits for a zygote importing
MAX_REFUSALS = 8  # zygotes quitting on an unsafe module before the list is dropped
REAP_WAIT = 2.0

# Worker variables that change from round to round, and from local rank to
# local rank; everything else in a worker's environment must be what the
# zygote was started with.
# (The memory checkpoint folder is per agent and local rank: a round's part too.)
ROUND_VARS = frozenset(
    (
        *ROUND_ENV_VARS,
        ROUND_ENV,
        HEARTBEAT_ENV,
        HEARTBEAT_INTERVAL_ENV,
        STACKS_ENV,
        STACK_SIGNAL_ENV,
        MEMORY_CHECKPOINT_ENV,
        MEMORY_REPLICA_ENV,
    )
)
# The flag: --virtual-local-rank only; torch's file timer: a pipe per local rank.
LOCAL_VARS = frozenset(("LOCAL_RANK", LOCAL_MAIN_ENV, TIMER_FILE_ENV))
# With --virtual-local-rank, the device variables differ by local rank too
# (agent/env.py virtual_local_rank). They are set when a worker is forked: the
# zygote never initialises CUDA nor loads its driver (worker/_zygote.py refuses
# a module that does), so the worker's first CUDA call is the first to read
# them; a module that reads one while imported is left to the per-rank zygotes,
# started with their rank's value (agent/warm_ranks.py).
DEVICE_VARS = frozenset(("CUDA_VISIBLE_DEVICES",))

# Set per worker by the agent for the runner, which removes them.
RUNNER_VARS = frozenset((SCOPE_ENV, CHANNEL_ENV))


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def local_vars(spec: WorkerSpec) -> frozenset[str]:
    """The variables that differ from local rank to local rank for ``spec``."""
    return LOCAL_VARS | DEVICE_VARS if spec.virtual_local_rank else LOCAL_VARS


def compatible(
    started: Mapping[str, str], wanted: Mapping[str, str], local: frozenset[str] = LOCAL_VARS
) -> str | None:
    """None if a zygote started with ``started`` may fork a worker with
    ``wanted``; otherwise the first variable that differs (the runner's own
    variables, which it removes before the script runs, aside). ``local``:
    the per-local-rank variables (:func:`local_vars`)."""
    skip = ROUND_VARS | local | RUNNER_VARS
    for key in sorted(set(started) | set(wanted)):
        if key not in skip and started.get(key) != wanted.get(key):
            return key
    return None


class WarmPool:
    """The node's warm interpreter, across rounds."""

    def __init__(
        self,
        spec: WorkerSpec,
        command: PythonCommand,
        events: EventSink,
        guard: OrphanGuard | None = None,
        reaper: Reaper | None = None,
        *,
        preload: Sequence[str] = PRELOAD,
        cache: ModuleCache | None = None,
        scope: str = "installed",
        budget: float = PRELOAD_BUDGET,
        max_rss_mb: float = PRELOAD_MAX_RSS,
        import_timeout: float = IMPORT_TIMEOUT,
        say: Callable[[str], None] | None = None,
    ) -> None:
        self.spec = spec
        self.command = command
        self.events = events
        self.guard = guard
        self.reaper = reaper if reaper is not None else Reaper()
        self.preload = tuple(preload)
        self.cache = cache
        self.scope = scope
        self.budget = budget
        self.max_rss_mb = max_rss_mb
        self.import_timeout = import_timeout
        self._say = say
        # The module name that would run the script: never imported ahead of time.
        self.script = script_module(command.kind, command.target)
        self._cache_said = False
        self.recorded = cache.load(self.script) if cache is not None else ModuleList()
        self._cache_problem()
        # A zygote still importing is a head start only for a worker that
        # imports the same: a script that never imports torch would wait for it.
        self.head_start = (
            not self.preload
            or bool(self.recorded.modules)
            or imports_any(entry_file(command), self.preload)
        )
        # A script that sets its environment before it imports what the zygote
        # imports: its workers start cold (a warm start must only save time).
        self.cold: EnvFirst | None = env_set_first(
            entry_file(command), (*self.preload, *self.recorded.modules)
        )
        self._z: Zygote | None = None
        self._dead: list[subprocess.Popen[bytes]] = []
        self._closed = False
        self.error: WorkerError | None = None
        # False for the next start only: a zygote still importing is not used
        # (set when a joining node stopped waiting for it: it is slow).
        self.use_unready = True
        # True once the last start that could use a zygote has used what it
        # could (``fork``: a start no other can follow): none is started then,
        # e.g. to replace one that quit while it forked; ``keep`` ends it.
        self.last_start = False
        self.refusals = 0  # zygotes that quit on an unsafe module
        self.gave_up = False  # the recorded list was dropped once already
        self.local = local_vars(spec)
        self.ranks = RankZygotes(self._spawn, self._discard, self._compatible)
        # Every round gives each local rank the same rank variables (a job of
        # one node: WarmStarts sets it): a rank with its own zygote never needs
        # the shared one, which is then not kept beside them.
        self.fixed_ranks = False

    def _compatible(self, started: Mapping[str, str], wanted: Mapping[str, str]) -> str | None:
        return compatible(started, wanted, self.local)

    # ------------------------------------------------------------ state
    @property
    def pids(self) -> list[int]:
        z = self._z
        return [] if z is None or z.gone else [z.pid]

    @property
    def ready(self) -> bool:
        z = self._z
        return z is not None and z.gone is None and z.ready

    def first_env(self, max_restarts: int) -> dict[str, str]:
        """The zygote's environment before the first round: the stable part of a
        worker's (the round's part comes with the fork order). ``max_restarts``
        as this node's settings say; should the job's differ, the zygote is
        discarded at the first fork."""
        env = stable_env(self.spec, 0, self.spec.run_id, max_restarts)
        if self.spec.hang.timeout is not None:
            env[HEARTBEAT_INTERVAL_ENV] = repr(heartbeat_interval(self.spec.hang.timeout))
        return env

    # ------------------------------------------------------------ starting
    def keep(self, env: Mapping[str, str]) -> None:
        """Make sure a zygote compatible with workers of environment ``env``
        lives (after a start: for the next one), unless every local rank has
        its own (``per_rank_only``): then none is started, and one that lives
        is kept until they are all ready (a start before then forks from it,
        not from them still importing)."""
        if self._closed or self.cold is not None:
            return
        self.reap()
        self._catch_up()  # a refusal read: the new zygote leaves the module out
        z = self._z
        if z is not None and _alive(z):
            why = self._compatible(z.env, env)
            if why is None:
                if not self.per_rank_only():
                    return
                self._let_shared_go()
                return
            self._discard(z, f"started with a different {why}")
            self._z = None
        if not self.per_rank_only():
            self._z = self._spawn(env)

    def _let_shared_go(self) -> None:
        """The shared zygote, once every local rank's own is ready
        (``per_rank_only``) and it forks nothing: let go."""
        z = self._z
        if z is None or not _alive(z) or z.pending is not None or not self.per_rank_only():
            return
        if all(rz.ready for rz in self.ranks.zygotes()):
            z.catch_up()  # a refusal it sent is recorded, not let go with it
            if self._z is z and z.gone is None:
                self._discard(z, "every local rank has its own")
                self._z = None

    def keep_ranks(self, envs: Mapping[int, Mapping[str, str]]) -> None:
        """After a start (``envs``: its workers'): per-rank zygotes for the
        same ranks, when a recorded package reads a rank variable at import."""
        if not self._closed and self.cold is None:
            self._catch_up()
            self.ranks.keep(envs, wanted=bool(self.recorded.ranked))

    def keep_all(self, envs: Mapping[int, Mapping[str, str]]) -> None:
        """After a start (``envs``: its workers', by local rank): the zygotes
        the next start may fork from, per rank first (``per_rank_only``)."""
        self.last_start = False  # a start may follow
        self.keep_ranks(envs)
        self.keep(envs[min(envs)])

    def per_rank_only(self) -> bool:
        """Whether no start would fork from the shared zygote: the ranks are
        the same in every round (``fixed_ranks``) and each local rank of the
        last round has its own zygote, alive."""
        ranks = self.ranks
        return (
            self.fixed_ranks
            and bool(ranks.envs)
            and all(lr in ranks.by_rank and _alive(ranks.by_rank[lr]) for lr in ranks.envs)
        )

    def _spawn(self, env: Mapping[str, str], local_rank: int | None = None) -> Zygote | None:
        if self.last_start or self._closed or self.cold is not None:
            return None  # no start could use it
        if not self.reaper.enable():
            if self.error is None:
                self.error = self.reaper.error
                self.events.emit(WarmFailed(reason=str(self.reaper.error)))
            return None
        argv = self.command.worker_argv(None)  # the fork order brings each rank's arguments
        # Only what every worker shares: no rank, round or runner variable
        # (a per-rank one: its rank's variables too).
        z_env = {k: v for k, v in env.items() if k not in ROUND_VARS | self.local | RUNNER_VARS}
        watch = ROUND_VARS | self.local
        skip = dict(self.recorded.skip)
        if local_rank is None:
            skip.update(self.recorded.ranked)
        else:
            # Its rank's variables, and its local rank's own (its device, its
            # timer pipe: the same for a local rank in every round).
            z_env.update(rank_part(env))
            z_env.update({k: env[k] for k in sorted(self.local - RANK_VARS) if k in env})
            watch = watch - RANK_VARS - self.local
        modules = [m for m in (*self.preload, *self.recorded.modules) if not skipped(m, skip)]
        preload = PreloadPlan(
            modules=tuple(modules),
            python=self.recorded.python,
            torch=self.recorded.torch,
            # What a module must not read while the zygote imports it.
            watch=tuple(sorted(watch)),
            # Imported before any fork: every worker forked has torch.
            base=sum(1 for m in self.preload if not skipped(m, skip)),
        )
        bounds = Bounds(UNPRIVILEGED_DELAY, self.budget, self.max_rss_mb, self.import_timeout)
        try:
            z = Zygote.start(argv, z_env, preload, self.scope, bounds, local_rank=local_rank)
        except OSError as e:
            self.events.emit(WarmFailed(reason=str(e), local_rank=local_rank))
            return None
        if self.guard is not None:
            self.guard.add(z.pid)
        # Whatever an import starts in the zygote's session comes to the agent
        # if the zygote is killed first: reaped like a worker's orphans.
        self.reaper.watch_session(z.pid)
        self.events.emit(WarmStarted(pid=z.pid, modules=len(modules), local_rank=local_rank))
        z.watch(self._ready, self._refused)
        return z

    # ------------------------------------------------------------ its messages
    def _catch_up(self) -> None:
        """Read what every zygote sent and the event loop has not read yet
        (``Zygote.catch_up``): before anything is decided about them (one
        found ended is let go), so that a refusal it sent is handled first."""
        for z in [self._z, *self.ranks.zygotes()]:
            if z is not None:
                z.catch_up()

    def _ready(self, z: Zygote, message: Ready) -> None:
        self.events.emit(
            WarmReady(
                pid=z.pid,
                local_rank=z.local_rank,
                preload_s=round(time.monotonic() - z.started, 3),
                loaded=message.loaded,
                failed=[name for name, _ in message.failed],
                rss_mb=round(message.rss_kb / 1024, 1),
                stopped=message.stopped,
            )
        )
        for name, why in message.failed:
            self.debug(f"warm interpreter skipped module {name}: {why}")
        if z.local_rank is not None:
            self._let_shared_go()
        if message.stopped:
            self.debug(f"warm interpreter stopped importing: {message.stopped}")

    def _refused(self, z: Zygote, message: Unsafe) -> None:
        """The zygote found a module unsafe to import ahead of time and quit:
        remember it (with its package) and start another without it, a bounded
        number of times. A package that read a rank variable is left to the
        per-rank zygotes (agent/warm_ranks.py) instead."""
        names, why = valid_names(list(message.modules)), message.why
        per_rank = RANK_VARS | self.local
        ranked = z.local_rank is None and message.variable in per_rank and bool(names)
        for name in names:
            if ranked:
                self.recorded.ranked[name] = why
            else:
                self.recorded.skip[name] = why
                self.recorded.ranked.pop(name, None)
        self.recorded.modules = [
            m for m in self.recorded.modules if not skipped(m, self.recorded.skip)
        ]
        self._save()
        shown = "a module is"
        if names:
            shown = f"modules {', '.join(names)} are" if len(names) > 1 else f"module {names[0]} is"
        where = "imported ahead of time by the per-rank warm interpreters only"
        self._discard(
            z, f"{shown} {where if ranked else 'not safe to import ahead of time'}: {why}"
        )
        self.debug(f"{shown} {'only per rank' if ranked else 'not'} imported ahead of time: {why}")
        self.refusals += 1
        if z.local_rank is not None:
            self.ranks.forget(z)
            self.ranks.given_up = self.refusals > MAX_REFUSALS
            self.keep_ranks(self.ranks.envs)
            self._cover()
            return
        if ranked:
            self.keep_ranks(self.ranks.envs)  # the ranks of the round running, if any
        if self._z is not z:
            return
        if self.per_rank_only():
            self._z = None  # no start would fork from a new one
            return
        if not names or self.refusals > MAX_REFUSALS:
            # Something keeps refusing that the skip list does not catch:
            # torch alone from now on, and after that, no zygote at all.
            if self.gave_up:
                self._z = None
                return
            self.gave_up = True
            self.recorded = ModuleList(skip=self.recorded.skip)
        self._z = self._spawn(z.env)

    def say_cold(self) -> None:
        """The one line that says why the workers start cold (``cold``)."""
        if self.cold is None:
            return
        line = f"{self.cold.describe()}: its workers start cold"
        self.events.emit(WarmFailed(reason=line))
        if self._say is not None:
            self._say(f"elastrun: {printable(line, limit=1000)}")

    def debug(self, line: str) -> None:
        """``line`` on the agent's console with ``ELASTRUN_DEBUG`` set (WarmSettings.debug)."""
        if self._say is not None and self.spec.warm.debug:
            self._say(f"elastrun: debug: {printable(line, limit=1000)}")

    # ------------------------------------------------------------ learning
    def learn(self, report: ModuleReport, why: str, *, peer: bool = False) -> bool:
        """The modules a script imported, as a local worker reported them or
        (``peer``) as the job's note from another node says: remember them,
        and have the zygote import the new ones for the next start. Every name
        passes ``_modnames.refusal`` (again: ``report`` may have been built by
        hand); a peer's names must also resolve to the standard library or an
        installed package here, unless the scope is ``all``. True when there
        were new ones."""
        names = valid_names(list(report.modules), script=self.script)
        if peer and self.scope != "all":
            names = installed_only(names)
        known = set(self.preload) | set(self.recorded.modules)
        new = [n for n in names if n not in known and not skipped(n, self.recorded.skip)]
        if report.refused or len(names) < len(report.modules):
            dropped = report.refused + len(report.modules) - len(names)
            self.debug(f"{dropped} module names {'of the job' if peer else 'reported'} refused")
        if not new:
            return False
        self.recorded.modules = merged(self.recorded.modules, new, self.recorded.skip)
        if self.cold is None:
            self.cold = env_set_first(entry_file(self.command), new)
            if self.cold is not None:
                self.say_cold()
                self.drop(f"the script sets {self.cold.variable} before it imports one")
        self.recorded.python = report.python
        self.recorded.torch = report.torch
        self.head_start = True
        saved = self._save()
        self.events.emit(
            ModulesRecorded(
                modules=len(self.recorded.modules),
                new=len(new),
                why=why,
                cache=self.cache.path if self.cache is not None and saved else None,
            )
        )
        z = self._z
        shared = [n for n in new if not skipped(n, self.recorded.ranked)]
        if z is not None and z.gone is None and shared:
            z.preload(shared)
        for rz in self.ranks.zygotes():
            if rz.gone is None:
                rz.preload(new)
        return True

    def note(self) -> ModuleReport:
        """What the other agents of the job may learn from this one."""
        r = self.recorded
        return ModuleReport(tuple(r.modules), r.python, r.torch)

    def _save(self) -> bool:
        if self.cache is None:
            return False
        if self.cache.save(self.recorded):
            return True
        self._cache_problem()
        return False

    def _cache_problem(self) -> None:
        """Say why the cache could not be used: a refused file or folder once
        on the console (it costs only warmth), a plain I/O failure in debug."""
        cache = self.cache
        if cache is None or cache.error is None:
            return
        line = f"module cache: {cache.error}"
        if not cache.refused or self._cache_said:
            self.debug(line)
            return
        self._cache_said = True
        if self._say is not None:
            self._say(f"elastrun: warning: {printable(line, limit=1000)}")

    # ------------------------------------------------------------ using
    async def wait_ready(self, timeout: float) -> bool:
        """Wait (bounded) until the zygote is ready; False if it is not (or gone)."""
        z = self._z
        if z is None or z.gone is not None:
            return False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(z.ready_event.wait(), timeout)
        return z.gone is None and z.ready

    async def fork(
        self,
        envs: Mapping[int, Mapping[str, str]],
        channels: Mapping[int, int],
        *,
        last: bool = False,
    ) -> dict[int, ForkedProcess]:
        """Workers forked from the zygotes, by local rank: each with its
        environment ``envs[lr]`` and its channel socket fd ``channels[lr]``
        (see worker/_runner.py); from its rank's zygote where one is ready for
        the same ranks, otherwise from the shared one. Those missing start cold
        (the zygote cannot be used now; one still importing is kept for later).
        ``last``: no start can follow this one; once the shared zygote is the
        only one left to fork from, no zygote is started any more (one that
        quits now is not replaced: nothing could use it)."""
        forked: dict[int, ForkedProcess] = {}
        if self.cold is not None:
            return forked
        self._catch_up()
        # Without a shared zygote (``per_rank_only``), a rank's zygote still
        # importing is the head start the shared one would have been.
        shared = self._z is not None and self._z.gone is None
        unready = not shared and self.head_start and self.use_unready
        own = self.ranks.take(envs, unready=unready)
        for z in own.values():
            if not z.ready:
                promote(z.pid)
        # Every rank's order at once: a zygote still importing forks once the
        # import it is in is done, and the other ranks' do not wait in turn.
        for got in await asyncio.gather(
            *(self._fork_from(z, {lr: envs[lr]}, channels, 0.0) for lr, z in own.items())
        ):
            forked.update(got)
        self.last_start = last
        rest = {lr: env for lr, env in envs.items() if lr not in forked}
        if rest:
            forked.update(await self._fork_shared(rest, channels))
        return forked

    async def _fork_shared(
        self, envs: Mapping[int, Mapping[str, str]], channels: Mapping[int, int]
    ) -> dict[int, ForkedProcess]:
        z = self._usable(envs)
        if z is None:
            return {}
        waited = time.monotonic()
        use_unready, self.use_unready = self.use_unready, True
        if not z.ready:
            # The workers would import the same themselves: the zygote's
            # import is a head start (and one import, not one per worker).
            if not (self.head_start and use_unready):
                return {}
            promote(z.pid)
            # More workers than CPUs: one import beats N fighting for the
            # cores, so wait for all of it. Otherwise fork now: the zygote
            # forks once it has torch, between two imports, and the workers
            # import the rest in parallel.
            if len(envs) > usable_cpus() and not await self.wait_ready(READY_WAIT):
                return {}  # gone, or too slow: start cold (a slow one is kept)
        return await self._fork_from(z, envs, channels, time.monotonic() - waited)

    async def _fork_from(
        self,
        z: Zygote,
        envs: Mapping[int, Mapping[str, str]],
        channels: Mapping[int, int],
        waited: float,
    ) -> dict[int, ForkedProcess]:
        orders = {
            lr: (envs[lr], with_local_rank(self.command.args, lr), channels[lr]) for lr in envs
        }
        try:
            forked = await z.fork_workers(orders, launcher_stdin())
        except (OSError, TimeoutError) as e:
            self._discard(z, f"cannot fork workers: {e!r}")
            self.ranks.forget(z)
            if self._z is z:
                self._z = None
            return {}
        for lr, proc in forked.items():
            self.reaper.watch_session(proc.pid)
            if self.guard is not None:
                self.guard.add(proc.pid)
            self.events.emit(
                WarmUsed(
                    local_rank=lr,
                    pid=proc.pid,
                    zygote=z.pid,
                    per_rank=z.local_rank is not None,
                    warm_s=round(time.monotonic() - z.started, 3),
                    waited_s=round(waited, 3),
                )
            )
        return forked

    def _usable(self, envs: Mapping[int, Mapping[str, str]]) -> Zygote | None:
        """The zygote, if workers with ``envs`` can be forked from it (an
        exited or incompatible one is discarded)."""
        z = self._z
        if z is None or not envs:
            return None
        # What it sent first (a zygote that ended is gone then): one that
        # refused a module just now was replaced, and the workers start cold.
        z.catch_up()
        if self._z is not z:
            return None
        if z.gone is not None:
            self._discard(z, z.gone)
            self._z = None
            return None
        for env in envs.values():
            why = self._compatible(z.env, env)
            if why is not None:
                self._discard(z, f"started with a different {why}")
                self._z = None
                return None
        return z

    # ------------------------------------------------------------ ending
    def _discard(self, z: Zygote, reason: str) -> None:
        if z.gone is not None and z.gone.startswith("discarded"):
            return  # let go already (its refusal, read while an order failed)
        self.events.emit(WarmDiscarded(pid=z.pid, reason=reason, local_rank=z.local_rank))
        z.kill(f"discarded: {reason}")
        self._dead.append(z.popen)

    def _cover(self) -> None:
        """A per-rank zygote was lost: the shared one again, when it was not
        kept because of them (``per_rank_only``) and a start may follow."""
        z, envs = self._z, self.ranks.envs
        lost = self.fixed_ranks and envs and (z is None or z.gone is not None)
        if lost and not (self._closed or self.last_start or self.per_rank_only()):
            self.keep(envs[min(envs)])

    def on_child(self) -> None:
        """A child exited (SIGCHLD): what the zygotes sent is read (a zygote
        that refused a module exits at once); reap the zygotes let go; should a
        rank's own zygote have died, the shared one is started again if it was
        not kept because of them (its rank's next start is not colder)."""
        self._catch_up()
        self.reap()
        if not all(_alive(z) for z in self.ranks.zygotes()):
            self._cover()

    def reap(self) -> None:
        """Reap zygotes that were let go (on SIGCHLD, and before a new one)."""
        alive = []
        for popen in self._dead:
            if popen.poll() is None:
                alive.append(popen)
                continue
            if popen.stderr is not None:
                with contextlib.suppress(OSError):
                    popen.stderr.close()
            if self.guard is not None:
                self.guard.remove(popen.pid)
        self._dead = alive

    def drop(self, why: str = "no restart is possible") -> None:
        """Kill the zygotes (no start will need them: ``why``); a refusal one
        sent is recorded first (the module cache outlives the run)."""
        self._catch_up()
        z = self._z
        if z is not None and z.gone is None:
            self._discard(z, why)
        self._z = None
        self.ranks.drop(why)

    async def close(self) -> None:
        """Kill the zygote and reap it (bounded); a refusal one sent is
        recorded first (the module cache outlives the run)."""
        self._closed = True
        self._catch_up()
        for z in [self._z, *self.ranks.zygotes()]:
            if z is not None:
                z.kill(z.gone or "closed")
                self._dead.append(z.popen)
        self._z = None
        self.ranks.by_rank.clear()
        deadline = time.monotonic() + REAP_WAIT
        while self._dead and time.monotonic() < deadline:
            self.reap()
            if self._dead:
                await asyncio.sleep(0.01)


def _alive(z: Zygote) -> bool:
    return z.gone is None and z.popen.poll() is None
