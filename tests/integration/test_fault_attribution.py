"""Fault attribution end to end: real agents on loopback, real gloo workers,
the embedded store.

* A deterministic script bug (rank 1 raises at its 3rd step after every
  start): the job stops after 2 identical failures, not after
  ``--max-restarts``; every node exits 1 with the same line naming the
  exception, the rank and the step.
* A bad node, then a persistent straggler, each replaced by a hot spare, in
  one job (one job for both: each agent's warm interpreter costs a torch
  import). Node b's ranks raise a CUDA-like error a few steps after every
  start; the spare s's ranks sleep longer in every step. After b's second
  failure, b is quarantined and leaves, s takes its place, the job trains at
  full size again; ``elastrun status`` shows the verdict and the quarantine;
  b's agent, restarted, is refused until an operator clears it. The event
  logs are checked: no node is excluded beyond what the rule allows. Then,
  with ``--replace-stragglers``, once a second spare t waits: group rank 0's
  agent decides once, the straggler s leaves the job, t takes its place; the
  survivor's restart is a membership change (not counted); ``elastrun
  status`` shows s kept out.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import free_port, wait_for
from tests.integration.elastic_harness import (
    BOUND,
    ELASTRUN,
    Agent,
    Job,
    job,
    node_name,
    steps_after,
)

STOP_LINE = (
    "elastrun: job stopped: script fault: ValueError: bad batch in rank 1 at step 3, "
    "2 identical failures"
)


NO_SPARE = "not excluded: the job would fall below --nnodes min 2 with no spare"


def flags(port: int, j: Job, name: str, *, host: bool, nnodes: str, extra: list[str]) -> list[str]:
    return [
        f"--nnodes={nnodes}",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=faults",
        "--max-restarts=5",
        # A long lease: an agent starved for seconds on a loaded machine must
        # not lose its place (a node quarantined leaves at once, lease or not).
        f"--rdzv-conf=last_call_timeout=1,lease_ttl=10,join_timeout=60,is_host={int(host)}",
        "--shutdown-timeout=5",
        f"--events-file={j.dir / f'events-{name}.jsonl'}",
        *extra,
    ]


def status(port: int, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*ELASTRUN, "status", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=faults", *extra],
        capture_output=True,
        text=True,
        timeout=BOUND,
        check=False,
    )


def test_a_script_bug_stops_the_job_after_two_identical_failures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAULT_MODE", "bug")
    port = free_port()
    with job(tmp_path) as j:
        a = j.start_agent(
            "a", flags(port, j, "a", host=True, nnodes="2", extra=[]), env_extra=node_name("a")
        )
        b = j.start_agent(
            "b", flags(port, j, "b", host=False, nnodes="2", extra=[]), env_extra=node_name("b")
        )
        for agent in (a, b):
            assert agent.wait(BOUND) == 1, agent.output()[-3000:]
            assert STOP_LINE in agent.output(), agent.output()[-3000:]
        for name in ("a", "b"):
            # Two starts (the first and one restart) of the 6 --max-restarts allowed.
            assert len(j.kinds(name, "workers_started")) == 2
            (failed,) = j.kinds(name, "job_failed")
            assert failed["reason"] == "script_fault"
        # The node that judged first stopped the job; a node that judged later
        # judged alike, one that found the job stopped already says so.
        verdicts = j.kinds("a", "fault_verdict") + j.kinds("b", "fault_verdict")
        assert verdicts
        for verdict in verdicts:
            assert verdict["verdict"] == "script_fault" and verdict["action"] == "stop"
            assert (verdict["rank"], verdict["step"], verdict["node"]) == (1, 3, "b")


def justified(j: Job, names: list[str]) -> None:
    """The checker over the run's event logs: every quarantine rests on a
    node-fault verdict whose failed rounds' root causes (each node's
    ``restart`` events name the job's root cause) were all that node's own
    failures: never a broken collective, never another node's."""
    causes: dict[int, dict[str, Any]] = {}
    for name in names:
        for e in j.kinds(name, "restart"):
            if e.get("failure"):
                causes[e["round"]] = e["failure"]
    verdicts = [e for n in names for e in j.kinds(n, "fault_verdict")]
    for name in names:
        for q in j.kinds(name, "node_quarantined"):
            host = q["quarantined_host"]
            # Its own verdict (the others say it leaves; earlier ones, while
            # no spare was there yet, that it stays).
            (verdict,) = [v for v in verdicts if v["node"] == host and v["action"] == "quarantine"]
            assert verdict["verdict"] == "node_fault", verdict
            # The round the node left in may have no `restart` event naming its
            # cause (the node leaves instead of restarting; a survivor told to
            # stop first has no failure of its own): every round that has one
            # is checked, and at least one has.
            seen = [causes[r] for r in verdict["rounds"] if r in causes]
            assert seen, (verdict, causes)
            for cause in seen:
                assert cause["host"] == host and cause["role"] == "root_cause", cause
                assert cause["kind"] != "broken_collective", cause


def spare_trains_in_its_place(j: Job, spare: str = "s") -> None:
    """The lost node left: ``spare`` and the survivor a train at full size."""
    mark = len(j.steps())
    wait_for(
        lambda: {"a", spare} <= {st["node"] for st in steps_after(j, mark, lambda st: True)},
        BOUND,
        "the spare and the survivor training at full size",
    )
    assert all(st["world"] == 2 for st in steps_after(j, mark, lambda st: st["node"] == spare))


def faulty(name: str, mode: str, node: str) -> dict[str, str]:
    """Agent ``name``'s environment: its node name, and the fault of its
    workers (``FAULT_MODE`` on node ``FAULT_NODE``: scripts/elastic_worker.py)."""
    return {**node_name(name), "FAULT_MODE": mode, "FAULT_NODE": node}


def test_a_bad_node_is_quarantined_then_a_persistent_straggler_is_replaced_by_spares(
    tmp_path: Path,
) -> None:
    port = free_port()
    # b fails after every start: until the spare s is there it stays (the
    # job would fall below --nnodes min 2), so the job may restart a few
    # times more than the 2 failures that judge b. --replace-stragglers
    # decides only while a spare waits: not before s is a member, once t waits.
    extra = [
        "--node-unit=2",
        "--quarantine-time=600",
        "--max-restarts=12",
        "--straggler-interval=0.5",
        "--replace-stragglers=2",
    ]
    bad = ("bad_node", "b")  # b's ranks fail a few steps after every start
    slow = ("slow_node", "s")  # s's ranks are slow in every step

    def start(name: str, fault: tuple[str, str], *, host: bool = False) -> Agent:
        f = flags(port, j, name, host=host, nnodes="2:3", extra=extra)
        return j.start_agent(name, f, env_extra=faulty(name, *fault))

    with job(tmp_path) as j:
        # -- a bad node: b quarantined, the spare s in its place
        a = start("a", bad, host=True)
        b = start("b", bad)
        wait_for(lambda: j.kinds("a", "workers_started"), BOUND, "node a training")
        s = start("s", slow)
        assert b.wait(BOUND) == 1, b.output()[-3000:]
        out = b.output()
        assert "node fault: node b failed 2 times in a row" in out, out[-3000:]
        assert "this node (b) leaves the job, quarantined until" in out, out[-3000:]
        spare_trains_in_its_place(j, "s")
        # The survivor judged too when its ranks' broken collective failed
        # before b's restart order reached its agent; when the order came
        # first, its agent stopped its ranks (no failure of its own to judge)
        # and it says why the round ended: b's failure.
        said = a.output()
        if [v for v in j.kinds("a", "fault_verdict") if v["node"] == "b"]:
            assert "node fault: node b failed 2 times in a row" in said, said[-3000:]
        else:
            assert said.count("rank 1 on b") >= 2, said[-3000:]
        table = status(port)
        assert table.returncode == 0, table.stderr
        assert "node b quarantined until" in table.stdout, table.stdout
        # The verdict, with what was done: status names the bad node.
        assert "node fault: node b failed 2 times in a row" in table.stdout, table.stdout
        assert "; left the job, quarantined until" in table.stdout, table.stdout
        as_json = json.loads(status(port, "--json").stdout)
        *stayed, left = as_json["fault_verdicts"]
        assert (left["kind"], left["host"]) == ("node_fault", "b"), left
        assert left["outcome"].startswith("left the job, quarantined until"), left
        for v in stayed:  # judged before the spare was there: b stayed, saying why
            assert (v["host"], v["outcome"]) == ("b", NO_SPARE), v
        assert as_json["fault_stopped"] is None

        b2 = flags(port, j, "b2", host=False, nnodes="2:3", extra=extra)
        again = j.start_agent("b2", b2, env_extra=faulty("b", *bad))  # b's agent, restarted
        assert again.wait(BOUND) == 1
        assert "this node (b) is quarantined until" in again.output(), again.output()[-3000:]
        assert "--clear-quarantine b" in again.output()
        cleared = status(port, "--clear-quarantine", "b")
        assert cleared.returncode == 0 and "is cleared" in cleared.stdout, cleared
        assert "node b quarantined until" not in status(port).stdout  # the record is gone

        justified(j, ["a", "b", "s"])

        # -- a persistent straggler: s, once the spare t waits, replaced by t
        restarts_before = len(j.kinds("a", "restart"))
        t = start("t", slow)
        wait_for(lambda: j.kinds("t", "node_waiting"), BOUND, "the spare t waiting")
        assert s.wait(BOUND) == 1, s.output()[-3000:]
        assert "this node (s) leaves the job, kept out until" in s.output(), s.output()[-3000:]
        (gone,) = j.kinds("s", "job_failed")
        assert gone["reason"] == "straggler_replaced"
        spare_trains_in_its_place(j, "t")
        # One decision, by group rank 0's agent, naming s; the survivor's
        # restart was a membership change, not counted.
        decisions = [
            e
            for n in ("a", "b", "s", "t")
            for e in j.kinds(n, "straggler_replacement")
            if e["replaced"]
        ]
        assert [d["node"] for d in decisions] == ["s"], decisions
        assert decisions[0]["intervals"] >= 2
        since = j.kinds("a", "restart")[restarts_before:]
        assert all(not r["counted"] for r in since), since
        table = status(port)
        assert table.returncode == 0, table.stderr
        assert "node s quarantined until" in table.stdout, table.stdout
        assert "straggler: rank 1" in table.stdout, table.stdout
        j.touch("finish")
        for agent in (a, t):
            assert agent.wait(BOUND) == 0, agent.output()[-3000:]
