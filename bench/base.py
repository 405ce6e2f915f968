"""What every scenario shares: the settings (steps and bounds), the context a
scenario fills, the catalogue record, and helpers over the workers' events.

All times are seconds of wall-clock time between events on one machine;
``launch`` is the moment the harness starts the launcher process.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.configs import LauncherConfig
from bench.harness import EventLog, Run, all_ranks_time


@dataclass
class Settings:
    """Knobs shared by all scenarios (``--quick`` shrinks them).

    Bounds. A phase after a disruption ends in one of three ways: the
    expected state is reached (measured), an agent dies (failed), or it is
    cut short. Cut short means either *stuck* (no worker wrote an event for
    the stall bound: nothing is happening) or *timed out* (the hard bound,
    for runs that keep writing events without getting there, e.g. a crash
    loop). Stall bounds sit well above the longest silence either launcher
    can legitimately have at its settings:

    - after a worker kill or a join to the maximum size nobody has to be
      declared dead and no last call applies: the silence is stopping the old
      workers, a rendezvous that closes at once and spawning the new ones
      (at most 3.2 s in the recorded full runs): ``restart_stall``;
    - after a node loss a launcher may wait for the dead node's liveness to
      expire and then for the last call: at defaults torchrun 3 x 5 s
      keep-alive + 30 s, elastrun 10 s lease + 30 s; tuned torchrun 3 x 1 s
      + 1 s, elastrun 2 s + 1 s; plus a margin: ``loss_stall_default`` /
      ``loss_stall_tuned``.

    The partition bound is a plain timeout: the target is <= 15 s and
    elastrun at defaults takes ~11 s (10 s lease); torchrun has no way to
    notice a silent peer before gloo's 30-minute timeout, so any bound well
    above the target shows it stuck.
    """

    quick: bool = False
    step_interval: float = 0.15
    target_steps: int = 10  # cold start: steps before the job ends
    warm_steps: int = 5  # steps of steady training before a join or a node loss
    # Steps before a worker is killed: training that has gone on for a while
    # (3 s), as a crash usually comes after the first steps, not during them.
    crash_steps: int = 20
    start_timeout: float = 120.0  # launch -> training (covers a 30 s last call)
    phase_timeout: float = 90.0  # disruption -> training resumed, hard bound
    restart_stall: float = 20.0  # stuck after a worker kill or a scale-up
    loss_stall_default: float = 60.0  # stuck after a node loss, default settings
    loss_stall_tuned: float = 30.0  # stuck after a node loss, tuned settings
    partition_timeout: float = 30.0  # link cut -> survivors at world 2
    exit_timeout: float = 60.0
    warm_timeout: float = 30.0  # memory: wait for warm interpreters to finish preloading

    def worker_env(self) -> dict[str, str]:
        """Environment for the workers of every run. Scenarios that stop the
        job with the stop file pass their own ``BENCH_TARGET_STEP=0``."""
        return {"BENCH_TARGET_STEP": str(self.target_steps)}

    def loss_stall(self, cfg: LauncherConfig) -> float:
        return self.loss_stall_tuned if cfg.tuned else self.loss_stall_default

    def bounds(self) -> str:
        """Every bound, for the report header."""
        return (
            f"start {self.start_timeout:.0f}s; disruption -> resumed {self.phase_timeout:.0f}s, "
            f"stuck when no worker event for {self.restart_stall:.0f}s after a worker kill "
            f"or a join, {self.loss_stall_default:.0f}s (default) / "
            f"{self.loss_stall_tuned:.0f}s (tuned) after a node loss; "
            f"partition -> resumed {self.partition_timeout:.0f}s; exit {self.exit_timeout:.0f}s; "
            f"warm interpreters preloaded {self.warm_timeout:.0f}s; "
            f"{self.warm_steps} steps before a join or a node loss, {self.crash_steps} before "
            f"a worker kill, a step every {self.step_interval}s"
        )

    @classmethod
    def quick_settings(cls) -> Settings:
        return cls(
            quick=True,
            target_steps=5,
            warm_steps=3,
            crash_steps=5,
            start_timeout=40.0,
            phase_timeout=30.0,
            exit_timeout=20.0,
        )


@dataclass
class Context:
    run: Run
    cfg: LauncherConfig
    settings: Settings
    out: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Scenario:
    name: str  # unique, e.g. "cold_start_np2"
    group: str  # what --scenarios selects, e.g. "cold_start"
    title: str
    metrics: tuple[tuple[str, str, str], ...]  # (key, unit, meaning)
    fn: Callable[[Context], None]
    worker_env: tuple[tuple[str, str], ...] = ()
    # Expected seconds per run by config name (from the recorded full runs
    # with today's bounds), for the wall-time estimate.
    est_s: tuple[tuple[str, float], ...] = ()

    def estimate(self, config: str) -> float:
        table = dict(self.est_s)
        if config in table:
            return table[config]
        return max(table.values(), default=10.0)


UNTIL_STOPPED = (("BENCH_TARGET_STEP", "0"),)


def launcher_env(cfg: LauncherConfig) -> dict[str, str]:
    return dict(cfg.env)


def steps_after(log: EventLog, after: float, world: int, **match: Any) -> float | None:
    """When every rank of ``world`` had stepped at that world size after ``after``."""
    return all_ranks_time(
        [e for e in log.select("step", after=after, **match) if int(e["world"]) == world], world
    )


def count_steps(log: EventLog, world: int, after: float = 0.0) -> int:
    return len([e for e in log.select("step", after=after) if e["world"] == world])


def pause(
    log: EventLog,
    t_disrupt: float,
    survivors: Callable[[Any], bool],
    resumed: Callable[[Any], bool],
) -> float | None:
    """The training pause of the ranks that were not hit: for each survivor
    slot (node, local rank) whose steps ``survivors`` selects, the longest gap
    between two of its consecutive steps from its last step at or before
    ``t_disrupt`` to its first step that ``resumed`` accepts; the worst slot's.
    None while a slot has not resumed."""
    steps = [e for e in log.select("step") if survivors(e)]
    slots = {(e.get("node", ""), int(e["local_rank"])) for e in steps}
    if not slots:
        return None
    worst = 0.0
    for slot in slots:
        mine = sorted(
            (e for e in steps if (e.get("node", ""), int(e["local_rank"])) == slot),
            key=lambda e: e["t"],
        )
        before = [e["t"] for e in mine if e["t"] <= t_disrupt]
        after = [e for e in mine if e["t"] > t_disrupt and resumed(e)]
        if not before or not after:
            return None
        end = after[0]["t"]
        times = [max(before), *(e["t"] for e in mine if t_disrupt < e["t"] <= end)]
        worst = max(worst, *(b - a for a, b in itertools.pairwise(times)))
    return worst


def max_step(log: EventLog, before: float) -> int:
    return max(
        (int(e["step"]) for e in log.events if e.get("ev") == "step" and e["t"] <= before),
        default=0,
    )
