"""End to end: real agents, real gloo workers, a real store, on loopback.

The scenario of the agent issue: two agents train; a third joins and training
continues at world 3; the third is SIGKILLed with its workers and the
survivors continue at world 2; a worker crash consumes a restart; the job
finishes with every checkpointed step kept and no worker left alive.
"""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path

from tests.helpers import free_port, pid_alive, wait_for
from tests.integration.elastic_harness import (
    BOUND,
    check_finished,
    job,
    join_loss_and_crash,
    steps_after,
)


def c10d_flags(port: int, *, host: bool, nnodes: str = "1:3", max_restarts: int = 3) -> list[str]:
    return [
        f"--nnodes={nnodes}",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=e2e",
        f"--max-restarts={max_restarts}",
        f"--rdzv-conf=last_call_timeout=1,lease_ttl=2,join_timeout=60,is_host={int(host)}",
        "--shutdown-timeout=5",
    ]


def test_join_loss_and_crash_on_embedded_store(tmp_path: Path) -> None:
    port = free_port()
    with job(tmp_path) as j:
        join_loss_and_crash(j, tmp_path, lambda name: c10d_flags(port, host=name == "a"))


def test_every_node_prints_what_failed_then_a_crash_without_restarts_names_root_cause(
    tmp_path: Path,
) -> None:
    """A worker crashes on one node: the other node's agent prints the same
    one-line reason (rank, host, exit code), whether its own rank was fine or
    failed when its all-reduce broke (then in a summary that names the other
    node's rank as the root cause). Then it crashes again with no restart
    left: both agents exit non-zero, the crashed rank's node names it the root
    cause and the other node's rank, whose all-reduce broke, is never named the
    root cause, even when it failed before its agent heard of the restart; no
    worker is left. (That the job finishes after a restart, every agent
    exiting 0: test_join_loss_and_crash_on_embedded_store.)"""
    port = free_port()
    with job(tmp_path) as j:
        a = j.start_agent("a", c10d_flags(port, host=True, nnodes="2", max_restarts=1))
        b = j.start_agent("b", c10d_flags(port, host=False, nnodes="2", max_restarts=1))
        wait_for(lambda: any(s["world"] == 2 for s in j.steps()), BOUND, "training at world 2")
        mark = len(j.steps())
        j.touch("crash_rank_1")
        wait_for(lambda: steps_after(j, mark, lambda s: s["restart"] == 1), BOUND, "restart 1")
        # what each agent said of the first crash (both printed it before their
        # workers of restart 1 started)
        first = {x.name: x.output() for x in (a, b)}
        j.touch("crash_rank_1")
        codes = (a.wait(BOUND), b.wait(BOUND))
        assert all(code != 0 for code in codes), codes
        out = a.output() + b.output()
        assert "[ROOT CAUSE] rank 1 " in out, out[-4000:]
        assert "[ROOT CAUSE] rank 0 " not in out, out[-4000:]
        assert not any(pid_alive(s["pid"]) for s in j.steps())
    crashed = [name for name, said in first.items() if "[ROOT CAUSE] rank 1 " in said]
    assert len(crashed) == 1, [said[-2000:] for said in first.values()]
    (other,) = set(first) - set(crashed)
    assert "[ROOT CAUSE] rank 0 " not in first[other], first[other][-3000:]
    line = (
        f"elastrun: restarting workers (restart 1/1): rank 1 on {socket.gethostname()} "
        "exited with code 1"
    )
    assert line in first[other], first[other][-3000:]


def test_store_host_loss_is_reported_within_read_timeout(tmp_path: Path) -> None:
    """The agent hosting the embedded store is SIGKILLed mid-training (the
    agent alone, not its group): its workers die with it. The other agent
    still has join_timeout=600 (only the first connection may take that long):
    every later store request is bounded by read_timeout, so it exits non-zero
    well within a minute, naming the store it lost, and leaves no worker."""
    port = free_port()
    conf = "last_call_timeout=1,lease_ttl=2,join_timeout=600,read_timeout=5"

    def flags(host: bool) -> list[str]:
        out = c10d_flags(port, host=host, nnodes="1:2")
        return [f for f in out if not f.startswith("--rdzv-conf")] + [
            f"--rdzv-conf={conf},is_host={int(host)}"
        ]

    with job(tmp_path) as j:
        a = j.start_agent("a", flags(True))
        b = j.start_agent("b", flags(False))
        wait_for(lambda: any(s["world"] == 2 for s in j.steps()), BOUND, "training at world 2")
        b_pids = {s["pid"] for s in j.steps() if s["world"] == 2 and s["group_rank"] == 1}
        a_pids = {s["pid"] for s in j.steps() if s["node"] == "a"}
        t = time.monotonic()
        a.proc.kill()  # the agent alone, not its group: workers must follow it
        a.proc.wait(10)
        wait_for(lambda: not any(pid_alive(p) for p in a_pids), 5, "workers to die with the agent")
        code = b.wait(45)
        took = time.monotonic() - t
        out = b.output()
        print(f"store host killed: the other agent exited {code} after {took:.1f}s")
        assert code != 0, out[-3000:]
        assert f"127.0.0.1:{port}" in out, out[-3000:]
        agent_lines = [ln for ln in out.splitlines() if not ln.startswith("[")]  # not workers'
        assert not any(ln.startswith("Traceback") for ln in agent_lines), out[-3000:]
        wait_for(lambda: not any(pid_alive(p) for p in b_pids), 10, "the other node's workers")


def test_a_node_stopped_with_sigterm_is_reported_as_leaving_not_lost(tmp_path: Path) -> None:
    """An agent stopped by SIGTERM leaves the job (its lease revoked on the way
    out): the survivor says the node left, never that its lease expired, and
    trains on at the smaller world."""
    port = free_port()
    with job(tmp_path) as j:
        a = j.start_agent("a", c10d_flags(port, host=True))
        b = j.start_agent("b", c10d_flags(port, host=False))
        wait_for(lambda: any(s["world"] == 2 for s in j.steps()), BOUND, "training at world 2")
        mark = len(j.steps())
        b.proc.send_signal(signal.SIGTERM)  # the agent only: it stops its workers and leaves
        assert b.wait(BOUND) == 128 + signal.SIGTERM, b.output()[-3000:]  # 128 + the signal
        wait_for(lambda: steps_after(j, mark, lambda s: s["world"] == 1), BOUND, "world 1")
        said = a.output()
        assert "left the job (its agent stopped)" in said, said[-3000:]
        assert "lost: lease expired or revoked" not in said, said[-3000:]
        check_finished(j, tmp_path, a)
