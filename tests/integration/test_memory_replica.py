"""Memory checkpoint replicas with real agents and real torch workers (gloo).

Two training nodes and a hot spare on loopback addresses of their own
(``--local-addr``), each rank with a state of its own
(tests/integration/scripts/replica_worker.py). Each agent sends its workers'
marked snapshots (every 5th step) to the next node's agent. A node's agent is
SIGKILLed at step 12, once the other node holds its step-10 replica: the
spare takes its place and its rank, and both ranks resume at step 10, the
lost rank's state coming from the survivor's replica (no checkpoint folder at
all: nothing on disk to read). When the survivor refused the replicas (over
its size bound), both ranks fall back to the disk checkpoint they agree on.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import free_port, pid_alive, wait_for
from tests.integration.elastic_harness import BOUND, Job, job

pytest.importorskip("torch")

ADDRS = {"a": "127.0.0.2", "b": "127.0.0.3", "s": "127.0.0.4"}


def flags(port: int, name: str, j: Job, *, host: bool) -> list[str]:
    return [
        "--nnodes=2:3",
        "--node-unit=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=replicas",
        "--max-restarts=3",
        f"--local-addr={ADDRS[name]}",
        f"--rdzv-conf=last_call_timeout=1,lease_ttl=2,join_timeout=60,is_host={int(host)}",
        "--shutdown-timeout=5",
        f"--events-file={j.dir / f'events-{name}.jsonl'}",
    ]


def kinds(j: Job, name: str, kind: str) -> list[dict[str, Any]]:
    return [e for e in j.events(name) if e["kind"] == kind]


def loaded(j: Job) -> list[dict[str, Any]]:
    path = j.dir / "loaded.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []


def lose_a_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> Job:
    """Train a and b, kill b's agent at step 12, let the spare s replace it;
    returns the finished job (every agent exited 0)."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)  # the agents' environment
    port = free_port()
    with job(tmp_path) as j:
        a = j.start_agent("a", flags(port, "a", j, host=True), script="replica_worker.py")
        b = j.start_agent("b", flags(port, "b", j, host=False), script="replica_worker.py")
        wait_for(j.steps, BOUND, "training at world 2")
        s = j.start_agent("s", flags(port, "s", j, host=False), script="replica_worker.py")
        wait_for(
            lambda: sum(1 for st in j.steps() if st["step"] == 12) == 2,
            BOUND,
            "both ranks at step 12",
        )
        wait_for(lambda: kinds(j, "s", "node_waiting"), BOUND, "the spare waits")
        b_rank = next(st["rank"] for st in j.steps() if st["node"] == "b")
        b_pids = {st["pid"] for st in j.steps() if st["node"] == "b"}
        if "ELASTRUN_REPLICA_MAX_BYTES" not in env:
            wait_for(
                lambda: any(
                    e["rank"] == b_rank and e["step"] == 10
                    for e in kinds(j, "a", "memory_replica_received")
                ),
                BOUND,
                "a holds b's step-10 replica",
            )
        else:
            wait_for(
                lambda: any(e["step"] == 10 for e in kinds(j, "b", "memory_checkpoint_persisted")),
                BOUND,
                "b's step 10 on disk",
            )
        os.kill(b.proc.pid, signal.SIGKILL)  # the agent alone: its guard does the rest
        assert b.wait(BOUND) == -signal.SIGKILL
        wait_for(lambda: not any(pid_alive(p) for p in b_pids), BOUND, "the lost node's workers")
        j.touch("go")
        for agent in (a, s):
            assert agent.wait(BOUND) == 0, agent.output()[-3000:]
        assert b_rank in {st["rank"] for st in j.steps() if st["node"] == "s"}
        return j


def test_a_lost_node_s_rank_resumes_from_the_neighbour_s_replica(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {"MEM_STEPS": "16", "MEM_HOLD_AT": "12", "MEM_REPLICATE": "5"}
    # With a store token, the replicas are signed with a key derived from it.
    env["ELASTRUN_STORE_TOKEN"] = "replica-test-token"
    j = lose_a_node(tmp_path, monkeypatch, env)
    resumed = [ld for ld in loaded(j) if ld["node"] in ("a", "s") and ld["step"] > 0]
    by_node = {ld["node"]: ld for ld in resumed}
    assert set(by_node) == {"a", "s"}, loaded(j)
    # Both ranks agreed on the replicated step, each got its own rank's state.
    assert {ld["step"] for ld in resumed} == {10} and all(ld["w_ok"] for ld in resumed), resumed
    assert not (tmp_path / "ckpt").exists()  # no checkpoint folder: no disk read possible
    out = j.agents[0].output() + j.agents[2].output()
    assert (
        "=> using memory checkpoint: step 10;" in out and "from a neighbour node's replica" in out
    )
    sent = kinds(j, "b", "memory_replica_sent")
    assert any(e["step"] == 10 for e in sent), sent
    assert not kinds(j, "a", "memory_replica_refused")
    assert all(e["authenticated"] for e in kinds(j, "a", "memory_replica_received"))
    final = [st for st in j.steps() if st["step"] == 16]
    assert {st["node"] for st in final} == {"a", "s"}


def test_a_refused_replica_falls_back_to_the_disk_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = tmp_path / "ckpt"
    env = {
        "MEM_STEPS": "16",
        "MEM_HOLD_AT": "12",
        "MEM_REPLICATE": "0",
        "MEM_PERSIST": "5",
        "MEM_DIR": str(ckpt),
        "ELASTRUN_REPLICA_MAX_BYTES": "100",  # every replica is over the bound
    }
    j = lose_a_node(tmp_path, monkeypatch, env)
    refused = kinds(j, "a", "memory_replica_refused")
    assert refused and "over the bound of 100" in refused[0]["reason"], refused
    assert not kinds(j, "a", "memory_replica_received")
    resumed = [ld for ld in loaded(j) if ld["node"] in ("a", "s") and ld["step"] > 0]
    assert {ld["step"] for ld in resumed} == {10} and len(resumed) == 2, loaded(j)
    assert all(ld["w_ok"] for ld in resumed), resumed
    out = j.agents[0].output() + j.agents[2].output()
    assert "=> using checkpoint from rank: 0, step: 10" in out, out[-3000:]
    assert "=> using memory checkpoint" not in out
