"""The store's host cut off from the network, with candidate hosts
(docs/failover.md): real agents in network namespaces, real gloo workers.

The jobs run with ``--nnodes=1:N``: one node alone may train, so a host cut
off that kept serving its own store would train on alone. The fencing is what
stops it: these tests assert that no step is ever taken at world 1.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from tests.faults.netns import Network
from tests.faults.test_faults import (
    EXIT_BOUND,
    STORE_PORT,
    agent_traceback,
    assert_namespaces_empty,
    assert_no_workers,
    diag,
    event_timeline,
    netns,
    start_in,
    wait_exit,
    wait_steps,
)
from tests.integration.elastic_harness import Job, job

__all__ = ["netns"]  # the fixture, used by name

LEASE_TTL = 3  # the shortest with candidate hosts


def failover_flags(
    net: Network,
    node: str,
    *,
    nnodes: str,
    failover_timeout: int,
    candidates: tuple[str, ...] | None = None,
) -> list[str]:
    """An agent's flags; the candidate hosts: ``candidates`` (default every node)."""
    names = list(net.nodes) if candidates is None else candidates
    endpoint = ",".join(f"{net[n].addr}:{STORE_PORT}" for n in names)
    return [
        f"--nnodes={nnodes}",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        "--rdzv-id=failover-faults",
        "--max-restarts=3",
        f"--rdzv-conf=last_call_timeout=1,lease_ttl={LEASE_TTL},join_timeout=60,"
        f"failover_timeout={failover_timeout}",
        "--shutdown-timeout=5",
        f"--local-addr={net[node].addr}",
    ]


def never_alone(j: Job) -> None:
    alone = [s for s in j.steps() if s["world"] == 1]
    assert not alone, f"a node trained alone: {alone[:3]}\n{diag(j)}"


def test_a_cut_off_host_steps_down_the_others_train_on_and_it_rejoins_on_heal(
    tmp_path: Path, netns: Callable[[list[str]], Network]
) -> None:
    net = netns(["n1", "n2", "n3"])
    with job(tmp_path) as j:
        agents = {
            name: start_in(
                j, net, name, name, failover_flags(net, name, nnodes="1:3", failover_timeout=120)
            )
            for name in ("n1", "n2", "n3")
        }
        wait_steps(j, lambda s: s["world"] == 3, "training at world 3", count=3)
        assert "hosts the store from term 1" in agents["n1"].output(), diag(j)

        mark = len(j.steps())
        cut_at = time.time()
        net.cut("n1")
        took = wait_steps(
            j, lambda s: s["world"] == 2, "the others training at world 2", after=mark
        )
        print(f"host cut -> the others step at world 2: {took:.1f}s")
        print(event_timeline(j, cut_at, limit=40))
        out = agents["n1"].output()
        assert "stepped down as the store's host (term 1)" in out, diag(j)
        for name in ("n2", "n3"):
            assert f"the store's host is now {net['n2'].addr}" in agents[name].output(), diag(j)
        never_alone(j)

        mark = len(j.steps())
        net.heal("n1")
        took = wait_steps(j, lambda s: s["world"] == 3, "n1 back: world 3", after=mark, count=3)
        print(f"heal -> world 3 again: {took:.1f}s")
        never_alone(j)

        j.touch("finish")
        for agent in agents.values():
            assert wait_exit(j, agent) == 0, diag(j)
            assert agent_traceback(agent) is None, agent.output()[-3000:]
        assert_no_workers(j)
    assert_namespaces_empty(net)


def test_a_two_node_job_whose_host_is_cut_off_exits_naming_why(
    tmp_path: Path, netns: Callable[[list[str]], Network]
) -> None:
    net = netns(["n1", "n2"])
    timeout = 10
    with job(tmp_path) as j:
        agents = {
            name: start_in(
                j,
                net,
                name,
                name,
                failover_flags(net, name, nnodes="1:2", failover_timeout=timeout),
            )
            for name in ("n1", "n2")
        }
        wait_steps(j, lambda s: s["world"] == 2, "training at world 2", count=2)
        net.cut("n1")
        for name, says in (("n1", "stepped down"), ("n2", "majority (2 of 2)")):
            agent = agents[name]
            assert wait_exit(j, agent, EXIT_BOUND + timeout) != 0, diag(j)
            out = agent.output()
            assert says in out, f"{name}:\n{out[-3000:]}"
            assert "no candidate took over" in out, f"{name}:\n{out[-3000:]}"
            assert agent_traceback(agent) is None, out[-3000:]
        never_alone(j)
        assert_no_workers(j)
    assert_namespaces_empty(net)
