"""A training node cut off past its lease rejoins the job when its link heals.

One job, three agents in network namespaces (``h`` hosts the embedded store),
``--nnodes=2:3 --node-unit=2``: two train, one waits as a spare. The scenarios
follow one another in it (one job, not one each: each agent's warm interpreter
costs a torch import):

1. The link of the training node that is not the store's host is cut (packets
   dropped) for longer than the lease TTL: the spare takes its place, and the
   cut node's agent stops its workers when it sees its lease lost. When the
   link heals (within ``join_timeout``), that agent registers again and waits
   as a spare: it does not exit, and none of its old workers ever steps again.
2. The node that now trains beside ``h`` is cut for good: the spare (the node
   healed in 1) takes its place; past ``join_timeout`` the cut node exits 1
   naming the store and the timeout.
3. No spare is left: the training node beside ``h`` is cut past its lease;
   the survivor waits (below the smallest allowed size); healed, the cut node
   registers again and rejoins as a member (world 2 again, new workers only).

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
from tests.integration.elastic_harness import Agent, job

CUT_FOR = 7.0  # s: past the lease TTL (2 s) and a first try to register again
# The job's rejoin window: a cut of CUT_FOR heals well within it (the window
# counts from the lease's loss), a cut never healed ends the node past it.
JOIN_TIMEOUT = 25


def _three(run: Run) -> str:
    """Start h, n1, n2; return the node that trains beside h."""
    for node in ("h", "n1", "n2"):
        run.start(node)
        if node == "n1":
            run.wait_world(0, set(), "training at world 2", count=1)
    wait_for(lambda: run.ready_spares() == ["n2"], BOUND, "n2 waiting as a spare")
    return "n1"


def _replaced_by_the_spare(run: Run, node: str) -> tuple[Agent, set[int], float]:
    """Cut ``node`` (training) off; the spare trains in its place and its own
    agent stops its workers. Its agent, those workers and when the cut began."""
    cut_agent = run.live[node]
    old = workers_of(cut_agent)
    mark, before = len(run.j.steps()), run.steps_pids()
    since = run.cut(node)
    run.wait_world(mark, before, f"the spare training while {node} is cut off")
    wait_dead(old, BOUND, f"the cut node {node}'s workers to be stopped by its agent")
    return cut_agent, old, since


def _rejoins_as_a_spare(run: Run, node: str) -> None:
    """Scenario 1: ``node`` (training) cut past its lease, then healed."""
    j = run.j
    cut_agent, old, since = _replaced_by_the_spare(run, node)
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
    rejoined = [
        e for e in run.events(cut_agent.name) if e["kind"] == "lease_regained" and e["ts"] > since
    ]
    assert rejoined, f"no lease_regained in {cut_agent.name}'s event log"
    print(f"registered again after {rejoined[0]['tries']} tries, {rejoined[0]['after_s']:.1f}s")


def _gives_up_past_join_timeout(run: Run, node: str) -> None:
    """Scenario 2: ``node`` (training) cut for good: the spare trains in its
    place, and ``node`` exits 1 naming the store and the timeout."""
    j = run.j
    cut_agent, _, since = _replaced_by_the_spare(run, node)
    code = wait_exit(j, cut_agent, JOIN_TIMEOUT + BOUND)
    out = cut_agent.output()
    assert code == 1, out[-2000:]
    assert "unreachable" in out and f"join_timeout={JOIN_TIMEOUT}" in out, out[-2000:]
    # For the checker: cut off from then on (it never healed; its agent is gone).
    run.faults.cut.setdefault(cut_agent.name, []).append((since, time.time()))
    run.prune()


def _rejoins_as_a_member(run: Run, node: str) -> None:
    """Scenario 3, no spare left: the survivor waits (below the smallest
    allowed size); ``node``, cut past its lease and healed, registers again
    and the world is 2 again, with new workers only."""
    j = run.j
    cut_agent = run.live[node]
    old = workers_of(cut_agent)
    since = run.cut(node)
    wait_dead(old, BOUND, "the cut node's workers to be stopped by its agent")
    time.sleep(max(0.0, since + CUT_FOR - time.time()))
    mark, before = len(j.steps()), run.steps_pids()
    healed = run.heal(node, since)
    run.wait_world(mark, before, "training at world 2 again with the healed node")
    fresh = {int(s["pid"]) for s in j.steps()[mark:]}
    assert not fresh & old, f"an old worker of the cut node stepped again: {fresh & old}"
    assert set(workers_of(cut_agent)) & fresh, "the healed node does not train"
    regained = [
        e for e in run.events(cut_agent.name) if e["kind"] == "lease_regained" and e["ts"] > since
    ]
    assert regained and regained[0]["ts"] > healed - 1.0, regained


@pytest.mark.netns
def test_a_cut_node_rejoins_as_a_spare_or_a_member_when_healed_and_exits_past_join_timeout(
    tmp_path: Path,
    netns: Callable[[list[str]], Network],  # noqa: F811 (the fixture imported above)
) -> None:
    net = netns(["h", "n1", "n2"])
    with job(tmp_path) as j:
        run = Run(j, net, 0, join_timeout=JOIN_TIMEOUT)
        first = _three(run)  # n1 trains beside h, n2 is the spare
        _rejoins_as_a_spare(run, first)
        second = next(n for n in run.training() if n != "h")
        assert second != first, run.training()
        _gives_up_past_join_timeout(run, second)
        # The node healed in scenario 1 took its place: no spare is left.
        wait_for(
            lambda: first in run.training() and not run.ready_spares(),
            BOUND,
            f"{first} training, no spare left",
        )
        _rejoins_as_a_member(run, first)

        j.touch("finish")
        for agent in list(run.live.values()):
            assert wait_exit(j, agent, BOUND) == 0, f"{agent.name}\n{diag(j)}"
        logs = {p.stem.removeprefix("events-"): read_log(p) for p in j.dir.glob("events-*.jsonl")}
        assert not violations(logs, run.faults, {2}), violations(logs, run.faults, {2})
        assert_no_workers(j)
        assert_namespaces_empty(net)
