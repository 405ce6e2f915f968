"""Quarantine under a seeded random series of faults, each node in its own
network namespace, checked from the agents' event logs.

Four agents (``h`` hosts the embedded store; ``n1``..``n3``) run
``--nnodes=2:3`` with ``--quarantine-time``: three train, one waits as a
spare. A seeded series of faults follows (bounded in count, each one's
recovery bounded in time), drawn from:

* ``node_fault X``: the worker on X fails twice in a row with a failure of
  one class (a RuntimeError, its message different each time: never the
  same failure, so never a script fault): a real node fault. X must be
  quarantined and leave where the job can go on without it (the spare
  takes its place, else the job goes on smaller), and stay where it cannot
  (two nodes train, no spare: ``--nnodes``' minimum). At most three;
* ``crash X``: the worker on X (h included) exits once with an exit code
  used once: a transient failure, whose peers' collectives break
  (collateral failures on every other node);
* ``pair X Y``: X's worker, then Y's, exit with one code (used for no other
  fault): a failure moving between nodes, never a node fault;
* ``cut X``: a training node cut off from the others for longer than the
  lease, then healed: it comes back as a spare (or, if its agent gave up,
  is started again); only while the others are more than the minimum (a
  crash instead otherwise).

Then every quarantined node's agent is started again: refused while its
quarantine lasts, let in once it expired. The job finishes; the checker
(tests/faults/quarantine_check.py) reads every agent's event log and the
injections the workers logged, and asserts that no node is excluded beyond
what the rule allows (see there).

``ELASTRUN_QUARANTINE_SEED`` replays a series (the seed is printed, and
named in every failure); ``ELASTRUN_QUARANTINE_FAULTS`` sets its length
(default 3, 8 under ``ELASTRUN_SOAK``).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.faults.netns import Network
from tests.faults.quarantine_check import violations
from tests.faults.test_faults import (
    BOUND,
    STORE_PORT,
    assert_namespaces_empty,
    assert_no_workers,
    diag,
    netns,  # noqa: F401 (the fixture)
    start_in,
    wait_exit,
    workers_of,
)
from tests.faults.test_spares_faults import read_log
from tests.helpers import soak_or, wait_for
from tests.integration.elastic_harness import Agent, Job, job

NODES = ("h", "n1", "n2", "n3")
POOL = NODES[1:]  # nodes that node faults and cuts hit; h hosts the store
NNODES = (2, 3)
LIMIT = 2  # --fault-limit's default
QUARANTINE = 15.0  # --quarantine-time: short, so that the run sees it expire
STEPS = 3  # rank-0 steps that show the job trains again


class Series:
    """The job, its nodes, and the faults done to them."""

    def __init__(self, j: Job, net: Network, seed: int) -> None:
        self.j, self.net, self.seed = j, net, seed
        self.live: dict[str, Agent] = {}
        self.cut_off: set[str] = set()
        self.quarantined: dict[str, float] = {}  # node -> until (its event's)
        self.starts = 0
        self.codes = iter(range(3, 100))  # exit codes, each used once
        self.log: list[str] = []

    # -- the nodes -------------------------------------------------------
    def start(self, node: str) -> Agent:
        self.starts += 1
        name = f"{node}-{self.starts}"
        flags = [
            f"--nnodes={NNODES[0]}:{NNODES[1]}",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.net['h'].addr}:{STORE_PORT}",
            f"--rdzv-id=quarantine{self.seed}",
            "--max-restarts=100",
            f"--rdzv-conf=last_call_timeout=20,lease_ttl=2,join_timeout=120,"
            f"is_host={int(node == 'h')}",
            "--shutdown-timeout=5",
            f"--local-addr={self.net[node].addr}",
            f"--quarantine-time={QUARANTINE:g}",
        ]
        # Its name in the job (the namespaces share one host name), and the worker's.
        names = {"ELASTRUN_HOST_NAME": node, "ELASTIC_TEST_NODE": node}
        agent = start_in(self.j, self.net, node, name, flags, env_extra=names)
        self.live[node] = agent
        return agent

    def events(self, agent: Agent) -> list[dict[str, Any]]:
        path = self.j.dir / f"events-{agent.name}.jsonl"
        return read_log(path) if path.exists() else []

    def training(self) -> list[str]:
        return sorted(n for n, a in self.live.items() if workers_of(a))

    def available(self) -> int:
        alive = [n for n, a in self.live.items() if a.proc.poll() is None]
        return len([n for n in alive if n not in self.cut_off])

    def violations(self) -> list[str]:
        """The checker over the logs as they stand (tests/faults/quarantine_check.py)."""
        logs = {
            p.stem.removeprefix("events-"): read_log(p) for p in self.j.dir.glob("events-*.jsonl")
        }
        injected = self.j.dir / "injected.jsonl"
        return violations(
            logs,
            read_log(injected) if injected.exists() else [],
            limit=LIMIT,
            nnodes=NNODES,
            quarantine_time=QUARANTINE,
            hosts={a.name: a.name.split("-")[0] for a in self.j.agents},
        )

    def fail(self, what: str) -> AssertionError:
        """The failure, with the seed, the faults so far and what the checker
        finds in the logs so far (whatever failed first)."""
        found = "\n".join(self.violations()) or "none"
        return AssertionError(
            f"seed {self.seed}, faults {self.log}: {what}\nthe checker: {found}\n{diag(self.j)}"
        )

    def trains(self, what: str, old: set[int]) -> None:
        """Until STEPS rank-0 steps of new workers at the full world the
        nodes alive allow."""
        world = min(NNODES[1], self.available())
        mark = len(self.j.steps())

        def done() -> bool:
            fresh = [
                s
                for s in self.j.steps()[mark:]
                if s["rank"] == 0 and s["world"] == world and s["pid"] not in old
            ]
            return len(fresh) >= STEPS

        try:
            wait_for(done, BOUND, f"{what}: training at world {world}")
        except AssertionError as e:
            raise self.fail(str(e)) from None

    def pids(self) -> set[int]:
        return {int(s["pid"]) for s in self.j.steps()}

    # -- the faults ------------------------------------------------------
    def crash(self, node: str, how: str) -> None:
        """The worker on ``node`` fails at its next step; training again after."""
        old = self.pids()
        tmp = self.j.dir / f".crash_node_{node}.tmp"
        tmp.write_text(how)
        os.replace(tmp, self.j.dir / f"crash_node_{node}")
        self.trains(f"after crash of {node} ({how})", old)

    def node_fault(self, node: str, number: int) -> None:
        agent = self.live[node]
        self.crash(node, f"raise CUDA error: uncorrectable ECC error ({number}.1)")
        if node not in self.training():
            self.log.append(f"  ({node} waits as a spare after its first failure)")
            return
        # It leaves only where the job goes on without it: the others are
        # still the minimum, or a spare is there (a live node not training).
        others = len(self.training()) - 1
        spare = any(
            n not in self.training() and n not in self.cut_off and a.proc.poll() is None
            for n, a in self.live.items()
        )
        old = self.pids()
        tmp = self.j.dir / f".crash_node_{node}.tmp"
        tmp.write_text(f"raise CUDA error: uncorrectable ECC error ({number}.2)")
        os.replace(tmp, self.j.dir / f"crash_node_{node}")
        if others < NNODES[0] and not spare:
            stays = "not excluded: the job would fall below --nnodes min 2 with no spare"
            wait_for(lambda: stays in agent.output(), BOUND, f"{node} staying")
            self.log.append(f"  ({node} stays: the job could not go on without it)")
            self.trains(f"after {node} stayed", old)
            return
        code = wait_exit(self.j, agent, BOUND)
        out = agent.output()
        if code != 1 or f"this node ({node}) leaves the job, quarantined until" not in out:
            raise self.fail(f"{node} not quarantined after 2 failures (exit {code})")
        (ev,) = [e for e in self.events(agent) if e["kind"] == "node_quarantined"]
        self.quarantined[node] = ev["until"]
        del self.live[node]
        self.trains(f"after {node} was quarantined", old)

    def cut(self, node: str) -> None:
        """``node`` cut off past its lease, then healed: it registers again
        (it waits as a spare, or the job grows back onto it)."""
        old = self.pids()
        agent = self.live[node]
        self.net.cut(node)
        self.cut_off.add(node)
        self.trains(f"while {node} is cut off", old)
        time.sleep(2.5)  # past the lease (2 s): it lost its place
        self.net.heal(node)
        self.cut_off.discard(node)
        healed = time.time()

        def back() -> bool:
            said = ("node_waiting", "round_joined")
            again = [e for e in self.events(agent) if e["kind"] in said and e["ts"] > healed]
            return agent.proc.poll() is not None or bool(again)

        wait_for(back, BOUND, f"{node} back after the heal")
        if agent.proc.poll() is not None:
            self.log.append(f"  ({node} exited {agent.proc.returncode} after the heal: restarted)")
            self.start(node)

    def one(self, number: int, rng: random.Random, kind: str) -> None:
        began = time.monotonic()
        self.act(number, rng, kind)
        self.log[-1] += f" ({time.monotonic() - began:.1f} s)"
        print(self.log[-1], flush=True)

    def act(self, number: int, rng: random.Random, kind: str) -> None:
        training = [n for n in self.training() if n in POOL]
        if kind == "node_fault" and training:
            node = rng.choice(training)
            self.log.append(f"{number}: node_fault {node}")
            self.node_fault(node, number)
        elif kind == "pair" and len(self.training()) >= 2:
            x, y = rng.sample(self.training(), 2)
            self.log.append(f"{number}: pair {x} {y}")
            code = next(self.codes)  # one class for both: a failure moving between nodes
            self.crash(x, f"exit {code}")
            if y in self.training():
                self.crash(y, f"exit {code}")
        elif kind == "cut" and training and self.available() > NNODES[0]:
            node = rng.choice(training)
            self.log.append(f"{number}: cut {node}")
            self.cut(node)
        else:
            # Between rounds no node has workers for a moment: wait for one that does.
            node = rng.choice(wait_for(self.training, BOUND, "a training node to crash"))
            self.log.append(f"{number}: crash {node}")
            self.crash(node, f"exit {next(self.codes)}")

    def come_back(self) -> None:
        """Each quarantined node's agent started again: refused while its
        quarantine lasts (then started again once it expired); let in once
        it expired (it waits as a spare or trains). Which of the two comes
        first depends on how fast the agent starts: the checker holds both
        to the record's ``until``."""
        for node, until in self.quarantined.items():
            for _ in range(2):
                agent = self.start(node)

                def settled(agent: Agent = agent) -> bool:
                    kinds = {e["kind"] for e in self.events(agent)}
                    in_job = bool({"node_waiting", "round_joined"} & kinds)
                    return agent.proc.poll() is not None or in_job

                wait_for(settled, BOUND, f"{node} started again after its quarantine")
                if agent.proc.poll() is None:
                    self.log.append(f"{node} let in again after its quarantine")
                    break
                refused = [e for e in self.events(agent) if e["kind"] == "quarantine_refused"]
                if agent.proc.returncode != 1 or not refused:
                    raise self.fail(f"{node} exited {agent.proc.returncode}, not refused")
                self.log.append(f"{node} refused while quarantined")
                del self.live[node]
                time.sleep(max(0.0, until - time.time()))
            else:
                raise self.fail(f"{node} refused after its quarantine expired")


def draw(rng: random.Random, count: int) -> list[str]:
    """The series' kinds: at least one node fault, at most three (a third,
    the job at its minimum of two with no spare, stays), the rest crashes,
    pairs and cuts."""
    kinds = ["node_fault"]
    for _ in range(count - 1):
        kinds.append(rng.choice(["crash", "pair", "cut", "node_fault"]))
    while kinds.count("node_fault") > 3:
        kinds[kinds.index("node_fault", 1)] = "crash"
    rng.shuffle(kinds)
    return kinds


@pytest.mark.netns
def test_random_faults_quarantine_only_what_the_rule_allows(
    tmp_path: Path,
    netns: Callable[[list[str]], Network],  # noqa: F811 (the fixture imported above)
) -> None:
    chosen = os.environ.get("ELASTRUN_QUARANTINE_SEED")
    seed = int(chosen) if chosen else random.SystemRandom().randrange(2**31)
    count = int(os.environ.get("ELASTRUN_QUARANTINE_FAULTS") or soak_or(3, 8))
    print(f"quarantine: seed {seed}, {count} faults (replay: ELASTRUN_QUARANTINE_SEED={seed})")
    rng = random.Random(seed)
    net = netns(list(NODES))
    with job(tmp_path) as j:
        series = Series(j, net, seed)
        for node in NODES:
            series.start(node)
        series.trains("the first round", set())
        for number, kind in enumerate(draw(rng, count), start=1):
            series.one(number, rng, kind)
        series.come_back()
        print("quarantine series:\n  " + "\n  ".join(series.log))

        j.touch("finish")
        for agent in list(series.live.values()):
            code = wait_exit(j, agent, BOUND)
            if code != 0:
                raise series.fail(f"{agent.name} exited {code} at the end")
        assert_no_workers(j, bound=15.0)
        if series.violations():
            raise series.fail("the checker found violations")
        logs = {p.stem.removeprefix("events-"): read_log(p) for p in j.dir.glob("events-*.jsonl")}
        kinds = [e["kind"] for evs in logs.values() for e in evs]
        assert kinds.count("node_quarantined") == len(series.quarantined), series.log
    assert_namespaces_empty(net)


def _ev(kind: str, ts: float, **fields: Any) -> dict[str, Any]:
    return {"kind": kind, "ts": ts, **fields}


def _failure(host: str, pid: int, kind: str = "error", role: str = "root_cause") -> dict[str, Any]:
    return {"host": host, "pid": pid, "kind": kind, "role": role, "message": "RuntimeError: x"}


def test_the_checker_sees_a_healthy_node_quarantined_for_a_collateral_failure() -> None:
    """The checker itself: n2 quarantined on rounds whose root cause was n1's
    crash (n2's collective broke) must fail; the same logs with the rounds'
    root cause n2's own injected failures must pass."""
    injected = [{"node": "n1", "pid": 11}, {"node": "n2", "pid": 21}, {"node": "n2", "pid": 22}]

    def logs(cause2: dict[str, Any], cause3: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
        verdict = {
            "round": 3, "verdict": "node_fault", "node": "n2", "rounds": [2, 3],
            "action": "quarantine",
        }  # fmt: skip
        return {
            "h": [
                _ev("round_closed", 1.0, round=2, members=["h", "n1", "n2"]),
                _ev("restart", 2.0, round=2, failure=cause2),
                _ev("restart", 3.0, round=3, failure=cause3),
            ],
            "n2": [
                _ev("restart", 2.0, round=2, failure=cause2),
                _ev("fault_verdict", 3.0, **verdict),
                _ev("node_quarantined", 3.0, quarantined_host="n2", until=3.0 + QUARANTINE),
                _ev("job_failed", 3.0, failure=cause3),
            ],
        }

    def check(cause2: dict[str, Any], cause3: dict[str, Any]) -> list[str]:
        return violations(
            logs(cause2, cause3),
            injected,
            limit=2,
            nnodes=(2, 3),
            quarantine_time=QUARANTINE,
            hosts={"h": "h", "n2": "n2"},
        )

    collateral = _failure("n2", 99, kind="broken_collective", role="collateral")
    assert any("collateral" in v or "not n2's" in v for v in check(_failure("n1", 11), collateral))
    assert any("not n2's" in v for v in check(_failure("n1", 11), _failure("n2", 22)))
    assert any("no injection" in v for v in check(_failure("n2", 98), _failure("n2", 22)))
    assert check(_failure("n2", 21), _failure("n2", 22)) == []
    restarted = logs(_failure("n2", 21), _failure("n2", 22))
    restarted["n2-again"] = [_ev("node_waiting", 4.0, round=4)]
    found = violations(
        restarted,
        injected,
        limit=2,
        nnodes=(2, 3),
        quarantine_time=QUARANTINE,
        hosts={"n2-again": "n2"},
    )
    assert any("node_waiting while n2 is quarantined" in v for v in found), found


def test_the_checker_bounds_quarantines_by_the_injections() -> None:
    """Two quarantines of n2 with only two injected failures: one too many."""
    cause = [_failure("n2", 21), _failure("n2", 22)]
    events: list[dict[str, Any]] = []
    for first in (2, 5):
        verdict = {"verdict": "node_fault", "node": "n2", "action": "quarantine"}
        events += [
            _ev("restart", first, round=first, failure=cause[0]),
            _ev("fault_verdict", first + 1, round=first + 1, rounds=[first, first + 1], **verdict),
            _ev("node_quarantined", first + 1, quarantined_host="n2", until=first + 1 + QUARANTINE),
            _ev("job_failed", first + 1, failure=cause[1]),
        ]
    injected = [{"node": "n2", "pid": 21}, {"node": "n2", "pid": 22}]
    found = violations(
        {"n2": events}, injected, limit=2, nnodes=(2, 3), quarantine_time=QUARANTINE, hosts={}
    )
    assert any("quarantined 2 times, its injections allow 1" in v for v in found), found


def test_the_checker_sees_an_exclusion_below_the_minimum_without_a_spare() -> None:
    """n2 quarantined out of a round of two (--nnodes=2:3) with no node
    waiting: a violation; with n3 waiting as a spare then: none; n2 staying
    where the others were still the minimum: a violation too."""
    injected = [{"node": "n2", "pid": 21}, {"node": "n2", "pid": 22}]
    cause = [_failure("n2", 21), _failure("n2", 22)]

    def logs(action: str, members: list[str], spare: bool) -> dict[str, list[dict[str, Any]]]:
        verdict = {
            "round": 3, "verdict": "node_fault", "node": "n2", "rounds": [2, 3], "action": action,
        }  # fmt: skip
        n2 = [
            _ev("round_joined", 1.5, round=3, members=len(members)),
            _ev("restart", 2.0, round=2, failure=cause[0]),
            _ev("fault_verdict", 3.0, **verdict),
        ]
        if action == "quarantine":
            n2 += [
                _ev("node_quarantined", 3.0, quarantined_host="n2", until=3.0 + QUARANTINE),
                _ev("job_failed", 3.0, failure=cause[1]),
            ]
        else:  # it stays: restarts with the others
            n2.append(_ev("restart", 3.5, round=3, failure=cause[1]))
        out = {
            "h": [
                _ev("round_closed", 1.0, round=2, members=members),
                _ev("restart", 2.0, round=2, failure=cause[0]),
            ],
            "n2": n2,
        }
        if spare:
            out["n3"] = [_ev("workers_started", 0.5), _ev("node_waiting", 2.5, round=4)]
        return out

    def check(action: str, members: list[str], spare: bool) -> list[str]:
        return violations(
            logs(action, members, spare),
            injected,
            limit=2,
            nnodes=(2, 3),
            quarantine_time=QUARANTINE,
            hosts={"h": "h", "n2": "n2", "n3": "n3"},
        )

    found = check("quarantine", ["h", "n2"], spare=False)
    assert any("excluded below --nnodes min 2 with no spare" in v for v in found), found
    assert check("quarantine", ["h", "n2"], spare=True) == []
    assert check("quarantine", ["h", "n1", "n2"], spare=False) == []
    assert check("stays", ["h", "n2"], spare=False) == []
    found = check("stays", ["h", "n1", "n2"], spare=False)
    assert any("n2 stayed though 2 others remain" in v for v in found), found
