"""In-process restarts under random faults: real agents (two nodes on the
embedded store), real gloo workers on loopback (tests/integration/scripts/inproc_worker.py).

A seeded plan SIGKILLs or raises in a random rank at a random step, in each
of a few rounds. The checker reads every worker's view of its group (each
member's round and pid, gathered over the group itself) and the agents'
event logs, and asserts that

* no process ever was in a round's group with a process of another round
  (every member of every group said the same round, and the pids of each
  round's group are the pids the agents say entered that round);
* every survivor kept its process: the ranks that did not fail are the same
  pids in the next round, the failed rank's process is replaced, and only the
  replaced ranks ran their setup again (a standby's process, when one served
  the replaced rank, ran it before the failure).
"""

from __future__ import annotations

import json
import os
import random
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import free_port, needs
from tests.integration.elastic_harness import job

pytestmark = needs("torch")

SEED = int(os.environ.get("ELASTRUN_FAULT_SEED", "3201"))
FAULTS = 3  # rounds with a fault; the run of the last restart count has none
NPROC, NODES, STEPS = 2, 2, 6
BOUND = 300.0


def plan(seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [
        {
            "rank": rng.randrange(NPROC * NODES),
            "how": rng.choice(["kill", "raise"]),
            "step": rng.randrange(1, STEPS - 1),
        }
        for _ in range(FAULTS)
    ]


def flags(port: int, host: bool, events: Path) -> list[str]:
    return [
        f"--nnodes={NODES}",
        f"--nproc-per-node={NPROC}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=inproc",
        f"--max-restarts={FAULTS}",
        f"--rdzv-conf=last_call_timeout=1,lease_ttl=5,join_timeout=120,is_host={int(host)}",
        "--shutdown-timeout=5",
        f"--events-file={events}",
    ]


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


@pytest.mark.parametrize("seed", [SEED])
def test_random_faults_never_mix_rounds(tmp_path: Path, seed: int) -> None:
    faults = plan(seed)
    os.environ["INPROC_PLAN"] = json.dumps(faults)  # inherited by the agents and workers
    os.environ["INPROC_STEPS"] = str(STEPS)
    port = free_port()
    try:
        with job(tmp_path) as j:
            agents = [
                j.start_agent(n, flags(port, n == "a", tmp_path / f"events-{n}.jsonl"), script)
                for n, script in (("a", "inproc_worker.py"), ("b", "inproc_worker.py"))
            ]
            codes = [a.wait(BOUND) for a in agents]
            assert codes == [0, 0], "\n".join(a.output()[-3000:] for a in agents)
    finally:
        os.environ.pop("INPROC_PLAN", None)
        os.environ.pop("INPROC_STEPS", None)
    records = lines(tmp_path / "views.jsonl")
    views = [r for r in records if "members" in r]
    setups = [r["setup"] for r in records if "setup" in r]
    events = [e for n in ("a", "b") for e in lines(tmp_path / f"events-{n}.jsonl")]
    what = f"seed {seed}, plan {faults}"

    # 1. No group mixes rounds: every member said the view's round, and the
    # group's pids are those the agents say entered that round.
    entered: dict[int, set[int]] = defaultdict(set)
    for e in events:
        if e["kind"] == "rank_entered":
            entered[e["round"]].add(e["pid"])
    by_round: dict[int, set[frozenset[int]]] = defaultdict(set)
    for v in views:
        assert {m[0] for m in v["members"]} == {v["round"]}, f"{what}: mixed group {v}"
        pids = {m[1] for m in v["members"]}
        assert len(pids) == NPROC * NODES, f"{what}: {v}"
        assert pids == entered[v["round"]], f"{what}: round {v['round']}: {pids} vs events"
        by_round[v["round"]].add(frozenset(pids))
    assert all(len(groups) == 1 for groups in by_round.values()), f"{what}: {by_round}"

    # 2. The survivors' processes are kept; only the failed rank's is replaced.
    rounds = sorted(by_round)
    assert len(rounds) == FAULTS + 1, f"{what}: rounds {rounds}"
    pid_of = {(v["round"], m[2]): m[1] for v in views for m in v["members"]}  # (round, rank) -> pid
    replaced = set()
    for i, fault in enumerate(faults):
        r, nxt = rounds[i], rounds[i + 1]
        failed = pid_of[(r, fault["rank"])]
        replaced.add(failed)
        now = set(next(iter(by_round[nxt])))
        before = set(next(iter(by_round[r])))
        assert failed not in now, f"{what}: the failed rank's process {failed} was kept"
        assert before - {failed} <= now, f"{what}: round {nxt} lost survivors {before - now}"
    first = set(next(iter(by_round[rounds[0]])))
    # Setup ran once per process: the first ones and one per failure (a new
    # process, or a standby set up before the failure), and in standbys never used.
    assert sorted(setups) == sorted(set(setups)), f"{what}: setup twice in a process"
    trained = {pid for groups in by_round.values() for g in groups for pid in g}
    standbys = {e["pid"] for e in events if e["kind"] == "standby_started"}
    assert set(setups) <= trained | standbys, f"{what}: a setup in no group and no standby"
    assert len(trained & set(setups)) == len(first) + FAULTS, f"{what}: {len(setups)} setups"
    kept_events = [e for e in events if e["kind"] == "ranks_kept"]
    assert kept_events, f"{what}: no ranks_kept event"
