"""The benchmark scenarios and their catalogue. Each scenario runs a launcher
configuration once and fills a dict of metric -> value; a
:class:`~bench.paths.BenchFailure` (or any error) marks the metrics it did not
reach as failed. The single-node scenarios live here, the multi-agent ones in
:mod:`bench.multinode`.

All times are seconds of wall-clock time between events on one machine;
``launch`` is the moment the harness starts the launcher process.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from bench import multinode
from bench.base import (
    UNTIL_STOPPED,
    Context,
    Scenario,
    Settings,
    launcher_env,
    max_step,
    pause,
)
from bench.configs import LauncherConfig
from bench.harness import all_ranks_time
from bench.netns import netns_status
from bench.paths import BenchFailure

__all__ = [
    "EXTRA_GROUPS",
    "GROUPS",
    "QUICK_GROUPS",
    "Context",
    "Scenario",
    "Settings",
    "catalogue",
    "estimate",
    "partition_status",
    "scenario_dir",
    "select",
]


# --------------------------------------------------------------------------- 1. cold start


def cold_start(nproc: int) -> Callable[[Context], None]:
    """The job launched twice in a row: the first launch is the first run of
    the script on this machine (elastrun's module cache empty), the second
    the same script again (the cache holds what the first run imported)."""

    def launch(ctx: Context, folder: Path) -> tuple[float, float, float, float]:
        run, cfg, s = ctx.run, ctx.cfg, ctx.settings
        folder.mkdir(parents=True, exist_ok=True)
        argv = cfg.argv(["--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0"])
        agent = run.start_agent(
            f"agent-{folder.name}", argv, {**launcher_env(cfg), "BENCH_DIR": str(folder)}
        )
        t0 = agent.t_launch
        t_started = run.wait(
            f"{nproc} workers started",
            lambda log: all_ranks_time(log.select("start", after=t0), nproc),
            s.start_timeout,
            alive=[agent],
        )
        t_first = run.wait(
            "first step on all ranks",
            lambda log: all_ranks_time(log.select("step", after=t0), nproc),
            s.start_timeout,
            alive=[agent],
        )
        run.wait(
            "last step",
            lambda log: all_ranks_time(log.select("step", after=t0, step=s.target_steps), nproc),
            s.start_timeout,
            alive=[agent],
        )
        t_last = max(e["t"] for e in run.log.select("step", after=t0, step=s.target_steps))
        t_exit = run.wait_exit([agent], s.exit_timeout)
        return t_started - t0, t_first - t0, t_exit - t_last, t_exit - t0

    def fn(ctx: Context) -> None:
        started, first, exit_s, total = launch(ctx, ctx.run.dir / "first")
        ctx.out.update(workers_started=started, first_step=first, exit=exit_s, total=total)
        started, first, _, _ = launch(ctx, ctx.run.dir / "again")
        ctx.out.update(workers_started_again=started, first_step_again=first)

    return fn


# --------------------------------------------------------------------------- 2. worker crash


def worker_crash(nproc: int) -> Callable[[Context], None]:
    def fn(ctx: Context) -> None:
        run, cfg, s = ctx.run, ctx.cfg, ctx.settings
        argv = cfg.argv(["--standalone", f"--nproc-per-node={nproc}", "--max-restarts=3"])
        agent = run.start_agent("agent", argv, launcher_env(cfg))
        run.wait(
            f"{s.crash_steps} steps on all ranks",
            lambda log: all_ranks_time(log.select("step", step=s.crash_steps), nproc),
            s.start_timeout,
            alive=[agent],
        )
        victims = run.log.select("start", rank=1, restart=0) or run.log.select("start", rank=1)
        pid = int(victims[-1]["pid"])
        t_kill = time.monotonic()
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError as exc:
            raise BenchFailure(f"worker rank 1 (pid {pid}) already gone") from exc
        run.log.poll()
        before = max_step(run.log, t_kill)
        t_respawn = run.wait(
            "restarted workers started",
            lambda log: all_ranks_time(
                [e for e in log.select("start", after=t_kill) if int(e["restart"]) >= 1], nproc
            ),
            s.phase_timeout,
            alive=[agent],
            stall=s.restart_stall,
        )
        ctx.out["respawn"] = t_respawn - t_kill
        t_resumed = run.wait(
            "first step after the restart on all ranks",
            lambda log: all_ranks_time(
                [e for e in log.select("step", after=t_kill) if int(e["restart"]) >= 1], nproc
            ),
            s.phase_timeout,
            alive=[agent],
            stall=s.restart_stall,
        )
        ctx.out["resumed"] = t_resumed - t_kill
        # The ranks that were not killed: their gap in steps.
        gap = pause(
            run.log,
            t_kill,
            lambda e: int(e["local_rank"]) != 1,
            lambda e: int(e["restart"]) >= 1,
        )
        if gap is not None:
            ctx.out["pause"] = gap
        resumes = [e for e in run.log.select("resume", after=t_kill) if int(e["restart"]) >= 1]
        if resumes:
            ctx.out["steps_lost"] = float(max(0, before - int(resumes[0]["step"])))
        run.stop()
        try:
            run.wait_exit([agent], s.exit_timeout)
        except BenchFailure as exc:
            ctx.notes.append(f"after the measurement: {exc}")

    return fn


# --------------------------------------------------------------------------- 7. memory


MEMORY_STEPS = 10


def memory(nproc: int) -> Callable[[Context], None]:
    """Peak RSS of the launcher and its helpers while it trains an elastic
    job (restarts allowed, so a launcher that keeps warm interpreters has them);
    warm interpreters are reported apart, once they have finished preloading."""

    def fn(ctx: Context) -> None:
        run, cfg, s = ctx.run, ctx.cfg, ctx.settings
        argv = cfg.argv(["--standalone", f"--nproc-per-node={nproc}", "--max-restarts=3"])
        agent = run.start_agent("agent", argv, launcher_env(cfg))
        run.track_memory(agent)
        run.wait(
            f"{MEMORY_STEPS} steps on all ranks",
            lambda log: all_ranks_time(log.select("step", step=MEMORY_STEPS), nproc),
            s.start_timeout,
            alive=[agent],
        )
        try:
            run.wait(
                "warm interpreters preloaded",
                lambda _log: run.warm_settled(),
                s.warm_timeout,
                alive=[agent],
            )
        except BenchFailure as exc:
            if agent.t_exit is not None:
                raise
            ctx.notes.append(f"warm_rss is what the warm interpreters had reached: {exc}")
        own = run.mem_pids.get(agent.pid)
        if not own:
            raise BenchFailure("could not read the launcher's VmHWM")
        ctx.out["agent_rss"] = own / 1024
        ctx.out["agent_tree_rss"] = sum(run.mem_pids.values()) / 1024
        ctx.out["warm_rss"] = sum(run.warm_pids.values()) / 1024
        ctx.info["agent_helper_pids"] = len(run.mem_pids) - 1
        ctx.info["warm_pids"] = len(run.warm_pids)
        run.stop()
        run.wait_exit([agent], s.exit_timeout)

    return fn


# --------------------------------------------------------------------------- catalogue

_COLD = (
    (
        "workers_started",
        "s",
        "first run of the script: launch -> every worker script running",
    ),
    ("first_step", "s", "first run of the script: launch -> first step done on all ranks"),
    ("exit", "s", "last step -> launcher exited 0"),
    ("total", "s", "launch -> launcher exited 0"),
    (
        "workers_started_again",
        "s",
        "the same script again (elastrun's module cache warm): launch -> workers running",
    ),
    ("first_step_again", "s", "the same script again: launch -> first step on all ranks"),
)
_CRASH = (
    ("respawn", "s", "SIGKILL of one worker -> every replacement worker script running"),
    ("resumed", "s", "SIGKILL of one worker -> first step after the restart on all ranks"),
    (
        "pause",
        "s",
        "training pause of the rank not killed: its last step before -> first step after",
    ),
    ("steps_lost", "steps", "last step before the kill - step resumed from"),
)
_JOIN = (
    ("world2_first_step", "s", "launch of 2 agents -> first step at world 2"),
    ("scale_up", "s", "3rd agent launched -> first step at world 3 on all ranks"),
    (
        "pause_scale_up",
        "s",
        "training pause of the 2 running nodes: longest gap in their steps up to world 3",
    ),
)
_LOSS = (
    ("node_loss", "s", "3rd node SIGKILLed (all its processes) -> survivors step at world 2"),
    (
        "pause_node_loss",
        "s",
        "training pause of the survivors: last step before the kill -> first at world 2",
    ),
)
_SPARE = (
    (
        "spare_loss",
        "s",
        "3 agents for a world of 2 (elastrun: --node-unit=2, one spare; torchrun: world 3); "
        "a training node SIGKILLed -> every rank steps at world 2",
    ),
    (
        "pause_spare_loss",
        "s",
        "training pause of the surviving node: last step before the kill -> first at world 2",
    ),
)
_SPARE_AGENT = (
    (
        "spare_agent_kill",
        "s",
        "as spare_loss, but only the training node's agent process SIGKILLed (its workers "
        "and children are left to the launcher) -> every rank steps at world 2",
    ),
    (
        "pause_spare_agent_kill",
        "s",
        "training pause of the surviving node: last step before the kill -> first at world 2",
    ),
)
_SPARE_PART = (
    (
        "spare_partition",
        "s",
        "as spare_loss, one network namespace per agent; a training node's link cut "
        "(packets dropped) -> every rank steps at world 2",
    ),
)
_HOST_LOSS = (
    ("world3_first_step", "s", "launch of 3 agents -> first step at world 3"),
    (
        "store_host_loss",
        "s",
        "the store's host SIGKILLed (all its processes) -> survivors step at world 2",
    ),
    (
        "pause_store_host_loss",
        "s",
        "training pause of the survivors: last step before the kill -> first at world 2",
    ),
)
_PART = (
    ("world3_first_step", "s", "launch of 3 agents (one network namespace each) -> world 3"),
    ("partition", "s", "3rd node's link cut (packets dropped) -> survivors step at world 2"),
)
_RDZV = (
    ("all_started", "s", "first agent launched -> every agent's worker running"),
    ("all_exited", "s", "first agent launched -> every agent exited 0"),
)
_MEM = (
    ("agent_rss", "MiB", "peak RSS (VmHWM) of the launcher process"),
    ("agent_tree_rss", "MiB", "launcher + its non-worker helper processes, peak RSS summed"),
    (
        "warm_rss",
        "MiB",
        "warm interpreters (idle, with torch imported), peak RSS summed; 0: none",
    ),
)


def _est(tdef: float, edef: float, ttun: float, etun: float) -> tuple[tuple[str, float], ...]:
    return (
        ("torchrun-default", tdef),
        ("elastrun-default", edef),
        ("torchrun-tuned", ttun),
        ("elastrun-tuned", etun),
    )


# Seconds per run, from the per-run wall times of the last full run
# (bench/results/full2) with today's steps and bounds: a run that got stuck
# there is counted as its last event + the stall bound (torchrun-default's
# worker crash: 8 s + 20 s; its scale-up: 34 s last call + 1 s + 20 s) or as
# the partition bound (5 s to world 3 + 30 s).
_EST_MEMBERSHIP = {
    True: _est(55.0, 46.4, 20.4, 11.0),  # with node loss
    False: _est(55.0, 36.0, 13.5, 7.5),  # scale-up only
}


def catalogue(quick: bool) -> list[Scenario]:
    nprocs = (2,) if quick else (2, 4)
    cold_est = {2: _est(5.5, 3.9, 5.6, 4.2), 4: _est(7.9, 6.4, 7.6, 6.7)}
    out: list[Scenario] = []
    for n in nprocs:
        out.append(
            Scenario(
                f"cold_start_np{n}",
                "cold_start",
                f"Cold start, --standalone --nproc-per-node={n}",
                _COLD,
                cold_start(n),
                est_s=cold_est[n],
            )
        )
    out.append(
        Scenario(
            "worker_crash_np2",
            "worker_crash",
            "Worker SIGKILL mid-training, --standalone --nproc-per-node=2 --max-restarts=3",
            _CRASH,
            worker_crash(2),
            worker_env=UNTIL_STOPPED,
            est_s=_est(29.0, 5.0, 6.0, 4.6),
        )
    )
    # The trivial worker (no model, optimizer or data loader): a labelled floor.
    out.append(
        Scenario(
            "worker_crash_floor_np2",
            "worker_crash_floor",
            "Worker SIGKILL, FLOOR worker (an all-reduce per step, nothing else), 2 workers",
            _CRASH,
            worker_crash(2),
            worker_env=(*UNTIL_STOPPED, ("BENCH_WORKLOAD", "floor")),
            est_s=_est(29.0, 5.0, 6.0, 4.6),
        )
    )
    # 2:3 is the default; 1:3 repeats every phase of it (2 agents are above
    # both minimums, 3 is the maximum of both) and is selected on its own.
    for nnodes, suffix in (("2:3", ""), ("1:3", "_1to3")):
        tag = nnodes.replace(":", "to")
        out.append(
            Scenario(
                f"scale_up_{tag}",
                "scale_up" + suffix,
                f"Scale-up, c10d --nnodes={nnodes}, 1 worker per agent, a 3rd agent joins",
                _JOIN,
                multinode.membership(nnodes, node_loss=False),
                worker_env=UNTIL_STOPPED,
                est_s=_EST_MEMBERSHIP[False],
            )
        )
        out.append(
            Scenario(
                f"node_loss_{tag}",
                "node_loss" + suffix,
                f"Node loss, c10d --nnodes={nnodes}: scale to 3, then SIGKILL the 3rd node",
                _JOIN + _LOSS,
                multinode.membership(nnodes, node_loss=True),
                worker_env=UNTIL_STOPPED,
                est_s=_EST_MEMBERSHIP[True],
            )
        )
    out.append(
        Scenario(
            "store_host_loss_2to3",
            "store_host_loss",
            "The store's host lost, c10d --nnodes=2:3 on 127.0.0.1/.2/.3: SIGKILL of the "
            "host's agent (elastrun: 3 candidate hosts; torchrun: its one endpoint)",
            _HOST_LOSS,
            multinode.store_host_loss,
            worker_env=UNTIL_STOPPED,
            est_s=_est(25.0, 20.0, 20.0, 15.0),
        )
    )
    out.append(
        Scenario(
            "partition_2to3",
            "partition",
            "Partition, c10d --nnodes=2:3 in network namespaces: cut the 3rd node's link",
            _PART,
            multinode.partition,
            worker_env=UNTIL_STOPPED,
            est_s=_est(37.0, 20.2, 37.5, 12.4),
        )
    )
    out.append(
        Scenario(
            "spare_loss_2to3",
            "spares",
            "Hot spare, c10d --nnodes=2:3 (elastrun --node-unit=2): SIGKILL a training node",
            _SPARE,
            multinode.spare_loss,
            worker_env=UNTIL_STOPPED,
            est_s=_EST_MEMBERSHIP[True],
        )
    )
    out.append(
        Scenario(
            "spare_agent_kill_2to3",
            "spares",
            "Hot spare, c10d --nnodes=2:3 (elastrun --node-unit=2): SIGKILL a training "
            "node's agent only",
            _SPARE_AGENT,
            multinode.spare_agent_kill,
            worker_env=UNTIL_STOPPED,
            est_s=_EST_MEMBERSHIP[True],
        )
    )
    out.append(
        Scenario(
            "spare_partition_2to3",
            "spares_partition",
            "Hot spare in network namespaces, c10d --nnodes=2:3 (elastrun --node-unit=2): "
            "cut a training node's link",
            _SPARE_PART,
            multinode.spare_partition,
            worker_env=UNTIL_STOPPED,
            est_s=_est(37.0, 20.2, 37.5, 12.4),
        )
    )
    rdzv_est = {
        4: _est(5.1, 0.7, 5.7, 0.8),
        8: _est(9.4, 1.5, 9.7, 1.5),
        16: _est(20.1, 2.8, 27.9, 2.9),
    }
    for n in (4, 8, 16):
        out.append(
            Scenario(
                f"rdzv_scale_{n}",
                "rdzv_scale",
                f"Rendezvous of {n} real agents (c10d --nnodes={n}, trivial worker)",
                _RDZV,
                multinode.rdzv_scale(n),
                worker_env=(("BENCH_MODE", "trivial"),),
                est_s=rdzv_est[n],
            )
        )
    out.append(
        Scenario(
            "memory_np2",
            "memory",
            "Agent memory, --standalone --nproc-per-node=2 --max-restarts=3",
            _MEM,
            memory(2),
            worker_env=UNTIL_STOPPED,
            est_s=_est(5.5, 6.0, 5.6, 5.7),  # elastrun: + its warm interpreters preloading
        )
    )
    return out


# The full run: every phase once.
GROUPS = (
    "cold_start",
    "worker_crash",
    "scale_up",
    "node_loss",
    "store_host_loss",
    "partition",
    "rdzv_scale",
    "memory",
)
# Selected only by name (--scenarios): the same phases at --nnodes=1:3, and the
# worker crash with the trivial floor worker, and the hot spare (docs/spares.md).
EXTRA_GROUPS = (
    "scale_up_1to3",
    "node_loss_1to3",
    "worker_crash_floor",
    "spares",
    "spares_partition",
)
QUICK_GROUPS = ("cold_start", "worker_crash")


def select(groups: Sequence[str], quick: bool) -> list[Scenario]:
    scenarios = [sc for sc in catalogue(quick) if sc.group in groups]
    netns_groups = {"partition", "spares_partition"}
    if netns_groups & set(groups) and partition_status() is not None:
        scenarios = [sc for sc in scenarios if sc.group not in netns_groups]
    # node_loss runs include the scale-up phase; no need to run it twice.
    for loss, join in (("node_loss", "scale_up"), ("node_loss_1to3", "scale_up_1to3")):
        if loss in groups:
            scenarios = [sc for sc in scenarios if sc.group != join]
    return scenarios


# --------------------------------------------------------------------------- wall time

FLOOR_EST_S = 3.0  # the physical floor, per repetition
SIMULATED_EST_S = 26.0  # bench.rdzv_bench 64/256/1024, per repetition
STARTUP_EST_S = 3.0  # the launchers' --help checks


def estimate(
    scenarios: Sequence[Scenario], configs: Sequence[LauncherConfig], reps: int
) -> dict[str, float]:
    """Expected wall seconds per scenario group for ``reps`` repetitions."""
    out: dict[str, float] = {}
    for sc in scenarios:
        per_rep = sum(sc.estimate(cfg.name) for cfg in configs)
        out[sc.group] = out.get(sc.group, 0.0) + per_rep * reps
    return out


# --------------------------------------------------------------------------- misc


def partition_status() -> str | None:
    """None when the partition scenario can run here, else why it is skipped."""
    return netns_status()


def scenario_dir(root: Path, sc: Scenario, cfg: LauncherConfig, rep: int) -> Path:
    return root / "runs" / f"{sc.name}-{cfg.name}-rep{rep}"
