"""Fault injection with real agents, real gloo workers and a real store.

The fault matrix of docs/reliability.md. Every test runs a training job that
checkpoints (tests/integration/scripts/elastic_worker.py), injects one kind
of fault and asserts that the job ends correctly (exit 0 with every
checkpointed step kept, or a clear non-zero exit where recovery is
impossible), that no worker outlives its agent, and that nothing waits past a
stated bound. Multi-host cases run each node in its own network namespace
(tests/faults/netns.py) so that a node can be partitioned for real.

The bounds are generous (a loaded 2-core CI machine); the times actually
observed are printed (``pytest -s`` shows them).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.faults.netns import Network, sweep_stale, teardown_on_sigterm, unavailable_reason
from tests.helpers import free_port, pid_alive, wait_for
from tests.integration.elastic_harness import ELASTRUN, SCRIPTS, Agent, Job, job

LEASE_TTL = 2.0
STORE_PORT = 29400  # each namespace has its own port space: no collisions
BOUND = 90.0  # training reaching a state after a fault (restart + torch import + gloo init)
EXIT_BOUND = 60.0  # agents exiting once the job is over
WORKER_DEATH_BOUND = 15.0  # workers gone after their agent died or was told to stop
STORE_LOSS_MARGIN = 40.0  # a node giving up on an unreachable store: join_timeout + this


# -- helpers ------------------------------------------------------------------


def rdzv_flags(
    endpoint: str,
    *,
    host: bool,
    nnodes: str,
    nproc: int = 1,
    max_restarts: int = 3,
    local_addr: str | None = None,
    run_id: str = "faults",
    join_timeout: int = 60,
) -> list[str]:
    flags = [
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        f"--max-restarts={max_restarts}",
        f"--rdzv-conf=last_call_timeout=1,lease_ttl={LEASE_TTL:g},join_timeout={join_timeout},"
        f"is_host={int(host)}",
        "--shutdown-timeout=5",
    ]
    if local_addr is not None:
        flags.append(f"--local-addr={local_addr}")
    return flags


def events_flag(j: Job, name: str) -> list[str]:
    return [f"--events-file={j.dir / f'events-{name}.jsonl'}"]


def start_in(
    j: Job,
    net: Network,
    node: str,
    name: str,
    flags: list[str],
    step_sleep: float = 0.1,
    env_extra: dict[str, str] | None = None,
) -> Agent:
    """Start an agent (the ``elastrun`` command) inside ``node``'s namespace."""
    log_path = j.dir / f"agent-{name}.log"
    env = dict(
        os.environ,
        ELASTIC_TEST_DIR=str(j.dir),
        PYTHONUNBUFFERED="1",
        ELASTIC_STEP_SLEEP=str(step_sleep),
        **(env_extra or {}),
    )
    argv = [*ELASTRUN, *flags, *events_flag(j, name), str(SCRIPTS / "elastic_worker.py")]
    proc = net.run_in(node, argv, env=env, log_path=log_path)
    agent = Agent(name, proc, log_path)
    j.agents.append(agent)
    return agent


def diag(j: Job, chars: int = 2500) -> str:
    parts = []
    for agent in j.agents:
        rc = agent.proc.poll()
        parts.append(f"--- agent {agent.name} (rc={rc}) ---\n{agent.output()[-chars:]}")
    steps = j.steps()
    parts.append(f"--- last steps ({len(steps)} in all) ---")
    parts += [json.dumps(s) for s in steps[-8:]]
    return "\n".join(parts)


def wait_steps(
    j: Job, pred: Callable[[dict[str, Any]], bool], what: str, *, after: int = 0, count: int = 1
) -> float:
    """Wait until ``count`` step records from index ``after`` on satisfy ``pred``;
    return the seconds waited."""
    t = time.monotonic()
    try:
        wait_for(lambda: len([s for s in j.steps()[after:] if pred(s)]) >= count, BOUND, what)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{diag(j)}") from None
    return time.monotonic() - t


def wait_exit(j: Job, agent: Agent, bound: float = EXIT_BOUND) -> int:
    try:
        return agent.wait(bound)
    except AssertionError:
        raise AssertionError(
            f"agent {agent.name} did not exit within {bound:.0f}s\n{diag(j)}"
        ) from None


def agent_traceback(agent: Agent) -> str | None:
    """The agent's own uncaught traceback, if its output has one (worker lines,
    prefixed ``[host:rank]``, are not the agent's)."""
    own = [line for line in agent.output().splitlines() if not line.startswith("[")]
    for i, line in enumerate(own):
        if line.startswith("Traceback (most recent call last)"):
            return "\n".join(own[i:][-25:])
    return None


def last_record(j: Job, rank: int) -> dict[str, Any]:
    return next(s for s in reversed(j.steps()) if s["rank"] == rank)


def inject_crash(j: Job, rank: int, how: str = "") -> None:
    """Atomically write the crash control file for ``rank`` (see the worker)."""
    tmp = j.dir / f".crash_rank_{rank}.tmp"
    tmp.write_text(how)
    os.replace(tmp, j.dir / f"crash_rank_{rank}")


def descendants(pid: int) -> set[int]:
    """All descendants of ``pid`` (read from /proc; bounded by the process count)."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = (entry / "stat").read_text()
            parent[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier and p not in found}
        found |= frontier
    return found


def workers_of(agent: Agent) -> set[int]:
    """The agent's live worker processes (not its other helpers: its orphan
    guard, or a warm interpreter still waiting, whose stdin is the agent's socket;
    a warm interpreter that became a worker has /dev/null there, as every worker)."""
    out = set()
    for pid in descendants(agent.proc.pid):
        with contextlib.suppress(OSError):
            if b"elastic_worker.py" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            if not os.readlink(f"/proc/{pid}/fd/0").startswith("socket:"):
                out.add(pid)
    return out


def wait_dead(pids: set[int], bound: float, what: str) -> float:
    t = time.monotonic()
    wait_for(lambda: not any(pid_alive(p) for p in pids), bound, what)
    return time.monotonic() - t


def check_progress(j: Job, min_steps: int) -> int:
    """No checkpointed step lost or redone; the checkpoint is the last step.

    Rank 0 saves the step, then logs it: its logged steps must strictly
    increase (a step redone means a round started from an older checkpoint
    than the newest one, i.e. progress was lost, or a stale rank 0 wrote),
    with at most one unlogged step between two logged ones (rank 0 killed
    between its save and its log line). Returns the final step.
    """
    rank0 = [s["step"] for s in j.steps() if s["rank"] == 0]
    assert rank0, f"no training step at all\n{diag(j)}"
    bad = [(a, b) for a, b in itertools.pairwise(rank0) if not 0 < b - a <= 2]
    assert not bad, f"steps redone or lost (previous, next): {bad[:10]}\n{diag(j)}"
    assert rank0[0] <= 2, rank0[:5]
    ckpt = json.loads((j.dir / "ckpt.json").read_text())["step"]
    assert ckpt == rank0[-1], (ckpt, rank0[-5:])
    assert rank0[-1] >= min_steps, rank0[-1]
    return int(ckpt)


def assert_no_workers(j: Job, bound: float = 5.0) -> None:
    pids = {int(s["pid"]) for s in j.steps()}
    try:
        wait_dead(pids, bound, "every worker to be gone")
    except AssertionError:
        alive = sorted(p for p in pids if pid_alive(p))
        raise AssertionError(f"workers outlived their agents: {alive}\n{diag(j)}") from None


def assert_namespaces_empty(net: Network, bound: float = 10.0) -> None:
    def empty() -> bool:
        return not any(net.pids_in(n.ns) for n in net.nodes.values())

    try:
        wait_for(empty, bound, "no process left in the namespaces")
    except AssertionError:
        left = {n.name: net.pids_in(n.ns) for n in net.nodes.values()}
        raise AssertionError(f"processes left in the namespaces: {left}") from None


def event_timeline(j: Job, since_wall: float, limit: int = 12) -> str:
    """The agents' events after a fault, as seconds since the fault (for the record)."""
    lines = []
    for path in sorted(j.dir.glob("events-*.jsonl")):
        name = path.stem.removeprefix("events-")
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError, KeyError, TypeError):
                ev = json.loads(line)
                if ev["ts"] >= since_wall:
                    lines.append((ev["ts"] - since_wall, name, ev["kind"]))
    lines.sort()
    return ", ".join(f"+{t:.1f}s {n}:{k}" for t, n, k in lines[:limit])


@pytest.fixture
def netns() -> Iterator[Callable[[list[str]], Network]]:
    """Make namespaced networks; tear them down and check nothing is left."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")
    swept = sweep_stale()
    if swept:
        print(f"removed namespaces left by a killed earlier run: {swept}")
    made: list[Network] = []

    def make(names: list[str]) -> Network:
        net = Network.create(names)
        made.append(net)
        return net

    with teardown_on_sigterm():
        try:
            yield make
        finally:
            left = []
            for net in made:
                try:
                    net.close()  # raises if a namespace, link or process is left
                except AssertionError as e:
                    left.append(str(e))
            assert not left, left


# -- 0. the fixture itself ------------------------------------------------------------------

_PROBE = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.5).close()
    print("open")
except OSError as e:
    print("closed", e)
"""


@pytest.mark.netns
def test_netns_fixture_partitions_and_cleans_up(netns: Callable[[list[str]], Network]) -> None:
    net = netns(["a", "b", "c"])
    server = net.run_in(
        "a", [sys.executable, "-c", "import socket,time; s=socket.create_server(('', 7000)); "
              "time.sleep(120)"],
    )  # fmt: skip

    def probe(node: str) -> str:
        argv = [sys.executable, "-c", _PROBE, net["a"].addr, "7000"]
        return net.check_call_in(node, argv).strip()

    wait_for(lambda: probe("b") == "open", 20, "the server in a to listen")
    net.cut("b")
    assert probe("b").startswith("closed"), "b still reaches a while cut"
    assert probe("c") == "open", "cutting b cut c too"
    net.heal("b")
    assert probe("b") == "open"
    net.close()
    assert server.poll() is not None
    assert net.leftovers() == []


# -- 1. worker failures (loopback) ---------------------------------------------------------

WORKER_FAILURES = ["SIGKILL", "SIGSEGV", "exit1", "exception"]


def test_worker_failures_restart_the_group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers die in each way in turn (SIGKILL, SIGSEGV, exit 1, an exception), on
    alternating nodes: each time every agent stops its workers, the group restarts
    (one restart counted, job-wide), training resumes from the checkpoint.

    One job goes through all four (not one job each): a group start costs a torch
    import per worker, and the CI budget is small."""
    monkeypatch.setenv("ELASTIC_STEP_SLEEP", "0.1")
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    restarts = len(WORKER_FAILURES)
    with job(tmp_path) as j:
        a = j.start_agent("a", rdzv_flags(endpoint, host=True, nnodes="2", max_restarts=restarts))
        b = j.start_agent("b", rdzv_flags(endpoint, host=False, nnodes="2", max_restarts=restarts))
        wait_steps(j, lambda s: s["world"] == 2 and s["step"] >= 2, "training at world 2")

        for attempt, how in enumerate(WORKER_FAILURES, start=1):
            old = {int(s["pid"]) for s in j.steps()}
            rank = attempt % 2  # rank 1 (node b), then rank 0 (node a, the store's host), ...
            victim = last_record(j, rank=rank)
            mark, t = len(j.steps()), time.monotonic()
            if how.startswith("SIG"):
                os.kill(int(victim["pid"]), signal.Signals[how])
            else:
                inject_crash(j, rank, "exception" if how == "exception" else "")

            def resumed(s: dict[str, Any], n: int = attempt) -> bool:
                return bool(s["restart"] == n and s["rank"] == 0)

            wait_steps(
                j,
                resumed,
                f"training after {how} of rank {rank}",
                after=mark,
                count=2,
            )
            print(f"[{how}] rank {rank} died -> training resumed after {time.monotonic() - t:.1f}s")
            wait_dead(old, WORKER_DEATH_BOUND, f"the workers from before the {how}")

        j.touch("finish")
        assert wait_exit(j, a) == 0, diag(j)
        assert wait_exit(j, b) == 0, diag(j)
        final = check_progress(j, min_steps=2 + 2 * restarts)
        assert max(s["restart"] for s in j.steps()) == restarts, "one restart per failure"
        assert_no_workers(j)
        print(f"worker failures: finished at step {final} after {restarts} restarts")


# -- 2. agent SIGKILLed (namespaces) ------------------------------------------------------


@pytest.mark.netns
def test_agent_sigkill_takes_its_workers_and_survivors_reform(
    tmp_path: Path, netns: Callable[[list[str]], Network]
) -> None:
    net = netns(["a", "b"])
    endpoint = f"{net['a'].addr}:{STORE_PORT}"
    with job(tmp_path) as j:
        a = start_in(
            j, net, "a", "a",
            rdzv_flags(endpoint, host=True, nnodes="1:2", local_addr=net["a"].addr),
        )  # fmt: skip
        b = start_in(
            j, net, "b", "b",
            rdzv_flags(endpoint, host=False, nnodes="1:2", nproc=2, local_addr=net["b"].addr),
        )  # fmt: skip
        wait_steps(j, lambda s: s["world"] == 3 and s["step"] >= 3, "training at world 3")

        b_workers = workers_of(b)
        assert len(b_workers) >= 2, b_workers
        mark, t, wall = len(j.steps()), time.monotonic(), time.time()
        os.kill(b.proc.pid, signal.SIGKILL)  # the agent alone: its workers must follow
        b.proc.wait(10)
        died = wait_dead(b_workers, WORKER_DEATH_BOUND, "the killed agent's workers to die")
        resumed = wait_steps(
            j, lambda s: s["world"] == 1 and s["rank"] == 0, "world 1 after the kill", after=mark
        )
        print(
            f"agent SIGKILL: its workers gone after {died:.1f}s; survivor training at "
            f"world 1 after {time.monotonic() - t:.1f}s (wait {resumed:.1f}s)"
        )
        print(f"events: {event_timeline(j, wall)}")

        mark = len(j.steps())
        wait_steps(j, lambda s: s["rank"] == 0, "steps at world 1", after=mark, count=3)
        j.touch("finish")
        assert wait_exit(j, a) == 0, diag(j)
        final = check_progress(j, min_steps=6)
        assert_no_workers(j)
        assert_namespaces_empty(net)
        counted = max(s["restart"] for s in j.steps())
        print(f"finished at step {final}; restarts counted: {counted}")
        # A node leaving while >= min remain is a membership change, not a
        # restart; the survivor's worker failing from the lost peer is collateral.
        assert counted == 0, f"losing a node consumed {counted} of --max-restarts\n{diag(j)}"


# -- 3. partition (namespaces) ------------------------------------------------------------


@pytest.mark.netns
def test_partitioned_node_is_dropped_and_cannot_corrupt_the_new_round(
    tmp_path: Path, netns: Callable[[list[str]], Network]
) -> None:
    net = netns(["a", "b", "c"])
    endpoint = f"{net['a'].addr}:{STORE_PORT}"
    with job(tmp_path) as j:
        agents = {
            name: start_in(
                j, net, name, name,
                rdzv_flags(
                    endpoint, host=name == "a", nnodes="2:3", local_addr=net[name].addr,
                    max_restarts=3,
                ),
                step_sleep=0.05,  # workers spend most of their time inside collectives
            )
            for name in ("a", "b", "c")
        }  # fmt: skip
        wait_steps(j, lambda s: s["world"] == 3 and s["step"] >= 3, "training at world 3")

        # Cut a node that neither hosts the store nor runs rank 0.
        workers = {name: workers_of(agent) for name, agent in agents.items()}
        recent = {int(s["pid"]): s["rank"] for s in j.steps() if s["world"] == 3}
        victim = next(n for n in ("c", "b") if all(recent.get(p, 1) != 0 for p in workers[n]))
        survivors = [n for n in ("a", "b", "c") if n != victim]
        old_pids = {int(s["pid"]) for s in j.steps()}

        mark, t, wall = len(j.steps()), time.monotonic(), time.time()
        net.cut(victim)
        reform = wait_steps(
            j, lambda s: s["world"] == 2 and s["rank"] == 0, "survivors at world 2", after=mark
        )
        assert net[victim].cut
        survivor_old = {p for n in survivors for p in workers[n]}
        wait_dead(survivor_old, WORKER_DEATH_BOUND, "the survivors' stuck workers to be stopped")
        cut_side = wait_dead(
            workers[victim], BOUND, "the cut node's workers to be stopped by its agent"
        )
        print(
            f"partition of {victim}: survivors training at world 2 after {reform:.1f}s; "
            f"cut node's workers stopped after {time.monotonic() - t:.1f}s (wait {cut_side:.1f}s)"
        )
        print(f"events: {event_timeline(j, wall)}")
        mark = len(j.steps())
        wait_steps(j, lambda s: s["rank"] == 0, "steps at world 2 while cut", after=mark, count=3)
        assert net[victim].cut

        # Heal: the cut node's agent rejoins (world 3 again) or exits; either way the
        # running round goes on and none of its old workers ever logs again.
        mark, t = len(j.steps()), time.monotonic()
        net.heal(victim)
        cut_agent = agents[victim]

        def settled() -> bool:
            back = any(s["world"] == 3 for s in j.steps()[mark:])
            return back or cut_agent.proc.poll() is not None

        try:
            wait_for(settled, BOUND, "the healed node to rejoin or exit")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{diag(j)}") from None
        rejoined = any(s["world"] == 3 for s in j.steps()[mark:])
        outcome = "rejoined" if rejoined else f"exited with {cut_agent.proc.returncode}"
        print(f"after heal: {victim} {outcome} after {time.monotonic() - t:.1f}s")
        if not rejoined:
            assert cut_agent.output().strip(), "the cut node's agent exited without a word"
            tb = agent_traceback(cut_agent)
            assert tb is None, f"the cut node's agent crashed instead of exiting cleanly:\n{tb}"
        mark = len(j.steps())
        wait_steps(j, lambda s: s["rank"] == 0, "steps after the heal", after=mark, count=3)
        assert not {int(s["pid"]) for s in j.steps()[mark:]} & old_pids, "a stale worker logged"

        j.touch("finish")
        for name in survivors:
            assert wait_exit(j, agents[name]) == 0, diag(j)
        code = wait_exit(j, cut_agent)
        assert code == 0 or not rejoined, diag(j)
        final = check_progress(j, min_steps=9)
        assert_no_workers(j)
        assert_namespaces_empty(net)
        counted = max(s["restart"] for s in j.steps())
        print(f"finished at step {final}; restarts counted: {counted}")
        assert counted == 0, f"a partition (a membership change) consumed {counted} restarts"


# -- 4. the store's host lost (namespaces) --------------------------------------------------


@pytest.mark.netns
@pytest.mark.parametrize("fault", ["kill", "cut"])
def test_store_host_loss_ends_the_job_with_a_clear_error(
    tmp_path: Path, fault: str, netns: Callable[[list[str]], Network]
) -> None:
    """The embedded store's host is SIGKILLed or partitioned: the other node
    exits non-zero within a bound, naming the store it lost, and leaves no worker."""
    net = netns(["a", "b"])
    endpoint = f"{net['a'].addr}:{STORE_PORT}"
    # Killed: every reconnection is refused, and the node reports the store
    # gone after 5 s of refusals. Cut: nothing answers at all, and the node
    # waits for up to read_timeout (here join_timeout, the smaller): the bound.
    join_timeout = 20
    with job(tmp_path) as j:
        a = start_in(
            j, net, "a", "a",
            rdzv_flags(
                endpoint, host=True, nnodes="1:2", local_addr=net["a"].addr,
                join_timeout=join_timeout,
            ),
        )  # fmt: skip
        b = start_in(
            j, net, "b", "b",
            rdzv_flags(
                endpoint, host=False, nnodes="1:2", local_addr=net["b"].addr,
                join_timeout=join_timeout,
            ),
        )  # fmt: skip
        wait_steps(j, lambda s: s["world"] == 2 and s["step"] >= 3, "training at world 2")
        a_workers, b_workers = workers_of(a), workers_of(b)

        t, wall = time.monotonic(), time.time()
        if fault == "kill":
            a.kill_group(signal.SIGKILL)
        else:
            net.cut("a")
        code = wait_exit(j, b, join_timeout + STORE_LOSS_MARGIN)
        took = time.monotonic() - t
        out = b.output()
        print(f"store host {fault}: the other node exited {code} after {took:.1f}s")
        print(f"events: {event_timeline(j, wall)}")
        assert code != 0, out[-3000:]
        tb = agent_traceback(b)
        assert tb is None, f"the node crashed instead of reporting the lost store:\n{tb}"
        assert endpoint in out or net["a"].addr in out, (
            f"the error does not name the lost store {endpoint}:\n{out[-3000:]}"
        )
        wait_dead(b_workers, WORKER_DEATH_BOUND, "the other node's workers")
        if fault == "kill":
            wait_dead(a_workers, WORKER_DEATH_BOUND, "the killed host's workers")
        else:
            # The host still runs the store: it drops the silent node and goes on alone.
            mark = len(j.steps())
            wait_steps(j, lambda s: s["world"] == 1, "the host at world 1", after=mark, count=3)
            j.touch("finish")
            assert wait_exit(j, a) == 0, diag(j)
            check_progress(j, min_steps=6)
            net.heal("a")
        assert_no_workers(j)
        assert_namespaces_empty(net)


# -- 5. churn soak (namespaces) ------------------------------------------------------------


# How long the churn soak injects faults: ``make test`` 12 s, ``make soak`` 600 s.
SOAK_SECONDS = float(os.environ.get("ELASTRUN_SOAK_SECONDS") or 12)


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timeout(SOAK_SECONDS + 300)
def test_churn_soak(tmp_path: Path, netns: Callable[[list[str]], Network]) -> None:
    """Random joins, agent kills and worker crashes at random times.

    ELASTRUN_SOAK_SECONDS (default 12) sets how long faults are injected;
    ELASTRUN_SOAK_SEED replays a run (the seed is printed)."""
    seconds = SOAK_SECONDS
    seed = int(os.environ.get("ELASTRUN_SOAK_SEED") or random.SystemRandom().randrange(2**31))
    print(f"soak: seed {seed} for {seconds:.0f}s (replay: ELASTRUN_SOAK_SEED={seed})")
    rng = random.Random(seed)
    pool = ["n1", "n2", "n3"]
    net = netns(["h", *pool])
    endpoint = f"{net['h'].addr}:{STORE_PORT}"
    max_nodes = 3

    def flags(node: str) -> list[str]:
        # Two crashes of one node's rank in a row are a node fault, which by
        # default excludes the node from this elastic job: right, but the
        # soak measures recovery from churn with every node kept (exclusion
        # has its own randomized test: test_quarantine_random.py).
        return [
            *rdzv_flags(
                endpoint, host=node == "h", nnodes=f"1:{max_nodes}", local_addr=net[node].addr,
                max_restarts=1000, run_id=f"soak{seed}",
            ),
            "--quarantine-time=0",
        ]  # fmt: skip

    live: dict[str, Agent] = {}
    started = 0

    def join(node: str) -> None:
        nonlocal started
        started += 1
        live[node] = start_in(j, net, node, f"{node}-{started}", flags(node))

    def members() -> int:
        return sum(1 for a in live.values() if workers_of(a))

    with job(tmp_path) as j:
        join("h")
        join("n1")
        wait_steps(j, lambda s: s["world"] == 2 and s["rank"] == 0, "training at world 2")

        log: list[str] = []
        recoveries: list[float] = []
        end = time.monotonic() + seconds
        events = 0
        while time.monotonic() < end and events < 200:
            events += 1
            free = [n for n in pool if n not in live]
            others = [n for n in live if n != "h"]
            actions = ["crash", "worker_kill"]
            if free:
                actions.append("join")
            if others:
                actions.append("agent_kill")
            action = rng.choice(actions)
            pids_before = {int(s["pid"]) for s in j.steps()}
            for agent in live.values():
                pids_before |= workers_of(agent)
            mark, t = len(j.steps()), time.monotonic()
            restart_expected = True
            if action == "join":
                node = rng.choice(free)
                restart_expected = members() < max_nodes
                join(node)
                what = f"join {node}"
            elif action == "agent_kill":
                node = rng.choice(others)
                agent = live.pop(node)
                restart_expected = bool(workers_of(agent))
                os.kill(agent.proc.pid, signal.SIGKILL)
                agent.proc.wait(10)
                what = f"agent_kill {node}"
            elif action == "crash":
                recent = j.steps()[-6:]
                rank = rng.randrange(recent[-1]["world"] if recent else 1)
                how = rng.choice(["exit1", "exception", "SIGSEGV"])
                inject_crash(j, rank, "" if how == "exit1" else how)
                what = f"crash rank {rank} ({how})"
            else:
                running = sorted(set().union(*(workers_of(a) for a in live.values())))
                victim = rng.choice(running) if running else None
                try:
                    if victim is None:
                        raise ProcessLookupError
                    os.kill(victim, signal.SIGKILL)
                except ProcessLookupError:
                    restart_expected = False
                what = f"worker_kill pid {victim}"
            log.append(f"{t - (end - seconds):.1f}s {what}")
            if rng.random() < 0.6:
                # Let it recover, and time it: a rank-0 step by a new worker.
                def recovered(
                    mark: int = mark,
                    before: set[int] = pids_before,
                    expect: bool = restart_expected,
                ) -> bool:
                    new = [s for s in j.steps()[mark:] if s["rank"] == 0]
                    if not expect:
                        return bool(new)
                    if any(int(s["pid"]) not in before for s in new):
                        return True
                    # A crash aimed at a rank the world lost meanwhile never fires.
                    unfired = list(j.dir.glob("crash_rank_*"))
                    if unfired and len(new) >= 5:
                        for path in unfired:
                            path.unlink(missing_ok=True)
                        return True
                    # Steady progress with no restart: the fault raced an earlier
                    # one (e.g. a join into a round that was re-forming anyway).
                    return len(new) >= 50

                try:
                    wait_for(recovered, BOUND, f"recovery from {what}")
                except AssertionError as e:
                    raise AssertionError(f"seed {seed}: {e}\n{log}\n{diag(j)}") from None
                recoveries.append(time.monotonic() - t)
                log[-1] += f" (recovered in {recoveries[-1]:.1f}s)"
                time.sleep(rng.uniform(0, 2))
            else:
                time.sleep(rng.uniform(0.2, 2))  # the next fault lands mid-recovery

        print("soak events:\n  " + "\n  ".join(log))
        if recoveries:
            print(
                f"soak recoveries: n={len(recoveries)} max={max(recoveries):.1f}s "
                f"mean={sum(recoveries) / len(recoveries):.1f}s"
            )
        # Settle, then finish: every live agent exits 0. A node that joined
        # last must be in the job first (a member, or waiting in it): one still
        # starting when the store's host finishes and exits loses the store.
        for path in j.dir.glob("crash_rank_*"):
            path.unlink(missing_ok=True)

        def in_job(agent: Agent) -> bool:
            return bool(j.kinds(agent.name, "round_joined") or j.kinds(agent.name, "node_waiting"))

        try:
            wait_for(lambda: all(in_job(a) for a in live.values()), BOUND, "every node in the job")
        except AssertionError as e:
            raise AssertionError(f"seed {seed}: {e}\n{diag(j)}") from None
        mark = len(j.steps())
        try:
            wait_steps(j, lambda s: s["rank"] == 0, "training after the churn", after=mark, count=3)
        except AssertionError as e:
            raise AssertionError(f"seed {seed}: {e}") from None
        j.touch("finish")
        for agent in live.values():
            code = wait_exit(j, agent, BOUND)
            assert code == 0, f"seed {seed}: agent {agent.name} exited {code}\n{diag(j)}"
        final = check_progress(j, min_steps=3)
        restarts = max(s["restart"] for s in j.steps())
        worker_faults = sum(1 for line in log if " crash " in line or " worker_kill " in line)
        print(
            f"soak: finished at step {final}, {events} faults ({worker_faults} worker faults), "
            f"{restarts} restarts counted"
        )
        assert_no_workers(j)
        assert_namespaces_empty(net)
