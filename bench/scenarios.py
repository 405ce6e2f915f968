"""The benchmark scenarios. Each one runs a launcher configuration once and
fills a dict of metric -> value; a :class:`~bench.harness.BenchFailure` (or
any error) marks the metrics it did not reach as failed.

All times are seconds of wall-clock time between events on one machine;
``launch`` is the moment the harness starts the launcher process.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness import (
    BENCH_DIR,
    REPO,
    BenchFailure,
    EventLog,
    LauncherConfig,
    NetnsLab,
    Run,
    all_ranks_time,
    free_port,
    netns_status,
)


@dataclass
class Settings:
    """Knobs shared by all scenarios (``--quick`` shrinks them)."""

    quick: bool = False
    step_interval: float = 0.15
    target_steps: int = 10  # cold start / memory: steps before the job ends
    warm_steps: int = 8  # steps of steady training before a disruption
    start_timeout: float = 120.0  # launch -> training
    phase_timeout: float = 90.0  # disruption -> training resumed
    exit_timeout: float = 60.0
    partition_timeout: float = 60.0  # torchrun is expected to stay stuck: bound it

    def worker_env(self) -> dict[str, str]:
        """Environment for the workers of every run. Scenarios that stop the
        job with the stop file pass their own ``BENCH_TARGET_STEP=0``."""
        return {"BENCH_TARGET_STEP": str(self.target_steps)}

    @classmethod
    def quick_settings(cls) -> Settings:
        return cls(
            quick=True,
            target_steps=5,
            warm_steps=3,
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


def _env(cfg: LauncherConfig) -> dict[str, str]:
    return dict(cfg.env)


def _steps_after(log: EventLog, after: float, world: int, **match: Any) -> float | None:
    return all_ranks_time(
        [e for e in log.select("step", after=after, **match) if int(e["world"]) == world], world
    )


def _max_step(log: EventLog, before: float) -> int:
    return max(
        (int(e["step"]) for e in log.events if e.get("ev") == "step" and e["t"] <= before),
        default=0,
    )


# --------------------------------------------------------------------------- 1. cold start


def cold_start(nproc: int) -> Callable[[Context], None]:
    def fn(ctx: Context) -> None:
        run, cfg, s = ctx.run, ctx.cfg, ctx.settings
        argv = cfg.argv(["--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0"])
        agent = run.start_agent("agent", argv, _env(cfg))
        t0 = agent.t_launch
        t_started = run.wait(
            f"{nproc} workers started",
            lambda log: all_ranks_time(log.select("start"), nproc),
            s.start_timeout,
            alive=[agent],
        )
        ctx.out["workers_started"] = t_started - t0
        t_first = run.wait(
            "first step on all ranks",
            lambda log: all_ranks_time(log.select("step"), nproc),
            s.start_timeout,
            alive=[agent],
        )
        ctx.out["first_step"] = t_first - t0
        run.wait(
            "last step",
            lambda log: all_ranks_time(log.select("step", step=s.target_steps), nproc),
            s.start_timeout,
            alive=[agent],
        )
        t_last = max(e["t"] for e in run.log.select("step", step=s.target_steps))
        t_exit = run.wait_exit([agent], s.exit_timeout)
        ctx.out["exit"] = t_exit - t_last
        ctx.out["total"] = t_exit - t0

    return fn


# --------------------------------------------------------------------------- 2. worker crash


def worker_crash(nproc: int) -> Callable[[Context], None]:
    def fn(ctx: Context) -> None:
        run, cfg, s = ctx.run, ctx.cfg, ctx.settings
        argv = cfg.argv(["--standalone", f"--nproc-per-node={nproc}", "--max-restarts=3"])
        agent = run.start_agent("agent", argv, _env(cfg))
        run.wait(
            f"{s.warm_steps} steps on all ranks",
            lambda log: all_ranks_time(log.select("step", step=s.warm_steps), nproc),
            s.start_timeout,
            alive=[agent],
        )
        victims = run.log.select("start", rank=1, restart=0) or run.log.select("start", rank=1)
        pid = int(victims[-1]["pid"])
        t_kill = time.time()
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError as exc:
            raise BenchFailure(f"worker rank 1 (pid {pid}) already gone") from exc
        run.log.poll()
        before = _max_step(run.log, t_kill)
        t_respawn = run.wait(
            "restarted workers started",
            lambda log: all_ranks_time(
                [e for e in log.select("start", after=t_kill) if int(e["restart"]) >= 1], nproc
            ),
            s.phase_timeout,
            alive=[agent],
        )
        ctx.out["respawn"] = t_respawn - t_kill
        t_resumed = run.wait(
            "first step after the restart on all ranks",
            lambda log: all_ranks_time(
                [e for e in log.select("step", after=t_kill) if int(e["restart"]) >= 1], nproc
            ),
            s.phase_timeout,
            alive=[agent],
        )
        ctx.out["resumed"] = t_resumed - t_kill
        resumes = [e for e in run.log.select("resume", after=t_kill) if int(e["restart"]) >= 1]
        if resumes:
            ctx.out["steps_lost"] = float(max(0, before - int(resumes[0]["step"])))
        run.stop()
        try:
            run.wait_exit([agent], s.exit_timeout)
        except BenchFailure as exc:
            ctx.notes.append(f"after the measurement: {exc}")

    return fn


# --------------------------------------------------------------------------- 3+4. membership


def _agent_argv(
    cfg: LauncherConfig, nnodes: str, port: int, is_host: bool, run_id: str
) -> list[str]:
    return cfg.argv(
        [
            f"--nnodes={nnodes}",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id={run_id}",
            "--max-restarts=3",
        ],
        {"is_host": "1" if is_host else "0"},
    )


def membership(nnodes: str, node_loss: bool) -> Callable[[Context], None]:
    """Two agents train; a third joins (scale-up); optionally it is then
    killed with all its processes (node loss)."""

    def fn(ctx: Context) -> None:
        run, cfg, s = ctx.run, ctx.cfg, ctx.settings
        port = free_port()
        run_id = f"bench{port}"
        ctx.info["rdzv_endpoint"] = f"127.0.0.1:{port}"
        a = run.start_agent("agent-a", _agent_argv(cfg, nnodes, port, True, run_id), _env(cfg))
        b = run.start_agent("agent-b", _agent_argv(cfg, nnodes, port, False, run_id), _env(cfg))
        t_a = a.t_launch
        t2 = run.wait(
            "training at world 2",
            lambda log: _steps_after(log, 0.0, 2),
            s.start_timeout,
            alive=[a, b],
        )
        ctx.out["world2_first_step"] = t2 - t_a
        run.wait(
            f"{s.warm_steps} steps at world 2",
            lambda log: len([e for e in log.select("step") if e["world"] == 2]) >= 2 * s.warm_steps,
            s.start_timeout,
            alive=[a, b],
        )
        c = run.start_agent("agent-c", _agent_argv(cfg, nnodes, port, False, run_id), _env(cfg))
        t_join = c.t_launch
        t3 = run.wait(
            "training at world 3",
            lambda log: _steps_after(log, t_join, 3),
            s.phase_timeout,
            alive=[a, b, c],
        )
        ctx.out["scale_up"] = t3 - t_join
        if node_loss:
            run.wait(
                f"{s.warm_steps} steps at world 3",
                lambda log: (
                    len([e for e in log.select("step", after=t3) if e["world"] == 3])
                    >= 3 * s.warm_steps
                ),
                s.phase_timeout,
                alive=[a, b, c],
            )
            t_kill = run.kill_node(c)
            t_back = run.wait(
                "survivors training at world 2",
                lambda log: _steps_after(log, t_kill, 2),
                s.phase_timeout,
                alive=[a, b],
            )
            ctx.out["node_loss"] = t_back - t_kill
        run.stop()
        try:
            run.wait_exit([a, b] if node_loss else [a, b, c], s.exit_timeout)
        except BenchFailure as exc:
            ctx.notes.append(f"after the measurement: {exc}")

    return fn


# --------------------------------------------------------------------------- 5. partition


def partition(ctx: Context) -> None:
    """Three agents, each in a network namespace of its own, train at world 3;
    the 3rd node's link is cut (packets dropped, no resets). The survivors
    must notice on their own and go on at world 2."""
    with NetnsLab(3) as lab:
        try:
            _partition(ctx, lab)
        finally:
            ctx.run.cleanup()  # before the namespaces go


def _partition(ctx: Context, lab: NetnsLab) -> None:
    run, cfg, s = ctx.run, ctx.cfg, ctx.settings
    port = free_port()
    endpoint = f"{lab.addr(0)}:{port}"
    ctx.info["rdzv_endpoint"] = endpoint
    agents = []
    for i in range(3):
        argv = cfg.argv(
            [
                "--nnodes=2:3",
                "--nproc-per-node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={endpoint}",
                f"--rdzv-id=bench{port}",
                f"--local-addr={lab.addr(i)}",
                "--max-restarts=3",
            ],
            {"is_host": "1" if i == 0 else "0"},
        )
        env = {**_env(cfg), "GLOO_SOCKET_IFNAME": "eth0"}
        agents.append(run.start_agent(f"agent-{i}", [*lab.exec_prefix(i), *argv], env))
    a, b = agents[:2]
    t3 = run.wait(
        "training at world 3",
        lambda log: _steps_after(log, 0.0, 3),
        s.start_timeout,
        alive=agents,
    )
    ctx.out["world3_first_step"] = t3 - a.t_launch
    run.wait(
        f"{s.warm_steps} steps at world 3",
        lambda log: len([e for e in log.select("step") if e["world"] == 3]) >= 3 * s.warm_steps,
        s.phase_timeout,
        alive=agents,
    )
    t_cut = lab.partition(2)
    t_back = run.wait(
        "survivors training at world 2 after the partition",
        lambda log: _steps_after(log, t_cut, 2),
        s.partition_timeout,
        alive=[a, b],
    )
    ctx.out["partition"] = t_back - t_cut
    run.stop()
    try:
        run.wait_exit([a, b], s.exit_timeout)
    except BenchFailure as exc:
        ctx.notes.append(f"after the measurement: {exc}")


# --------------------------------------------------------------------------- 6. rendezvous scale


def rdzv_scale(n: int) -> Callable[[Context], None]:
    def fn(ctx: Context) -> None:
        run, cfg, s = ctx.run, ctx.cfg, ctx.settings
        port = free_port()
        agents = [
            run.start_agent(
                f"agent-{i}",
                _agent_argv(cfg, str(n), port, i == 0, f"bench{port}"),
                _env(cfg),
            )
            for i in range(n)
        ]
        t0 = agents[0].t_launch
        t_all = run.wait(
            f"{n} workers started",
            lambda log: all_ranks_time(log.select("start"), n),
            s.start_timeout + 4 * n,
            alive=agents,
        )
        ctx.out["all_started"] = t_all - t0
        t_exit = run.wait_exit(agents, s.exit_timeout + 2 * n)
        ctx.out["all_exited"] = t_exit - t0

    return fn


# --------------------------------------------------------------------------- 7. memory


def memory(nproc: int) -> Callable[[Context], None]:
    def fn(ctx: Context) -> None:
        run, cfg, s = ctx.run, ctx.cfg, ctx.settings
        argv = cfg.argv(["--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0"])
        agent = run.start_agent("agent", argv, _env(cfg))
        run.track_memory(agent)
        steps = MEMORY_STEPS
        run.wait(
            f"{steps} steps on all ranks",
            lambda log: all_ranks_time(log.select("step", step=steps), nproc),
            s.start_timeout,
            alive=[agent],
        )
        own = run.mem_pids.get(agent.pid)
        if not own:
            raise BenchFailure("could not read the launcher's VmHWM")
        ctx.out["agent_rss"] = own / 1024
        ctx.out["agent_tree_rss"] = sum(run.mem_pids.values()) / 1024
        ctx.info["agent_helper_pids"] = len(run.mem_pids) - 1
        run.wait_exit([agent], s.exit_timeout)

    return fn


# --------------------------------------------------------------------------- catalogue

_COLD = (
    ("workers_started", "s", "launch -> every worker process running (before torch import)"),
    ("first_step", "s", "launch -> first step done on all ranks"),
    ("exit", "s", "last step -> launcher exited 0"),
    ("total", "s", "launch -> launcher exited 0"),
)
_CRASH = (
    ("respawn", "s", "SIGKILL of one worker -> all replacement workers running"),
    ("resumed", "s", "SIGKILL of one worker -> first step after the restart on all ranks"),
    ("steps_lost", "steps", "last step before the kill - step resumed from"),
)
_JOIN = (
    ("world2_first_step", "s", "launch of 2 agents -> first step at world 2"),
    ("scale_up", "s", "3rd agent launched -> first step at world 3 on all ranks"),
)
_LOSS = (("node_loss", "s", "3rd node SIGKILLed (all its processes) -> survivors step at world 2"),)
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
)


_UNTIL_STOPPED = (("BENCH_TARGET_STEP", "0"),)
MEMORY_STEPS = 20


def catalogue(quick: bool) -> list[Scenario]:
    nprocs = (2,) if quick else (2, 4)
    out: list[Scenario] = []
    for n in nprocs:
        out.append(
            Scenario(
                f"cold_start_np{n}",
                "cold_start",
                f"Cold start, --standalone --nproc-per-node={n}",
                _COLD,
                cold_start(n),
            )
        )
    out.append(
        Scenario(
            "worker_crash_np2",
            "worker_crash",
            "Worker SIGKILL mid-training, --standalone --nproc-per-node=2 --max-restarts=3",
            _CRASH,
            worker_crash(2),
            worker_env=_UNTIL_STOPPED,
        )
    )
    for nnodes in ("2:3", "1:3"):
        tag = nnodes.replace(":", "to")
        out.append(
            Scenario(
                f"scale_up_{tag}",
                "scale_up",
                f"Scale-up, c10d --nnodes={nnodes}, 1 worker per agent, a 3rd agent joins",
                _JOIN,
                membership(nnodes, node_loss=False),
                worker_env=_UNTIL_STOPPED,
            )
        )
        out.append(
            Scenario(
                f"node_loss_{tag}",
                "node_loss",
                f"Node loss, c10d --nnodes={nnodes}: scale to 3, then SIGKILL the 3rd node",
                _JOIN + _LOSS,
                membership(nnodes, node_loss=True),
                worker_env=_UNTIL_STOPPED,
            )
        )
    out.append(
        Scenario(
            "partition_2to3",
            "partition",
            "Partition, c10d --nnodes=2:3 in network namespaces: cut the 3rd node's link",
            _PART,
            partition,
            worker_env=_UNTIL_STOPPED,
        )
    )
    for n in (4, 8, 16):
        out.append(
            Scenario(
                f"rdzv_scale_{n}",
                "rdzv_scale",
                f"Rendezvous of {n} real agents (c10d --nnodes={n}, trivial worker)",
                _RDZV,
                rdzv_scale(n),
                worker_env=(("BENCH_MODE", "trivial"),),
            )
        )
    out.append(
        Scenario(
            "memory_np2",
            "memory",
            "Agent memory, --standalone --nproc-per-node=2",
            _MEM,
            memory(2),
            worker_env=(("BENCH_TARGET_STEP", str(MEMORY_STEPS)),),
        )
    )
    return out


GROUPS = (
    "cold_start",
    "worker_crash",
    "scale_up",
    "node_loss",
    "partition",
    "rdzv_scale",
    "memory",
)
QUICK_GROUPS = ("cold_start", "worker_crash")


def select(groups: list[str], quick: bool) -> list[Scenario]:
    scenarios = [sc for sc in catalogue(quick) if sc.group in groups]
    if "partition" in groups and partition_status() is not None:
        scenarios = [sc for sc in scenarios if sc.group != "partition"]
    # node_loss runs include the scale-up phase; no need to run it twice.
    if "node_loss" in groups:
        scenarios = [sc for sc in scenarios if sc.group != "scale_up"]
    return scenarios


# --------------------------------------------------------------------------- 5. partition


def partition_status() -> str | None:
    """None when the partition scenario can run here, else why it is skipped."""
    return netns_status()


# --------------------------------------------------------------------------- simulated rdzv


SIMULATED_SIZES = (64, 256, 1024)
_SIM_ROW = re.compile(r"^\s*(\d+)\s+([\d.]+)\s+([\d.]+)\s*$")


def parse_simulated(stdout: str) -> list[dict[str, float]]:
    """Rows of ``bench/rdzv_bench.py``'s table: agents, rendezvous s
    (median), exit barrier s."""
    rows = []
    for line in stdout.splitlines():
        m = _SIM_ROW.match(line)
        if m:
            rows.append(
                {
                    "participants": float(m.group(1)),
                    "rendezvous_s": float(m.group(2)),
                    "exit_barrier_s": float(m.group(3)),
                }
            )
    return rows


def simulated_rdzv(reps: int, timeout: float = 600.0) -> dict[str, Any]:
    """Run ``bench/rdzv_bench.py`` (simulated participants on elastrun's
    embedded store) when it exists. Returns ``{"status": ..., "rows": [...]}``."""
    if not (BENCH_DIR / "rdzv_bench.py").exists():
        return {"status": "not available (bench/rdzv_bench.py is missing)"}
    sizes = ",".join(str(n) for n in SIMULATED_SIZES)
    cmd = [sys.executable, "-m", "bench.rdzv_bench", "--sizes", sizes, "--reps", str(reps)]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": f"failed: no answer within {timeout:.0f}s"}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # its helper processes share its group
        proc.wait()
    rows = parse_simulated(out)
    if proc.returncode != 0 or not rows:
        tail = (out.strip().splitlines() or [""])[-1]
        return {"status": f"failed: exit {proc.returncode}: {tail[:200]}", "rows": rows}
    return {"status": f"ran: `{' '.join(cmd[1:])}`", "rows": rows}


def scenario_dir(root: Path, sc: Scenario, cfg: LauncherConfig, rep: int) -> Path:
    return root / "runs" / f"{sc.name}-{cfg.name}-rep{rep}"
