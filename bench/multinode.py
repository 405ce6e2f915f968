"""Scenarios with several agents on a c10d rendezvous: scale-up and node loss
(3+4), the store's host lost (4b), partition (5), rendezvous scale (6), a node
lost beside a hot spare (7). See docs/benchmarks.md."""

from __future__ import annotations

import time
from collections.abc import Callable

from bench.base import Context, count_steps, launcher_env, pause, steps_after
from bench.configs import LauncherConfig
from bench.harness import Agent, all_ranks_time, free_port
from bench.netns import NetnsLab
from bench.paths import BenchFailure


def agent_argv(
    cfg: LauncherConfig, nnodes: str, endpoint: str, is_host: bool, run_id: str, *extra: str
) -> list[str]:
    return cfg.argv(
        [
            f"--nnodes={nnodes}",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={run_id}",
            *extra,
            "--max-restarts=3",
        ],
        {"is_host": "1" if is_host else "0"},
    )


# --------------------------------------------------------------------------- 3+4. membership


def membership(nnodes: str, node_loss: bool) -> Callable[[Context], None]:
    """Two agents train; a third joins (scale-up); optionally it is then
    killed with all its processes (node loss)."""

    def fn(ctx: Context) -> None:
        run, cfg, s = ctx.run, ctx.cfg, ctx.settings
        port = free_port()
        endpoint, run_id = f"127.0.0.1:{port}", f"bench{port}"
        ctx.info["rdzv_endpoint"] = endpoint

        def start(name: str, is_host: bool = False) -> Agent:
            argv = agent_argv(cfg, nnodes, endpoint, is_host, run_id)
            return run.start_agent(name, argv, {**launcher_env(cfg), "BENCH_NODE": name})

        a, b = start("agent-a", is_host=True), start("agent-b")
        t2 = run.wait(
            "training at world 2",
            lambda log: steps_after(log, 0.0, 2),
            s.start_timeout,
            alive=[a, b],
        )
        ctx.out["world2_first_step"] = t2 - a.t_launch
        run.wait(
            f"{s.warm_steps} steps at world 2",
            lambda log: count_steps(log, 2) >= 2 * s.warm_steps,
            s.start_timeout,
            alive=[a, b],
            stall=s.restart_stall,
        )
        c = start("agent-c")
        t_join = c.t_launch
        t3 = run.wait(
            "training at world 3",
            lambda log: steps_after(log, t_join, 3),
            s.phase_timeout,
            alive=[a, b, c],
            stall=s.restart_stall,
        )
        ctx.out["scale_up"] = t3 - t_join
        running = ("agent-a", "agent-b")
        gap = pause(
            run.log, t_join, lambda e: e.get("node") in running, lambda e: int(e["world"]) == 3
        )
        if gap is not None:
            ctx.out["pause_scale_up"] = gap
        if node_loss:
            run.wait(
                f"{s.warm_steps} steps at world 3",
                lambda log: count_steps(log, 3, after=t3) >= 3 * s.warm_steps,
                s.phase_timeout,
                alive=[a, b, c],
                stall=s.restart_stall,
            )
            t_kill = run.kill_node(c)
            t_back = run.wait(
                "survivors training at world 2",
                lambda log: steps_after(log, t_kill, 2),
                s.phase_timeout,
                alive=[a, b],
                stall=s.loss_stall(cfg),
            )
            ctx.out["node_loss"] = t_back - t_kill
            gap = pause(
                run.log,
                t_kill,
                lambda e: e.get("node") in running,
                lambda e: int(e["world"]) == 2 and e["t"] > t_kill,
            )
            if gap is not None:
                ctx.out["pause_node_loss"] = gap
        run.stop()
        try:
            run.wait_exit([a, b] if node_loss else [a, b, c], s.exit_timeout)
        except BenchFailure as exc:
            ctx.notes.append(f"after the measurement: {exc}")

    return fn


# --------------------------------------------------------------------------- 4b. store host loss

CANDIDATES = ("127.0.0.1", "127.0.0.2", "127.0.0.3")


def store_host_loss(ctx: Context) -> None:
    """Three agents train, told apart by loopback addresses; the agent hosting
    the store is SIGKILLed with all its processes. elastrun gets the three as
    candidate hosts (docs/failover.md); torchrun has one store endpoint, the
    first node's (its c10d backend takes no list): it loses the job, and the
    run fails with the survivors' exit."""
    run, cfg, s = ctx.run, ctx.cfg, ctx.settings
    port = free_port()
    elastrun = cfg.launcher == "elastrun"
    endpoint = ",".join(f"{h}:{port}" for h in CANDIDATES) if elastrun else f"127.0.0.1:{port}"
    ctx.info["rdzv_endpoint"] = endpoint
    agents = []
    for i, addr in enumerate(CANDIDATES):
        conf = {"lease_ttl": "3"} if elastrun and cfg.tuned else {}
        if not elastrun:
            conf["is_host"] = "1" if i == 0 else "0"
        argv = cfg.argv(
            [
                "--nnodes=2:3",
                "--nproc-per-node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={endpoint}",
                f"--rdzv-id=bench{port}",
                f"--local-addr={addr}",
                "--max-restarts=3",
            ],
            conf,
        )
        name = f"agent-{i}"
        agents.append(run.start_agent(name, argv, {**launcher_env(cfg), "BENCH_NODE": name}))
    host, survivors = agents[0], agents[1:]
    t3 = run.wait(
        "training at world 3",
        lambda log: steps_after(log, 0.0, 3),
        s.start_timeout,
        alive=agents,
    )
    ctx.out["world3_first_step"] = t3 - host.t_launch
    run.wait(
        f"{s.warm_steps} steps at world 3",
        lambda log: count_steps(log, 3, after=t3) >= 3 * s.warm_steps,
        s.phase_timeout,
        alive=agents,
        stall=s.restart_stall,
    )
    t_kill = run.kill_node(host)
    t_back = run.wait(
        "survivors training at world 2 after the store's host was killed",
        lambda log: steps_after(log, t_kill, 2),
        s.phase_timeout,
        alive=survivors,
        stall=s.loss_stall(cfg),
    )
    ctx.out["store_host_loss"] = t_back - t_kill
    names = {a.name for a in survivors}
    gap = pause(
        run.log,
        t_kill,
        lambda e: e.get("node") in names,
        lambda e: int(e["world"]) == 2 and e["t"] > t_kill,
    )
    if gap is not None:
        ctx.out["pause_store_host_loss"] = gap
    run.stop()
    try:
        run.wait_exit(survivors, s.exit_timeout)
    except BenchFailure as exc:
        ctx.notes.append(f"after the measurement: {exc}")


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
        argv = agent_argv(
            cfg, "2:3", endpoint, i == 0, f"bench{port}", f"--local-addr={lab.addr(i)}"
        )
        env = {**launcher_env(cfg), "GLOO_SOCKET_IFNAME": "eth0"}
        agents.append(run.start_agent(f"agent-{i}", [*lab.exec_prefix(i), *argv], env))
    a, b = agents[:2]
    t3 = run.wait(
        "training at world 3",
        lambda log: steps_after(log, 0.0, 3),
        s.start_timeout,
        alive=agents,
    )
    ctx.out["world3_first_step"] = t3 - a.t_launch
    run.wait(
        f"{s.warm_steps} steps at world 3",
        lambda log: count_steps(log, 3) >= 3 * s.warm_steps,
        s.phase_timeout,
        alive=agents,
        stall=s.restart_stall,
    )
    t_cut = lab.partition(2)
    t_back = run.wait(
        "survivors training at world 2 after the partition",
        lambda log: steps_after(log, t_cut, 2),
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
        endpoint = f"127.0.0.1:{port}"
        agents = [
            run.start_agent(
                f"agent-{i}",
                agent_argv(cfg, str(n), endpoint, i == 0, f"bench{port}"),
                launcher_env(cfg),
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


# --------------------------------------------------------------------------- 7. hot spares


SPARE_LINE = "waiting as a spare"


def spare_loss(ctx: Context) -> None:
    """Three agents for a world of 2: elastrun with ``--nnodes=2:3
    --node-unit=2`` (two train, the third waits as a hot spare); torchrun with
    the same nodes and ``--nnodes=2:3`` (it has no node unit: the third joins
    and the world becomes 3). A training node (not the store's host) is then
    SIGKILLed with all its processes: time until every rank steps at world 2
    again, and whether the ranks of the nodes that keep training stayed."""
    _spare_loss(ctx, "spare_loss", agent_only=False)


def spare_agent_kill(ctx: Context) -> None:
    """As :func:`spare_loss`, but only the training node's agent process is
    SIGKILLed (an OOM kill, ``kill -9`` of the launcher): what becomes of its
    workers and of its place is the launcher's doing."""
    _spare_loss(ctx, "spare_agent_kill", agent_only=True)


def _spare_loss(ctx: Context, metric: str, agent_only: bool) -> None:
    run, cfg, s = ctx.run, ctx.cfg, ctx.settings
    port = free_port()
    endpoint, run_id = f"127.0.0.1:{port}", f"bench{port}"
    ctx.info["rdzv_endpoint"] = endpoint
    unit = ("--node-unit=2",) if cfg.launcher == "elastrun" else ()

    def start(name: str, is_host: bool = False) -> Agent:
        events = (f"--events-file={run.dir / f'{name}.events.jsonl'}",) if unit else ()
        argv = agent_argv(cfg, "2:3", endpoint, is_host, run_id, *unit, *events)
        return run.start_agent(name, argv, {**launcher_env(cfg), "BENCH_NODE": name})

    a, b = start("agent-a", is_host=True), start("agent-b")
    run.wait(
        f"{s.warm_steps} steps at world 2",
        lambda log: count_steps(log, 2) >= 2 * s.warm_steps,
        s.start_timeout,
        alive=[a, b],
        stall=s.restart_stall,
    )
    c = start("agent-c")
    if unit:
        run.wait(
            "the 3rd agent waiting as a spare",
            lambda log: SPARE_LINE in c.log_path.read_text(errors="replace"),
            s.phase_timeout,
            alive=[a, b, c],
        )
        t_settled = time.monotonic()
        run.wait(
            f"{s.warm_steps} more steps at world 2 beside the spare",
            lambda log: count_steps(log, 2, after=t_settled) >= 2 * s.warm_steps,
            s.phase_timeout,
            alive=[a, b, c],
            stall=s.restart_stall,
        )
    else:
        t3 = run.wait(
            "training at world 3",
            lambda log: steps_after(log, c.t_launch, 3),
            s.phase_timeout,
            alive=[a, b, c],
            stall=s.restart_stall,
        )
        run.wait(
            f"{s.warm_steps} steps at world 3",
            lambda log: count_steps(log, 3, after=t3) >= 3 * s.warm_steps,
            s.phase_timeout,
            alive=[a, b, c],
            stall=s.restart_stall,
        )
    before = {e["node"]: e["group_rank"] for e in run.log.select("step")}
    ctx.info["world_with_3_nodes"] = max(int(e["world"]) for e in run.log.select("step"))
    t_kill = run.kill_agent(b) if agent_only else run.kill_node(b)
    ctx.info["kill_wall"] = time.time() - (time.monotonic() - t_kill)
    t_back = run.wait(
        "training at world 2 after the loss",
        lambda log: steps_after(log, t_kill, 2),
        s.phase_timeout,
        alive=[a, c],
        stall=s.loss_stall(cfg),
    )
    ctx.out[metric] = t_back - t_kill
    after = {
        e["node"]: e["group_rank"]
        for e in run.log.select("step", after=t_kill)
        if int(e["world"]) == 2
    }
    ctx.info["ranks_after"] = after
    ctx.info["survivor_kept_rank"] = after.get("agent-a") == before.get("agent-a")
    ctx.info["third_took_lost_rank"] = after.get("agent-c") == before.get("agent-b")
    gap = pause(
        run.log,
        t_kill,
        lambda e: e.get("node") == "agent-a",
        lambda e: int(e["world"]) == 2 and e["t"] > t_kill,
    )
    if gap is not None:
        ctx.out[f"pause_{metric}"] = gap
    run.stop()
    try:
        run.wait_exit([a, c], s.exit_timeout)
    except BenchFailure as exc:
        ctx.notes.append(f"after the measurement: {exc}")


def spare_partition(ctx: Context) -> None:
    """As :func:`spare_loss`, each agent in a network namespace of its own,
    and the training node's link is cut instead (packets dropped, no resets):
    elastrun replaces it once its lease lapses (``lease_ttl``)."""
    with NetnsLab(3) as lab:
        try:
            _spare_partition(ctx, lab)
        finally:
            ctx.run.cleanup()  # before the namespaces go


def _spare_partition(ctx: Context, lab: NetnsLab) -> None:
    run, cfg, s = ctx.run, ctx.cfg, ctx.settings
    port = free_port()
    endpoint = f"{lab.addr(0)}:{port}"
    ctx.info["rdzv_endpoint"] = endpoint
    unit = ("--node-unit=2",) if cfg.launcher == "elastrun" else ()

    def start(i: int) -> Agent:
        argv = agent_argv(
            cfg, "2:3", endpoint, i == 0, f"bench{port}", f"--local-addr={lab.addr(i)}", *unit
        )
        env = {**launcher_env(cfg), "GLOO_SOCKET_IFNAME": "eth0", "BENCH_NODE": f"agent-{i}"}
        return run.start_agent(f"agent-{i}", [*lab.exec_prefix(i), *argv], env)

    a, b = start(0), start(1)
    run.wait(
        f"{s.warm_steps} steps at world 2",
        lambda log: count_steps(log, 2) >= 2 * s.warm_steps,
        s.start_timeout,
        alive=[a, b],
        stall=s.restart_stall,
    )
    c = start(2)
    world = 2 if unit else 3
    if unit:
        run.wait(
            "the 3rd agent waiting as a spare",
            lambda log: SPARE_LINE in c.log_path.read_text(errors="replace"),
            s.phase_timeout,
            alive=[a, b, c],
        )
    t_settled = time.monotonic()
    run.wait(
        f"{s.warm_steps} steps at world {world} with the 3rd agent",
        lambda log: count_steps(log, world, after=t_settled) >= world * s.warm_steps,
        s.phase_timeout,
        alive=[a, b, c],
        stall=s.restart_stall,
    )
    t_cut = lab.partition(1)
    t_back = run.wait(
        "training at world 2 after the partition",
        lambda log: steps_after(log, t_cut, 2),
        s.partition_timeout,
        alive=[a, c],
    )
    ctx.out["spare_partition"] = t_back - t_cut
    run.stop()
    try:
        run.wait_exit([a, c], s.exit_timeout)
    except BenchFailure as exc:
        ctx.notes.append(f"after the measurement: {exc}")
