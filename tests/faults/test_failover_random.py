"""A seeded, bounded random series of faults against a job whose store has
three candidate hosts (docs/failover.md), checked from the agents' event logs.

Four nodes in network namespaces: n1, n2, n3 are the candidates, n4 is not;
``--nnodes=1:4``, so one node alone could train (only the fencing keeps a
cut-off host from doing so). The job has no token, and a fifth namespace, x,
holds a stranger (tests/faults/forger.py) that from the first training on
keeps sending every standby votes for the next term in the other candidates'
names, and every candidate hellos in their names. Each fault picks, with the
seeded generator, a kind (SIGKILL of the agent's process group, a cut healed
a few seconds later, or a stall: SIGSTOP of the agent, SIGCONT 2 to 8 s
later) and a target by role (the current host, a standby, the node that is
no candidate); after each the job must train again, and a killed node is
started again, so that a majority of the candidates is up for the next one.
Before the faults, the seed may start the first candidate late: the others
elect a host without it and train, then it joins. So the series holds kills,
cuts and stalls of the host, of a standby, and of both in sequence, and heals.

The checker reads every node's event log (which workers each round started,
with what restart count) and the workers' step log (each step's rank, pid
and wall-clock time; the namespaces share one clock) and asserts:

* at most one training generation at any moment: the steps of two
  generations (a round's workers, told apart by round and master) never
  interleave in time;
* at most one host at any moment: each term is taken over once, and a host
  serves from its takeover until it steps down, or the test kills or stops
  it, before the next term's takeover (the forger's votes elect nobody);
* restart counts and checkpoint steps never go backwards;
* no worker is left behind, nothing left in the namespaces;
* every agent not killed by the test exits 0, or 1 with a line naming why
  (never a traceback).

``ELASTRUN_FAILOVER_SEED`` chooses the series (default 11: the first
candidate late, stalls of n4, of the host and of a standby, a cut of the
host; ``random`` draws
one, printed so that it can be replayed); ``ELASTRUN_FAILOVER_FAULTS`` sets
its length (default 4).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.faults.netns import Network
from tests.faults.test_failover_faults import failover_flags
from tests.faults.test_faults import (
    STORE_PORT,
    agent_traceback,
    assert_namespaces_empty,
    assert_no_workers,
    check_progress,
    diag,
    netns,
    start_in,
    wait_exit,
    wait_steps,
)
from tests.helpers import kill_group, wait_for
from tests.integration.elastic_harness import Agent, Job, job

__all__ = ["netns"]  # the fixture, used by name

CANDIDATES = ("n1", "n2", "n3")
NODES = (*CANDIDATES, "n4")
STRANGER = "x"  # the forging client's namespace (no agent)
FAILOVER_TIMEOUT = 60
RECOVERY = 90.0  # training again after one fault (a takeover, a restart, torch in gloo)
STEPS = 3  # steps that show the job trains again


@dataclass(frozen=True)
class Generation:
    round: int
    master: str
    restart_count: int
    first: float  # wall-clock time of its first and last step
    last: float


def read_events(j: Job) -> list[dict[str, Any]]:
    out = []
    for path in sorted(j.dir.glob("events-*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                event = json.loads(line)
                event["file"] = path.stem.removeprefix("events-")
                out.append(event)
    return out


def current_host(j: Job) -> str | None:
    """The node whose store took over last (the highest term)."""
    took = [e for e in read_events(j) if e["kind"] == "store_takeover"]
    return str(max(took, key=lambda e: e["term"])["file"]) if took else None


def generations(j: Job) -> list[Generation]:
    """Every round's workers that stepped, from the events and the step log."""
    started = {}
    for e in read_events(j):
        if e["kind"] == "workers_started":
            for pid in e["pids"]:
                started[pid] = (e["round"], e["master"], e["restart_count"])
    spans: dict[tuple[int, str, int], list[float]] = {}
    for step in j.steps():
        key = started.get(step["pid"])
        assert key is not None, f"a step of a worker no agent started: {step}"
        spans.setdefault(key, []).append(step["t"])
    gens = [Generation(r, m, c, min(ts), max(ts)) for (r, m, c), ts in spans.items()]
    return sorted(gens, key=lambda g: g.first)


def host_overlaps(j: Job, ended: dict[str, list[float]]) -> list[str]:
    """Where two hosts served at once, from the event logs: each takeover
    serves from its event until its node's next step-down event or the test's
    next kill or stop of that node (``ended``: wall-clock times by node),
    and must end before the next term's takeover. A term taken over twice is
    two hosts too."""
    events = read_events(j)
    took = sorted((e for e in events if e["kind"] == "store_takeover"), key=lambda e: e["term"])
    problems = []
    terms = [e["term"] for e in took]
    if len(terms) != len(set(terms)):
        problems.append(f"a term was taken over twice: {[(e['term'], e['file']) for e in took]}")
    downs: dict[str, list[float]] = {}
    for e in events:
        if e["kind"] == "store_stepped_down":
            downs.setdefault(e["file"], []).append(e["ts"])
    for before, after in itertools.pairwise(took):
        ends = downs.get(before["file"], []) + ended.get(before["file"], [])
        end = min((t for t in ends if t >= before["ts"]), default=float("inf"))
        if end > after["ts"]:
            together = "until the end" if end == float("inf") else f"{end - after['ts']:.1f} s"
            problems.append(
                f"{before['file']} (term {before['term']}) still served when {after['file']} "
                f"took term {after['term']} over: {together} together"
            )
    return problems


def check_invariants(j: Job, killed: set[int], ended: dict[str, list[float]] | None = None) -> None:
    problems = host_overlaps(j, ended or {})
    assert not problems, f"two hosts at once: {problems}\n{diag(j)}"
    gens = generations(j)
    for before, after in itertools.pairwise(gens):
        assert after.first > before.last, (
            f"two generations trained at once: {before} and {after}\n{diag(j)}"
        )
        assert after.restart_count >= before.restart_count, (before, after)
        assert after.round >= before.round, (before, after)  # never backwards
    check_progress(j, min_steps=1)
    assert_no_workers(j, bound=15.0)
    for agent in j.agents:
        if agent.proc.pid in killed:
            continue
        code = agent.proc.poll()
        out = agent.output()
        assert agent_traceback(agent) is None, out[-3000:]
        assert code == 0 or (code == 1 and "elastrun: error:" in out), (
            f"agent {agent.name} exited {code} without saying why:\n{out[-3000:]}"
        )


class Series:
    """The job, its nodes, and the faults done to them."""

    def __init__(self, j: Job, net: Network, rng: random.Random) -> None:
        self.j, self.net, self.rng = j, net, rng
        self.agents: dict[str, Agent] = {}
        self.killed: set[int] = set()  # pids of the agents the test killed
        self.ended: dict[str, list[float]] = {}  # node -> when the test killed or stopped it
        self.log: list[str] = []
        self.forger: subprocess.Popen[bytes] | None = None

    def start(self, node: str) -> None:
        flags = failover_flags(
            self.net, node, nnodes="1:4", failover_timeout=FAILOVER_TIMEOUT, candidates=CANDIDATES
        )
        self.agents[node] = start_in(self.j, self.net, node, node, flags)

    def begin(self) -> None:
        """Start every node; or, drawn by the seed, the first candidate late:
        the others elect a host among themselves and train without it, then
        it joins the job (docs/failover.md, *Start*)."""
        late = self.rng.random() < 0.5
        for node in NODES:
            if not (late and node == CANDIDATES[0]):
                self.start(node)
        if late:
            self.log.append(f"start: {CANDIDATES[0]} late")
            print(self.log[-1], flush=True)
            self.trains("training without the first candidate", world=len(NODES) - 1)
            self.start(CANDIDATES[0])
        self.trains("training at world 4", world=len(NODES))
        self.forge()

    def forge(self) -> None:
        """Start the stranger (see the module doc) in its own namespace."""
        endpoint = ",".join(f"{self.net[n].addr}:{STORE_PORT}" for n in CANDIDATES)
        argv = [sys.executable, str(Path(__file__).with_name("forger.py")), endpoint, "3600"]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.forger = self.net.run_in(STRANGER, argv, env=env, log_path=self.j.dir / "forger.log")
        self.log.append("forger started")

    def stop_forger(self) -> None:
        if self.forger is not None and self.forger.poll() is None:
            kill_group(self.forger.pid, signal.SIGKILL)
            self.forger.wait(30)

    def ends(self, node: str) -> None:
        self.ended.setdefault(node, []).append(time.time())

    def trains(self, what: str, world: int | None = None) -> None:
        mark = len(self.j.steps())

        def ok(s: dict[str, Any]) -> bool:
            return world is None or s["world"] == world

        wait_steps(self.j, ok, what, after=mark, count=STEPS)
        problems = host_overlaps(self.j, self.ended)
        assert not problems, f"two hosts at once: {problems}"

    def fault(self, number: int) -> None:
        host = current_host(self.j)
        roles = {"host": host, "standby": None, "other": "n4"}
        standbys = [n for n in CANDIDATES if n != host]
        roles["standby"] = self.rng.choice(standbys)
        role = self.rng.choice(sorted(roles))
        node = roles[role]
        assert node is not None
        kind = self.rng.choice(["kill", "cut", "stall"])
        self.log.append(f"{number}: {kind} {role} {node}")
        print(self.log[-1], flush=True)
        agent = self.agents[node]
        if kind == "kill":
            self.ends(node)
            agent.kill_group(signal.SIGKILL)
            self.killed.add(agent.proc.pid)
            agent.proc.wait(30)
            self.trains(f"training after fault {self.log[-1]}")
            self.start(node)  # back, as a restarted pod would be
            self.trains(f"{node} back after {self.log[-1]}", world=len(NODES))
        elif kind == "stall":
            self.ends(node)  # a stopped host serves nobody; continued, it steps down first
            agent.kill_group(signal.SIGSTOP)
            time.sleep(self.rng.uniform(2.0, 8.0))  # how long it stalls: random
            agent.kill_group(signal.SIGCONT)
            self.back_after_heal(node)
        else:
            self.net.cut(node)
            self.trains(f"training after fault {self.log[-1]}")
            time.sleep(self.rng.uniform(0.0, 3.0))  # how long it stays cut: random
            self.net.heal(node)
            self.back_after_heal(node)

    def back_after_heal(self, node: str) -> None:
        """A healed node trains again at full size. A candidate cut off long
        enough to vote (for itself: the only standby it could reach) follows
        no host of an older term any more: it exits once its failover timeout
        passes, naming why (docs/failover.md), and is started again, as a
        restarted pod would be."""
        agent, mark = self.agents[node], len(self.j.steps())
        what = f"{node} back after heal of {self.log[-1]}"

        def done() -> bool:
            full = [s for s in self.j.steps()[mark:] if s["world"] == len(NODES)]
            return len(full) >= STEPS or agent.proc.poll() is not None

        wait_for(done, RECOVERY + FAILOVER_TIMEOUT, what)
        if agent.proc.poll() is None:
            return
        out = agent.output()
        assert agent.proc.returncode == 1 and "no candidate took over" in out, out[-3000:]
        self.log.append(f"{node} exited after the heal, naming why; started again")
        self.start(node)
        self.trains(what, world=len(NODES))


def test_random_kills_and_cuts_of_hosts_and_standbys(
    tmp_path: Path, netns: Callable[[list[str]], Network]
) -> None:
    # A fixed series by default (the suite is repeatable); "random" draws one.
    chosen = os.environ.get("ELASTRUN_FAILOVER_SEED", "11")
    seed = random.randrange(1 << 30) if chosen == "random" else int(chosen)
    count = int(os.environ.get("ELASTRUN_FAILOVER_FAULTS", "4"))
    print(f"failover series: seed {seed}, {count} faults (ELASTRUN_FAILOVER_SEED={seed})")
    net = netns([*NODES, STRANGER])
    with job(tmp_path) as j:
        series = Series(j, net, random.Random(seed))
        try:
            try:
                series.begin()
                for number in range(1, count + 1):
                    series.fault(number)
            finally:
                series.stop_forger()
        except AssertionError as exc:
            hosts = host_overlaps(j, series.ended)  # named, whatever failed first
            raise AssertionError(
                f"seed {seed}, faults {series.log}: {exc}; two hosts at once: {hosts or 'none'}"
            ) from None
        j.touch("finish")
        for agent in series.agents.values():
            assert wait_exit(j, agent) == 0, f"seed {seed}: {series.log}\n{diag(j)}"
        check_invariants(j, series.killed, series.ended)
        forged = (j.dir / "forger.log").read_text()
        assert "forger: vote" in forged, forged[-2000:]  # it did try
    assert_namespaces_empty(net)


def test_the_checker_sees_two_generations_training_at_once(tmp_path: Path) -> None:
    """The checker itself, on logs where a cut-off host's group (round 3,
    master n1) still steps while the new host's group (round 3, master n2)
    does: it must fail. Then the same logs in order must pass."""
    j = Job(tmp_path)
    gone = 2**22 + 12345  # pids of no process
    started = [
        {"kind": "workers_started", "round": 2, "master": "n1:1", "restart_count": 0,
         "pids": [gone]},
        {"kind": "workers_started", "round": 3, "master": "n1:1", "restart_count": 0,
         "pids": [gone + 1]},
        {"kind": "workers_started", "round": 3, "master": "n2:1", "restart_count": 0,
         "pids": [gone + 2]},
    ]  # fmt: skip
    (tmp_path / "events-n1.jsonl").write_text("".join(json.dumps(e) + "\n" for e in started))

    def steps(times: list[tuple[int, int, float]]) -> None:
        lines = [
            {"rank": 0, "world": 1, "step": step, "restart": 0, "group_rank": 0, "pid": pid, "t": t}
            for pid, step, t in times
        ]
        (tmp_path / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in lines))
        (tmp_path / "ckpt.json").write_text(json.dumps({"step": times[-1][1]}))

    steps([(gone, 1, 1.0), (gone + 1, 2, 2.0), (gone + 2, 3, 2.5), (gone + 1, 4, 3.0)])
    try:
        check_invariants(j, set())
    except AssertionError as exc:
        assert "two generations trained at once" in str(exc)
    else:
        raise AssertionError("the checker missed two generations training at once")
    steps([(gone, 1, 1.0), (gone + 1, 2, 2.0), (gone + 2, 3, 2.5), (gone + 2, 4, 3.0)])
    check_invariants(j, set())
