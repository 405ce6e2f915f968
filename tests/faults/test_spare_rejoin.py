"""A training node cut off past its lease rejoins the job when its link heals.

Three agents in network namespaces (``h`` hosts the embedded store) run
``--nnodes=2:3 --node-unit=2``: two train, one waits as a spare. The link of
the training node that is not the store's host is cut (packets dropped) for
longer than the lease TTL: the spare takes its place, and the cut node's agent
stops its workers when it sees its lease lost. When the link heals (within
``join_timeout``), that agent registers again and waits as a spare: it does
not exit, and none of its old workers ever steps again. Without a spare (two
nodes), the survivor waits and the healed node rejoins as a member. Cut for longer than
``join_timeout`` instead, it exits 1 naming the store and the timeout.
The checker (tests/faults/spares_check.py) reads every agent's event log.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.faults.netns import Network
from tests.faults.spares_check import violations
from tests.faults.test_faults import (
    BOUND,
    assert_namespaces_empty,
    assert_no_workers,
    diag,
    netns,  # noqa: F401 (the fixture)
    wait_dead,
    wait_exit,
    workers_of,
)
from tests.faults.test_spares_faults import Run, read_log
from tests.helpers import wait_for
from tests.integration.elastic_harness import job

CUT_FOR = 7.0  # s: past the lease TTL (2 s) and a first try to register again
SHORT_JOIN_TIMEOUT = 12  # s: the cut node's rejoin window in the give-up test


def _three(run: Run) -> str:
    """Start h, n1, n2; return the node that trains beside h."""
    for node in ("h", "n1", "n2"):
        run.start(node)
        if node == "n1":
            run.wait_world(0, set(), "training at world 2", count=1)
    wait_for(lambda: run.ready_spares() == ["n2"], BOUND, "n2 waiting as a spare")
    return "n1"


@pytest.mark.netns
def test_a_training_node_cut_past_its_lease_rejoins_as_a_spare_when_healed(
    tmp_path: Path,
    netns: Callable[[list[str]], Network],  # noqa: F811 (the fixture imported above)
) -> None:
    net = netns(["h", "n1", "n2"])
    with job(tmp_path) as j:
        run = Run(j, net, 0)
        node = _three(run)
        cut_agent = run.live[node]
        old = workers_of(cut_agent)
        mark, before = len(j.steps()), run.steps_pids()
        since = run.cut(node)
        run.wait_world(mark, before, f"the spare training while {node} is cut off")
        wait_dead(old, BOUND, f"the cut node {node}'s workers to be stopped by its agent")
        time.sleep(max(0.0, since + CUT_FOR - time.time()))
        healed = run.heal(node, since)
        run.settle_cut(node, healed)
        assert cut_agent.proc.poll() is None, f"{node} exited after the heal:\n{diag(j)}"
        said = [ln for ln in cut_agent.output().splitlines() if ln.startswith("elastrun:")]
        print("the cut node said:\n  " + "\n  ".join(said[-6:]))
        mark = len(j.steps())
        run.wait_world(mark, set(), "training goes on after the heal")
        stale = {int(s["pid"]) for s in j.steps() if s["t"] > healed} & old
        assert not stale, f"an old worker of the cut node stepped after the heal: {stale}"

        j.touch("finish")
        for agent in list(run.live.values()):
            assert wait_exit(j, agent, BOUND) == 0, f"{agent.name}\n{diag(j)}"
        logs = {p.stem.removeprefix("events-"): read_log(p) for p in j.dir.glob("events-*.jsonl")}
        assert not violations(logs, run.faults, {2}), violations(logs, run.faults, {2})
        rejoined = [
            e for e in logs[cut_agent.name] if e["kind"] == "lease_regained" and e["ts"] > since
        ]
        assert rejoined, f"no lease_regained in {cut_agent.name}'s event log"
        print(f"registered again after {rejoined[0]['tries']} tries, {rejoined[0]['after_s']:.1f}s")
        assert_no_workers(j)
        assert_namespaces_empty(net)


@pytest.mark.netns
def test_without_a_spare_the_healed_node_rejoins_as_a_member(
    tmp_path: Path,
    netns: Callable[[list[str]], Network],  # noqa: F811 (the fixture imported above)
) -> None:
    """Two nodes, no spare: the survivor waits (below the smallest allowed
    size); the cut node, healed, registers again and the world is 2 again."""
    net = netns(["h", "n1"])
    with job(tmp_path) as j:
        run = Run(j, net, 0)
        run.start("h")
        run.start("n1")
        run.wait_world(0, set(), "training at world 2", count=1)
        cut_agent = run.live["n1"]
        old = workers_of(cut_agent)
        since = run.cut("n1")
        wait_dead(old, BOUND, "the cut node's workers to be stopped by its agent")
        time.sleep(max(0.0, since + CUT_FOR - time.time()))
        mark, before = len(j.steps()), run.steps_pids()
        healed = run.heal("n1", since)
        run.wait_world(mark, before, "training at world 2 again with the healed node")
        fresh = {int(s["pid"]) for s in j.steps()[mark:]}
        assert not fresh & old, f"an old worker of the cut node stepped again: {fresh & old}"
        assert set(workers_of(cut_agent)) & fresh, "the healed node does not train"
        j.touch("finish")
        for agent in list(run.live.values()):
            assert wait_exit(j, agent, BOUND) == 0, f"{agent.name}\n{diag(j)}"
        logs = {p.stem.removeprefix("events-"): read_log(p) for p in j.dir.glob("events-*.jsonl")}
        assert not violations(logs, run.faults, {2}), violations(logs, run.faults, {2})
        regained = [e for e in logs[cut_agent.name] if e["kind"] == "lease_regained"]
        assert regained and regained[0]["ts"] > healed - 1.0, regained
        assert_no_workers(j)
        assert_namespaces_empty(net)


@pytest.mark.netns
def test_a_node_cut_past_join_timeout_exits_naming_the_store_and_the_timeout(
    tmp_path: Path,
    netns: Callable[[list[str]], Network],  # noqa: F811 (the fixture imported above)
) -> None:
    net = netns(["h", "n1", "n2"])
    with job(tmp_path) as j:
        run = Run(j, net, 0, join_timeout=SHORT_JOIN_TIMEOUT)
        node = _three(run)
        cut_agent = run.live[node]
        old = workers_of(cut_agent)
        mark, before = len(j.steps()), run.steps_pids()
        run.cut(node)
        run.wait_world(mark, before, f"the spare training while {node} is cut off")
        wait_dead(old, BOUND, f"the cut node {node}'s workers to be stopped by its agent")
        code = wait_exit(j, cut_agent, SHORT_JOIN_TIMEOUT + BOUND)
        out = cut_agent.output()
        assert code == 1, out[-2000:]
        assert "unreachable" in out and f"join_timeout={SHORT_JOIN_TIMEOUT}" in out, out[-2000:]
        run.prune()
        j.touch("finish")
        for agent in list(run.live.values()):
            assert wait_exit(j, agent, BOUND) == 0, f"{agent.name}\n{diag(j)}"
        assert_no_workers(j)
