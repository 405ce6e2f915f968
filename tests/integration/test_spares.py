"""Hot spares end to end: real agents, real gloo workers, the embedded store.

Nodes with ``--nnodes=2:3 --node-unit=2``: two train, a third waits as a spare
(joined, its warm interpreter up, no worker). In one job (each agent's warm
interpreter costs a torch import), in turn:

* ``--health-check``: a node whose check fails does not join the job (the
  others train on, unchanged); a training node whose check starts failing
  leaves at the next round boundary, and the waiting spare takes its place;
  ``elastrun status`` names both nodes, when and why.
* A training node's agent is SIGKILLed: a second spare takes its place at
  world 2 with the lost node's group rank, the survivor keeps its own,
  training goes on from the checkpoint, and the event logs record the
  promotion.
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
    Agent,
    Job,
    check_finished,
    job,
    node_name,
    steps_after,
)


def spare_flags(
    port: int, name: str, j: Job, *, host: bool, extra: tuple[str, ...] = ()
) -> list[str]:
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
        *extra,
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


def test_spares_replace_a_node_whose_health_check_fails_and_a_killed_node_with_its_rank(
    tmp_path: Path,
) -> None:
    port = free_port()
    sick = tmp_path / "sick_b"
    bad = "--health-check=sh -c 'echo GPU 0 has fallen off the bus; exit 7'"
    watch = (f"--health-check=test ! -e {sick}", "--health-check-interval=1")

    def start(name: str, *extra: str, host: bool = False) -> Agent:
        flags = spare_flags(port, name, j, host=host, extra=extra)
        return j.start_agent(name, flags, env_extra=node_name(name))

    with job(tmp_path) as j:
        # -- a node whose health check fails does not join
        a = start("a", host=True)  # hosts the store
        b = start("b", *watch)
        wait_for(lambda: any(s["world"] == 2 for s in j.steps()), BOUND, "training at world 2")
        c = start("c", bad)
        assert c.wait(BOUND) == 1, c.output()[-3000:]
        said = (
            "the health check `sh -c echo GPU 0 has fallen off the bus; exit 7` exited with "
            "code 7: GPU 0 has fallen off the bus; this node does not join the job"
        )
        assert said in c.output(), c.output()[-3000:]
        assert not kinds(j, "c", "node_joined")
        # It said so at once: it did not wait for its warm interpreter first.
        assert not kinds(j, "c", "warm_join"), kinds(j, "c", "warm_join")
        (failed,) = kinds(j, "c", "node_health_failed")
        assert failed["when"] == "before_round" and failed["reason"] == "exited with code 7"
        assert len(kinds(j, "a", "workers_started")) == 1  # a's round never re-formed

        # -- a spare waits, warm, and status shows it
        s = start("s")
        wait_for(lambda: kinds(j, "s", "node_waiting"), BOUND, "the third node waits")
        waiting = kinds(j, "s", "node_waiting")[-1]
        assert waiting["spare"] is True and "spare" in str(waiting["reason"]), waiting
        wait_for(lambda: kinds(j, "s", "warm_ready"), BOUND, "the spare's warm interpreter")
        assert not any(st["node"] == "s" for st in j.steps()), "the spare trained"
        assert not kinds(j, "s", "workers_started")
        ranks = {st["node"]: st["group_rank"] for st in j.steps()}
        assert sorted(ranks) == ["a", "b"] and sorted(ranks.values()) == [0, 1]
        s_id = kinds(j, "s", "node_waiting")[-1]["node_id"]
        before = status_json(port)
        assert before["state"] == "running" and before["node_unit"] == 2
        assert [w["node_id"] for w in before["spares"]] == [s_id], before
        assert len(before["members"]) == 2 and before["nodes_present"] == 3
        table = status(port)
        assert any(ln.startswith("spares: ") and s_id in ln for ln in table.splitlines()), table
        assert "node unit 2" in table and "1 spare;" in table, table

        # -- a training node whose check starts failing leaves; the spare takes its place
        sick.write_text("")
        wait_for(
            lambda: "this node leaves the job when this round ends" in b.output(),
            BOUND,
            "node b's check failing while it trains",
        )
        assert kinds(j, "b", "node_health_failed")[-1]["when"] == "training"
        mark = len(j.steps())
        old = {st["pid"] for st in j.steps()}
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
        lines = status(port).splitlines()
        (c_line,) = [ln for ln in lines if ln.startswith("health    node c ")]
        assert "failed its health check before joining at " in c_line, c_line
        assert c_line.endswith(": exited with code 7: GPU 0 has fallen off the bus"), c_line
        (b_line,) = [ln for ln in lines if ln.startswith("health    node b ")]
        assert "failed its health check while training at " in b_line, b_line
        assert b_line.endswith(": exited with code 1"), b_line
        # (--json's health_failures: tests/unit/test_attribution_act.py)

        # -- a training node's agent SIGKILLed: a second spare takes its rank
        t = start("t")
        wait_for(lambda: kinds(j, "t", "node_waiting"), BOUND, "a second spare waits")
        wait_for(lambda: kinds(j, "t", "warm_ready"), BOUND, "the second spare's warm interpreter")
        now = max(st["restart"] for st in j.steps())
        round_now = status_json(port)["round"]
        current = [st for st in j.steps() if st["pid"] not in old and st["restart"] == now]
        ranks = {st["node"]: st["group_rank"] for st in current}
        assert sorted(ranks) == ["a", "s"] and sorted(ranks.values()) == [0, 1], ranks
        s_joined = joined_id(j, "s")
        t_id = kinds(j, "t", "node_waiting")[-1]["node_id"]
        s_pids = {st["pid"] for st in j.steps() if st["node"] == "s"}
        mark = len(j.steps())
        os.kill(s.proc.pid, signal.SIGKILL)  # the agent alone: its guard does the rest
        wait_for(  # each rank writes its step record on its own: wait for both
            lambda: (
                {"a", "t"}
                <= {st["node"] for st in steps_after(j, mark, lambda st: st["world"] == 2)}
            ),
            BOUND,
            "the spare and the survivor training at world 2",
        )
        assert s.wait(BOUND) == -signal.SIGKILL
        wait_for(lambda: not any(pid_alive(p) for p in s_pids), BOUND, "the lost node's workers")

        after = steps_after(j, mark, lambda st: st["world"] == 2 and st["node"] in ("a", "t"))
        by_node = {st["node"]: st["group_rank"] for st in after}
        assert by_node == {"a": ranks["a"], "t": ranks["s"]}, by_node
        promoted = kinds(j, "t", "spare_promoted")
        assert len(promoted) == 1, promoted
        assert promoted[0]["group_rank"] == ranks["s"] and promoted[0]["replaces"] == s_joined
        said = f"this spare trains now, as group rank {ranks['s']}, in place of node {s_joined},"
        assert said in t.output(), t.output()[-3000:]
        after_status = wait_for(
            lambda: (
                (st := status_json(port))["state"] == "running" and st["round"] > round_now and st
            ),
            BOUND,
            "status after the promotion",
        )
        assert after_status["spares"] == [], after_status
        members = {m["node_id"]: m["group_rank"] for m in after_status["members"]}
        assert members == {t_id: ranks["s"], joined_id(j, "a"): ranks["a"]}, after_status
        joined_a = kinds(j, "a", "round_joined")[-1]
        assert joined_a["group_rank"] == joined_a["previous_group_rank"] == ranks["a"]
        check_finished(j, tmp_path, a, t)


def test_a_node_with_another_node_unit_gets_the_config_mismatch(tmp_path: Path) -> None:
    port = free_port()
    # No worker ever starts here: no warm interpreter (a torch import) either.
    cold = ("--no-warm",)
    with job(tmp_path) as j:
        a = j.start_agent("a", spare_flags(port, "a", j, host=True, extra=cold))
        wait_for(lambda: kinds(j, "a", "node_joined"), BOUND, "the first node joined")
        flags = [
            f for f in spare_flags(port, "b", j, host=False, extra=cold) if f != "--node-unit=2"
        ]
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
