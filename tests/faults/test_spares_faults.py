"""Hot spares under random faults, each node in its own network namespace.

Four agents (``h`` hosts the embedded store and is never faulted; ``n1``..``n3``)
run ``--nnodes=2:3 --node-unit=2``: two train, two wait as spares. A seeded
sequence of faults follows: a training node's agent SIGKILLed, a spare's agent
SIGKILLed, a spare cut off and healed, a training node cut off and healed, two
nodes killed at once, a killed node started again. After each, the test waits
(bounded) for training to go on at world 2. At the end the job finishes, and
the checker (tests/faults/spares_check.py) reads every agent's event log:
every world is an allowed size; a promoted spare takes exactly a lost rank;
survivors keep theirs; at most one training generation at any moment; every
worker's end is accounted for. No worker outlives the run.

``ELASTRUN_SOAK_SEED`` replays a run (the seed is printed);
``ELASTRUN_SPARE_FAULTS`` sets how many faults (default 3; 5 under ``make soak``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.faults.netns import Network
from tests.faults.spares_check import Faults, violations
from tests.faults.test_faults import (
    BOUND,
    STORE_PORT,
    assert_namespaces_empty,
    assert_no_workers,
    check_progress,
    diag,
    netns,  # noqa: F401 (the fixture)
    start_in,
    wait_dead,
    wait_exit,
    workers_of,
)
from tests.helpers import soak_or, wait_for
from tests.integration.elastic_harness import Agent, Job, job

FAULTS = int(os.environ.get("ELASTRUN_SPARE_FAULTS") or soak_or(3, 5))
POOL = ("n1", "n2", "n3")  # the nodes faults may hit; "h" hosts the store


def spare_flags(net: Network, node: str, run_id: str, join_timeout: int = 120) -> list[str]:
    return [
        "--nnodes=2:3",
        "--node-unit=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={net['h'].addr}:{STORE_PORT}",
        f"--rdzv-id={run_id}",
        "--max-restarts=100",
        # A long last call: a re-formed round waits for its present survivors
        # (not the timer), so the timer never cuts a survivor out here.
        f"--rdzv-conf=last_call_timeout=20,lease_ttl=2,join_timeout={join_timeout},"
        f"is_host={int(node == 'h')}",
        "--shutdown-timeout=5",
        f"--local-addr={net[node].addr}",
    ]


def read_log(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line torn by a SIGKILL
    return out


class Run:
    """The job under faults: which agent runs in which namespace, what was done."""

    def __init__(self, j: Job, net: Network, seed: int, join_timeout: int = 120) -> None:
        self.j, self.net, self.seed = j, net, seed
        self.join_timeout = join_timeout
        self.live: dict[str, Agent] = {}
        self.starts = 0
        self.faults = Faults()
        self.log: list[str] = []

    def start(self, node: str) -> None:
        self.starts += 1
        name = f"{node}-{self.starts}"
        flags = spare_flags(self.net, node, f"spares{self.seed}", self.join_timeout)
        self.live[node] = start_in(self.j, self.net, node, name, flags)

    def prune(self) -> None:
        """Let go of agents that ended by themselves (a node cut off from the
        store for long may give up): their namespace is free again."""
        for node, agent in list(self.live.items()):
            code = agent.proc.poll()
            if code is not None:
                del self.live[node]
                self.log.append(f"  ({agent.name} exited by itself with {code})")

    def events(self, name: str) -> list[dict[str, Any]]:
        path = self.j.dir / f"events-{name}.jsonl"
        return read_log(path) if path.exists() else []

    def training(self) -> list[str]:
        return [n for n, a in self.live.items() if workers_of(a)]

    def ready_spares(self) -> list[str]:
        """Live nodes waiting as spares (their newest word is a spare wait)."""
        out = []
        for node, agent in self.live.items():
            said = ("node_waiting", "workers_started")
            kinds = [e for e in self.events(agent.name) if e["kind"] in said]
            waits = kinds and kinds[-1]["kind"] == "node_waiting" and kinds[-1].get("spare")
            if waits and agent.proc.poll() is None and not workers_of(agent):
                out.append(node)
        return out

    def kill(self, node: str) -> None:
        agent = self.live.pop(node)
        self.faults.killed[agent.name] = time.time()
        os.kill(agent.proc.pid, signal.SIGKILL)
        agent.proc.wait(10)

    def cut(self, node: str) -> float:
        self.net.cut(node)
        return time.time()

    def heal(self, node: str, since: float) -> float:
        self.net.heal(node)
        healed = time.time()
        self.faults.cut.setdefault(self.live[node].name, []).append((since, healed))
        return healed

    def settle_cut(self, node: str, healed_at: float) -> str:
        """After a cut past the lease TTL and its heal (well within the
        rejoin window, join_timeout): the node registered again and waits as
        a spare (a new spare wait after the heal); its agent never exits."""
        agent = self.live[node]

        def settled() -> bool:
            if agent.proc.poll() is not None:
                return True
            again = [
                e
                for e in self.events(agent.name)
                if e["kind"] == "node_waiting" and e.get("spare") and e["ts"] > healed_at
            ]
            return bool(again) and node in self.ready_spares()

        wait_for(settled, BOUND, f"{node} to wait as a spare again")
        out = agent.output()
        assert agent.proc.poll() is None, (
            f"seed {self.seed}: {agent.name} ended with {agent.proc.returncode} instead of "
            f"rejoining:\n{out[-2000:]}"
        )
        return "waits as a spare again"

    def steps_pids(self) -> set[int]:
        return {int(s["pid"]) for s in self.j.steps()}

    def wait_world(self, mark: int, old: set[int], what: str, count: int = 3) -> float:
        """Until ``count`` rank-0 steps at world 2 by a worker not in ``old``."""
        t = time.monotonic()

        def new_steps() -> bool:
            fresh = [
                s
                for s in self.j.steps()[mark:]
                if s["world"] == 2 and s["rank"] == 0 and int(s["pid"]) not in old
            ]
            return len(fresh) >= count

        try:
            wait_for(new_steps, BOUND, what)
        except AssertionError as e:
            raise AssertionError(f"seed {self.seed}: {e}\n{self.log}\n{diag(self.j)}") from None
        return time.monotonic() - t

    def wait_undisturbed(self, mark: int, before: set[int], what: str) -> None:
        """Training goes on by the same workers: a spare's fault touches no one."""
        self.wait_world(mark, set(), what)
        pids = {int(s["pid"]) for s in self.j.steps()[mark:]}
        assert pids <= before, (
            f"seed {self.seed}: {what} restarted training ({sorted(pids - before)} are new)\n"
            f"{self.log}\n{diag(self.j)}"
        )


def one_fault(run: Run, rng: random.Random) -> str:
    run.prune()
    training = [n for n in run.training() if n in POOL]
    spares = [n for n in run.ready_spares() if n in POOL]
    every_spare = run.ready_spares()
    free = [n for n in POOL if n not in run.live]
    choices: list[str] = []
    if training and every_spare:
        choices += ["kill_training", "cut_training"]
    if spares:
        choices += ["kill_spare", "cut_spare"]
    if training and spares and len(every_spare) >= 2:
        choices.append("kill_two")
    if free:
        choices.append("start")
    action = rng.choice(choices)
    mark, before = len(run.j.steps()), run.steps_pids()
    t = time.monotonic()
    if action == "kill_training":
        node = rng.choice(training)
        run.kill(node)
        took = run.wait_world(mark, before, f"a spare training after killing {node}")
        return f"kill_training {node}: training again at world 2 after {took:.1f}s"
    if action == "kill_two":
        pair = [rng.choice(training), rng.choice(spares)]
        for node in pair:
            run.kill(node)
        took = run.wait_world(mark, before, f"training after killing {pair}")
        return f"kill_two {pair}: training again at world 2 after {took:.1f}s"
    if action == "cut_training":
        node = rng.choice(training)
        old = workers_of(run.live[node])
        since = run.cut(node)
        took = run.wait_world(mark, before, f"a spare training while {node} is cut off")
        wait_dead(old, BOUND, f"the cut node {node}'s workers to be stopped by its agent")
        time.sleep(rng.uniform(0.0, 2.0))
        after = run.settle_cut(node, run.heal(node, since))
        return f"cut_training {node}: training again at world 2 after {took:.1f}s; it {after}"
    if action == "kill_spare":
        node = rng.choice(spares)
        run.kill(node)
        run.wait_undisturbed(mark, before, f"losing the spare {node}")
        return f"kill_spare {node}: training undisturbed"
    if action == "cut_spare":
        node = rng.choice(spares)
        since = run.cut(node)
        long = rng.random() < 0.5
        # Shorter than the lease TTL (2 s): nothing changes; longer: its lease
        # lapses, and it registers again on the heal.
        time.sleep(rng.uniform(3.0, 4.0) if long else rng.uniform(0.2, 0.8))
        healed = run.heal(node, since)
        run.wait_undisturbed(mark, before, f"cutting off the spare {node}")
        if long:
            after = run.settle_cut(node, healed)
        else:
            assert node in run.ready_spares(), f"seed {run.seed}: {node} is no spare after a blip"
            after = "kept its lease"
        return f"cut_spare {node} for {time.monotonic() - t:.1f}s: training undisturbed; it {after}"
    node = rng.choice(free)
    run.start(node)
    wait_for(lambda: node in run.ready_spares(), BOUND, f"{node} waiting as a spare")
    run.wait_undisturbed(mark, before, f"starting {node} again as a spare")
    return f"start {node}: a spare again, training undisturbed"


@pytest.mark.netns
@pytest.mark.slow  # `make soak` runs the longer series
def test_spares_replace_lost_nodes_under_random_faults(
    tmp_path: Path,
    netns: Callable[[list[str]], Network],  # noqa: F811 (the fixture imported above)
) -> None:
    seed = int(os.environ.get("ELASTRUN_SOAK_SEED") or random.SystemRandom().randrange(2**31))
    print(f"spares: seed {seed}, {FAULTS} faults (replay: ELASTRUN_SOAK_SEED={seed})")
    rng = random.Random(seed)
    net = netns(["h", *POOL])
    with job(tmp_path) as j:
        run = Run(j, net, seed)
        for node in ("h", *POOL):
            run.start(node)
        run.wait_world(0, set(), "training at world 2", count=1)
        wait_for(lambda: len(run.ready_spares()) == 2, BOUND, "two spares waiting")
        for _ in range(FAULTS):
            run.log.append(one_fault(run, rng))
        print("spares under faults:\n  " + "\n  ".join(run.log))

        j.touch("finish")
        for agent in list(run.live.values()):
            code = wait_exit(j, agent, BOUND)
            assert code == 0, f"seed {seed}: {agent.name} exited {code}\n{run.log}\n{diag(j)}"
        check_progress(j, min_steps=3)
        logs = {p.stem.removeprefix("events-"): read_log(p) for p in j.dir.glob("events-*.jsonl")}
        started = {
            int(pid) for evs in logs.values() for e in evs if e["kind"] == "workers_started"
            for pid in e["pids"]
        }  # fmt: skip
        wait_dead(started, BOUND, "every worker ever started to be gone")
        assert_no_workers(j)
        assert_namespaces_empty(net)
        found = violations(logs, run.faults, {2})
        assert not found, f"seed {seed}: " + "\n".join(found) + f"\n{run.log}"
        promoted = sum(1 for evs in logs.values() for e in evs if e["kind"] == "spare_promoted")
        print(f"spares: {promoted} promotions, rounds checked: every world of 2 nodes")
