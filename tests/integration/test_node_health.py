"""``--health-check`` end to end: real agents on loopback, real gloo workers,
real check commands. A node whose check fails does not join the job (the
others train on, unchanged); a node whose check starts failing while it
trains leaves at the next round boundary, and a waiting spare takes its
place; ``elastrun status`` names both nodes, when and why."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.helpers import free_port, wait_for
from tests.integration.elastic_harness import (
    BOUND,
    ELASTRUN,
    Job,
    job,
    node_name,
    steps_after,
)


def flags(port: int, j: Job, name: str, *, host: bool, extra: list[str]) -> list[str]:
    return [
        "--nnodes=1:2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=health",
        "--max-restarts=3",
        f"--rdzv-conf=last_call_timeout=1,lease_ttl=2,join_timeout=60,is_host={int(host)}",
        "--shutdown-timeout=5",
        f"--events-file={j.dir / f'events-{name}.jsonl'}",
        *extra,
    ]


def test_a_failing_health_check_keeps_the_node_out_and_a_sick_node_leaves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ELASTIC_STEP_SLEEP", "0.1")
    port = free_port()
    with job(tmp_path) as j:
        a = j.start_agent("a", flags(port, j, "a", host=True, extra=[]), env_extra=node_name("a"))
        wait_for(lambda: any(s["node"] == "a" for s in j.steps()), BOUND, "node a training")

        bad = "--health-check=sh -c 'echo GPU 0 has fallen off the bus; exit 7'"
        c = j.start_agent(
            "c", flags(port, j, "c", host=False, extra=[bad]), env_extra=node_name("c")
        )
        assert c.wait(BOUND) == 1, c.output()[-3000:]
        said = (
            "the health check `sh -c echo GPU 0 has fallen off the bus; exit 7` exited with "
            "code 7: GPU 0 has fallen off the bus; this node does not join the job"
        )
        assert said in c.output(), c.output()[-3000:]
        assert not j.kinds("c", "node_joined")
        (failed,) = j.kinds("c", "node_health_failed")
        assert failed["when"] == "before_round" and failed["reason"] == "exited with code 7"
        assert len(j.kinds("a", "workers_started")) == 1  # a's round never re-formed

        sick = tmp_path / "sick_b"
        watch = [f"--health-check=test ! -e {sick}", "--health-check-interval=1"]
        b = j.start_agent(
            "b", flags(port, j, "b", host=False, extra=watch), env_extra=node_name("b")
        )
        wait_for(
            lambda: any(s["node"] == "b" and s["world"] == 2 for s in j.steps()),
            BOUND,
            "node b training at world 2",
        )
        # A hot spare: the world is at its max (2), so it waits.
        s = j.start_agent("s", flags(port, j, "s", host=False, extra=[]), env_extra=node_name("s"))
        wait_for(lambda: j.kinds("s", "node_waiting"), BOUND, "the spare waiting")
        sick.write_text("")
        wait_for(
            lambda: "this node leaves the job when this round ends" in b.output(),
            BOUND,
            "node b's check failing while it trains",
        )
        assert j.kinds("b", "node_health_failed")[-1]["when"] == "training"
        mark = len(j.steps())
        old = {s["pid"] for s in j.steps()}
        j.touch("crash_rank_0")  # a round boundary
        assert b.wait(BOUND) == 1, b.output()[-3000:]
        assert "this node does not join the job" in b.output()
        wait_for(
            # The spare replaces b: a and s train at world 2 again.
            lambda: (
                {"a", "s"}
                <= {
                    st["node"]
                    for st in steps_after(
                        j, mark, lambda st: st["world"] == 2 and st["pid"] not in old
                    )
                }
            ),
            BOUND,
            "the spare training in b's place",
        )
        # elastrun status names both nodes whose check failed, when, and why.
        table = status(port)
        assert table.returncode == 0, table.stderr
        lines = table.stdout.splitlines()
        (c_line,) = [ln for ln in lines if ln.startswith("health    node c ")]
        assert "failed its health check before joining at " in c_line, c_line
        assert c_line.endswith(": exited with code 7: GPU 0 has fallen off the bus"), c_line
        (b_line,) = [ln for ln in lines if ln.startswith("health    node b ")]
        assert "failed its health check while training at " in b_line, b_line
        assert b_line.endswith(": exited with code 1"), b_line
        # (--json's health_failures: tests/unit/test_attribution_act.py)
        j.touch("finish")
        for agent in (a, s):
            assert agent.wait(BOUND) == 0, agent.output()[-3000:]


def status(port: int, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*ELASTRUN, "status", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=health", *extra],
        capture_output=True,
        text=True,
        timeout=BOUND,
        check=False,
    )
