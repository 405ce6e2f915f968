"""Hot spares end to end: real agents, real gloo workers, the embedded store.

Three nodes with ``--nnodes=2:3 --node-unit=2``: two train, the third waits as
a spare (joined, its warm interpreter up, no worker). A training node's agent
is SIGKILLed: the spare takes its place at world 2 with the lost node's group
rank, the survivor keeps its own, training goes on from the checkpoint, and
the event logs record the promotion.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

from tests.helpers import free_port, pid_alive, wait_for
from tests.integration.elastic_harness import (
    BOUND,
    ELASTRUN,
    Job,
    check_finished,
    job,
    steps_after,
)


def spare_flags(port: int, name: str, j: Job, *, host: bool) -> list[str]:
    return [
        "--nnodes=2:3",
        "--node-unit=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=spares",
        "--max-restarts=3",
        f"--rdzv-conf=last_call_timeout=1,lease_ttl=2,join_timeout=60,is_host={int(host)}",
        "--shutdown-timeout=5",
        f"--events-file={j.dir / f'events-{name}.jsonl'}",
    ]


def kinds(j: Job, name: str, kind: str) -> list[dict[str, Any]]:
    return [e for e in j.events(name) if e["kind"] == kind]


def joined_id(j: Job, name: str) -> str:
    return str(kinds(j, name, "round_joined")[-1]["node_id"])


def status(port: int, *flags: str) -> str:
    """``elastrun status`` of the job, as an operator runs it."""
    proc = subprocess.run(
        [*ELASTRUN, "status", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=spares", *flags],
        capture_output=True,
        text=True,
        timeout=BOUND,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def status_json(port: int) -> dict[str, Any]:
    summary: dict[str, Any] = json.loads(status(port, "--json"))
    return summary


def test_a_killed_training_node_is_replaced_by_the_spare_with_its_rank(tmp_path: Path) -> None:
    port = free_port()
    with job(tmp_path) as j:
        a = j.start_agent("a", spare_flags(port, "a", j, host=True))  # hosts the store
        b = j.start_agent("b", spare_flags(port, "b", j, host=False))
        wait_for(lambda: any(s["world"] == 2 for s in j.steps()), BOUND, "training at world 2")
        s = j.start_agent("s", spare_flags(port, "s", j, host=False))
        wait_for(lambda: kinds(j, "s", "node_waiting"), BOUND, "the third node waits")
        waiting = kinds(j, "s", "node_waiting")[-1]
        assert waiting["spare"] is True and "spare" in str(waiting["reason"]), waiting
        wait_for(lambda: kinds(j, "s", "warm_ready"), BOUND, "the spare's warm interpreter")
        assert not any(st["node"] == "s" for st in j.steps()), "the spare trained"
        assert not kinds(j, "s", "workers_started")

        ranks = {st["node"]: st["group_rank"] for st in j.steps()}
        assert sorted(ranks) == ["a", "b"] and sorted(ranks.values()) == [0, 1]
        b_id = kinds(j, "b", "round_joined")[-1]["node_id"]
        s_id = kinds(j, "s", "node_waiting")[-1]["node_id"]
        before = status_json(port)
        assert before["state"] == "running" and before["node_unit"] == 2
        assert [w["node_id"] for w in before["spares"]] == [s_id], before
        assert len(before["members"]) == 2 and before["nodes_present"] == 3
        table = status(port)
        assert any(ln.startswith("spares: ") and s_id in ln for ln in table.splitlines()), table
        assert "node unit 2" in table and "1 spare;" in table, table
        b_pids = {st["pid"] for st in j.steps() if st["node"] == "b"}
        mark = len(j.steps())
        os.kill(b.proc.pid, signal.SIGKILL)  # the agent alone: its guard does the rest
        wait_for(  # each rank writes its step record on its own: wait for both
            lambda: (
                {"a", "s"}
                <= {st["node"] for st in steps_after(j, mark, lambda st: st["world"] == 2)}
            ),
            BOUND,
            "the spare and the survivor training at world 2",
        )
        assert b.wait(BOUND) == -signal.SIGKILL
        wait_for(lambda: not any(pid_alive(p) for p in b_pids), BOUND, "the lost node's workers")

        after = steps_after(j, mark, lambda st: st["world"] == 2 and st["node"] in ("a", "s"))
        by_node = {st["node"]: st["group_rank"] for st in after}
        assert by_node == {"a": ranks["a"], "s": ranks["b"]}, by_node
        promoted = kinds(j, "s", "spare_promoted")
        assert len(promoted) == 1, promoted
        assert promoted[0]["group_rank"] == ranks["b"] and promoted[0]["replaces"] == b_id
        said = f"this spare trains now, as group rank {ranks['b']}, in place of node {b_id},"
        assert said in s.output(), s.output()[-3000:]
        after_status = wait_for(
            lambda: (st := status_json(port))["state"] == "running" and st["round"] > 0 and st,
            BOUND,
            "status after the promotion",
        )
        assert after_status["spares"] == [], after_status
        members = {m["node_id"]: m["group_rank"] for m in after_status["members"]}
        assert members == {s_id: ranks["b"], joined_id(j, "a"): ranks["a"]}, after_status
        joined_a = kinds(j, "a", "round_joined")[-1]
        assert joined_a["group_rank"] == joined_a["previous_group_rank"] == ranks["a"]
        check_finished(j, tmp_path, a, s)


def test_a_node_with_another_node_unit_gets_the_config_mismatch(tmp_path: Path) -> None:
    port = free_port()
    with job(tmp_path) as j:
        a = j.start_agent("a", spare_flags(port, "a", j, host=True))
        wait_for(lambda: kinds(j, "a", "node_joined"), BOUND, "the first node joined")
        flags = [f for f in spare_flags(port, "b", j, host=False) if f != "--node-unit=2"]
        b = j.start_agent("b", flags)
        assert b.wait(BOUND) != 0
        assert "node_unit: job has 2, this node has 1" in b.output(), b.output()[-3000:]
        mismatch = kinds(j, "b", "config_mismatch")
        assert mismatch and "node_unit: job has 2, this node has 1" in str(mismatch[0]["fields"])
        assert a.proc.poll() is None  # the job goes on waiting for a second node
        assert not j.steps()
        # ... and the waiting node says why that second node will not come.
        said = wait_for(
            lambda: next(
                (ln for ln in a.output().splitlines() if "was refused by this job" in ln), None
            ),
            BOUND,
            "the waiting node to say that a peer was refused",
        )
        assert "node_unit: job has 2, this node has 1" in said, said


def test_an_impossible_policy_is_refused_before_joining(tmp_path: Path) -> None:
    port = free_port()
    with job(tmp_path) as j:
        flags = [f for f in spare_flags(port, "a", j, host=True) if f != "--node-unit=2"]
        a = j.start_agent("a", [*flags, "--node-unit=4"])
        assert a.wait(BOUND) != 0
        out = a.output()
        assert "--node-unit=4 is larger than the most nodes --nnodes=2:3 allows" in out, out
        assert not j.events("a") or not kinds(j, "a", "node_joined")
