"""The dynamic rendezvous with real processes and a real embedded TCP store.

The module starts one ``elastrun store serve`` on loopback (each test's
handlers use a run id of their own in it); each test starts rendezvous handlers
in separate processes (tests/integration/rdzv_node.py), reads their JSON lines,
and stops every process it started by pid.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from elastrun.names import RunId
from elastrun.rendezvous.keys import Keys
from elastrun.store.client import TcpStore
from tests.conftest import PYTHON, REPO

ENV = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{REPO}"}


class Proc:
    """A child process whose JSON output lines are collected by a thread."""

    def __init__(self, argv: list[str]) -> None:
        self.p = subprocess.Popen(
            argv, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[dict[str, Any]] = []
        self.raw: list[str] = []
        self._cv = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            with self._cv:
                self.raw.append(line)
                if line.startswith("{"):
                    self.lines.append(json.loads(line))
                self._cv.notify_all()

    def wait_lines(self, pred: Any, n: int, timeout: float) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                got = [x for x in self.lines if pred(x)]
                if len(got) >= n:
                    return got
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"timed out waiting for {n} lines; have {self.raw[-20:]}")
                self._cv.wait(left)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.p.poll() is None:
            os.kill(self.p.pid, sig)
        try:
            self.p.wait(10)
        except subprocess.TimeoutExpired:
            os.kill(self.p.pid, signal.SIGKILL)
            self.p.wait(10)


@pytest.fixture(scope="module")
def store() -> Iterator[tuple[str, int]]:
    p = subprocess.Popen(
        [PYTHON, "-m", "elastrun", "store", "serve", "--host", "127.0.0.1", "--port", "0"],
        cwd=REPO,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
        m = re.search(r"listening on (\S+):(\d+)", line)
        assert m, f"store did not start: {line!r}"
        yield m.group(1), int(m.group(2))
    finally:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


class Cluster:
    def __init__(self, addr: tuple[str, int], **common: Any) -> None:
        self.addr = addr
        self.common = {"run_id": f"job-{uuid.uuid4().hex[:8]}", **common}
        self.procs: list[Proc] = []

    def start(self, count: int, script: list[str], first: int = 0, **kw: Any) -> Proc:
        spec = {**self.common, "count": count, "first": first, "script": script, **kw}
        argv = [PYTHON, "-m", "tests.integration.rdzv_node", self.addr[0], str(self.addr[1])]
        proc = Proc([*argv, json.dumps(spec)])
        self.procs.append(proc)
        return proc

    def lines(self, pred: Any) -> list[dict[str, Any]]:
        return [x for p in self.procs for x in p.lines if pred(x)]

    def wait(self, pred: Any, n: int, timeout: float = 60.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            got = self.lines(pred)
            if len(got) >= n:
                return got
            if time.monotonic() > deadline:
                raw = [r for p in self.procs for r in p.raw[-5:]]
                raise AssertionError(f"timed out: {len(got)} of {n} lines; tail: {raw}")
            time.sleep(0.05)

    def stop(self) -> None:
        for p in self.procs:
            p.kill()


@pytest.fixture
def cluster(store: tuple[str, int]) -> Iterator[Any]:
    made: list[Cluster] = []

    def make(**common: Any) -> Cluster:
        c = Cluster(store, **common)
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()


def step(name: str, ok: bool = True, round: int | None = None) -> Any:
    return lambda x: (
        x["step"] == name and x["ok"] is ok and (round is None or x.get("round") == round)
    )


def assert_one_world(results: list[dict[str, Any]], n: int) -> None:
    members = {tuple(r["members"]) for r in results}
    assert len(members) == 1, f"handlers disagree on membership: {members}"
    ranks = sorted(r["rank"] for r in results)
    assert ranks == list(range(n))
    assert len({tuple(r["master"]) for r in results}) == 1
    assert len({r["round"] for r in results}) == 1
    # Each node's own place (read alone) is what the whole membership says.
    for r in results:
        assert r["whole"] == [r["rank"], r["world"], r["world_size"], r["offset"]], r


def test_many_handlers_agree(cluster: Any) -> None:
    n = 64
    c = cluster(min=n, max=n, last_call=5.0)
    for i in range(4):
        c.start(16, ["next_round", "complete"], first=i * 16)
    results = c.wait(step("next_round"), n, timeout=90)
    assert_one_world(results, n)
    assert sorted(results[0]["members"]) == sorted(f"n{i}" for i in range(n))
    c.wait(step("complete"), n, timeout=60)


def test_killed_while_joining_does_not_block(cluster: Any) -> None:
    c = cluster(min=3, max=4, ttl=2.0, last_call=1.0)
    victim = c.start(1, ["next_round"], first=9, min=3, progress=True)
    # The victim joins first (it is the decider), then dies before the round closes.
    victim.wait_lines(lambda x: x["step"] == "progress" and x["state"] == "joining", 1, 30)
    victim.kill()
    c.start(3, ["next_round", "complete"])
    results = c.wait(step("next_round"), 3, timeout=60)
    assert_one_world(results, 3)
    assert "n9" not in results[0]["members"]


def test_decider_killed_among_64_joiners_round_closes_without_it(
    cluster: Any, store: tuple[str, int]
) -> None:
    """At scale: 64 nodes, the first joiner (the decider, which every other
    joiner's chain of predecessors leads to) is SIGKILLed with 31 joined
    behind it. Its join key goes with its lease, its follower takes over,
    and the round closes with the 63 others (min 62, max 64), every one
    agreeing on the members and the ranks, the dead node not among them."""
    c = cluster(min=62, max=64, ttl=4.0, last_call=1.0)
    victim = c.start(1, ["next_round"], first=99, progress=True)
    victim.wait_lines(lambda x: x["step"] == "progress" and x["state"] == "joining", 1, 60)
    c.start(31, ["next_round", "complete"], first=0, progress=True)
    c.wait(lambda x: x["step"] == "progress" and x["state"] == "joining", 31, timeout=120)
    victim.kill()
    key = Keys(RunId(c.common["run_id"])).join(0, "n99")
    asyncio.run(_wait_deleted(store, key, timeout=60.0))
    c.start(32, ["next_round", "complete"], first=31)
    results = c.wait(step("next_round"), 63, timeout=120)
    assert_one_world(results, 63)
    assert "n99" not in results[0]["members"]
    assert sorted(results[0]["members"]) == sorted(f"n{i}" for i in range(63))
    c.wait(step("complete"), 63, timeout=120)


async def _wait_deleted(addr: tuple[str, int], key: str, timeout: float) -> None:
    """Until ``key`` is absent from the store (a watch, bounded by ``timeout``)."""
    store = await TcpStore.connect(addr[0], addr[1], timeout=timeout)
    try:
        async with asyncio.timeout(timeout):
            kvs, revision = await store.get_prefix(key)
            if not any(kv.key == key for kv in kvs):
                return
            async with await store.watch(key, start_revision=revision + 1) as watch:
                async for event in watch:
                    if event.type == "delete":
                        return
    finally:
        await store.close()


def test_member_killed_after_close_is_noticed(cluster: Any) -> None:
    # When its lease expiry is noticed (at the TTL) is checked in virtual time:
    # tests/unit/test_rdzv_timers.py. Here: real processes, a real SIGKILL.
    ttl = 2.0
    c = cluster(min=2, max=3, ttl=ttl, last_call=0.5)
    victim = c.start(1, ["next_round", "hang"], first=9)
    c.start(2, ["next_round", "wait_change", "next_round", "complete"])
    c.wait(step("next_round"), 3, timeout=60)
    c.wait(step("hang"), 1, timeout=30)
    victim.kill()
    changes = c.wait(step("wait_change"), 2, timeout=30)
    assert all(ch["reason"] == "member_lost" for ch in changes)
    assert all("n9" in ch["detail"] for ch in changes)
    second = c.wait(step("next_round", round=1), 2, timeout=30)
    assert_one_world(second, 2)
    c.wait(step("complete"), 2, timeout=30)


@pytest.mark.parametrize("victims", [(0,), (3,), (0, 2)], ids=["watcher", "other", "both"])
def test_members_lost_while_training_are_noticed_by_the_round_s_watcher(
    cluster: Any, victims: tuple[int, ...]
) -> None:
    """While the members train, the round's watcher (group rank 0) alone
    watches every presence key; the others watch its presence. Whoever is
    SIGKILLed, the watcher, another member or both at once, every survivor
    sees the change and the next round closes without them."""
    # max joined closes a round at once; the long last call only keeps a slow
    # starter in round 0 (a re-formed round closes once every live node joined).
    c = cluster(min=2, max=4, ttl=2.0, last_call=10.0)
    procs = [
        c.start(1, ["next_round", "wait_change", "next_round", "complete"], first=i)
        for i in range(4)
    ]
    first = c.wait(step("next_round", round=0), 4, timeout=60)
    assert_one_world(first, 4)
    rank_of = {x["node"]: x["rank"] for x in first}
    dead = {node for node, rank in rank_of.items() if rank in victims}
    for proc in procs:
        if any(x["node"] in dead for x in proc.lines):
            proc.kill()
    survivors = len(procs) - len(dead)
    changes = c.wait(step("wait_change"), survivors, timeout=30)
    assert all(ch["reason"] == "member_lost" for ch in changes), changes
    assert all(any(d in ch["detail"] for d in dead) for ch in changes), changes
    second = c.wait(step("next_round", round=1), survivors, timeout=30)
    assert_one_world(second, survivors)
    assert not set(second[0]["members"]) & dead, second[0]
    c.wait(step("complete"), survivors, timeout=30)


def test_late_joiner_triggers_new_round(cluster: Any) -> None:
    c = cluster(min=2, max=3, last_call=0.5)
    c.start(2, ["next_round", "wait_change", "next_round", "complete"])
    c.wait(step("next_round"), 2, timeout=60)
    c.start(1, ["next_round", "complete"], first=7)
    changes = c.wait(step("wait_change"), 2, timeout=30)
    assert all(ch["reason"] == "node_waiting" for ch in changes)
    second = c.wait(step("next_round", round=1), 3, timeout=30)
    assert_one_world(second, 3)
    assert "n7" in second[0]["members"]
    # Sticky ranks: the two original members keep theirs.
    first = {r["node"]: r["rank"] for r in c.lines(step("next_round", round=0))}
    for r in second:
        if r["node"] in first:
            assert r["rank"] == first[r["node"]]
    c.wait(step("complete"), 3, timeout=30)


def test_config_mismatch_names_nnodes(cluster: Any) -> None:
    c = cluster(min=1, max=3, last_call=0.5)
    c.start(1, ["next_round", "hang"])
    c.wait(step("next_round"), 1, timeout=60)
    c.start(1, ["next_round"], first=5, min=2, max=4)
    bad = c.wait(step("next_round", ok=False), 1, timeout=30)[0]
    assert bad["error"] == "ConfigMismatch"
    assert "nnodes: job has 1:3, this node has 2:4" in bad["message"]


def test_different_nproc_contiguous_ranks(cluster: Any) -> None:
    c = cluster(min=3, max=3)
    c.start(1, ["next_round", "complete"], nproc=2)
    c.start(1, ["next_round", "complete"], first=1, nproc=3)
    c.start(1, ["next_round", "complete"], first=2, nproc=1)
    results = c.wait(step("next_round"), 3, timeout=60)
    assert_one_world(results, 3)
    assert {r["world_size"] for r in results} == {6}
    nproc = {"n0": 2, "n1": 3, "n2": 1}
    spans = sorted((r["offset"], r["offset"] + nproc[r["node"]]) for r in results)
    assert spans[0][0] == 0 and spans[-1][1] == 6
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))


def test_shutdown_does_not_close_the_job(cluster: Any) -> None:
    c = cluster(min=2, max=3, last_call=0.5)
    c.start(1, ["next_round", "sleep:1", "shutdown"], first=9)
    c.start(2, ["next_round", "wait_change", "next_round", "complete"])
    c.wait(step("next_round"), 3, timeout=60)
    changes = c.wait(step("wait_change"), 2, timeout=30)
    assert all(ch["reason"] == "member_lost" for ch in changes)
    second = c.wait(step("next_round", round=1), 2, timeout=30)
    assert_one_world(second, 2)
    c.wait(step("complete"), 2, timeout=30)


def test_restart_budget_is_job_wide(cluster: Any) -> None:
    c = cluster(min=2, max=2, max_restarts=1)
    c.start(1, ["next_round", "restart", "next_round", "restart", "next_round"])
    c.start(1, ["next_round", "wait_change", "next_round", "wait_change", "next_round"], first=1)
    second = c.wait(step("next_round", round=1), 2, timeout=60)
    assert all(r["restarts"] == 1 for r in second)
    failed = c.wait(lambda x: x["ok"] is False, 2, timeout=30)
    assert {f["error"] for f in failed} == {"RestartBudgetExhausted"}


def test_late_node_after_complete_is_closed(cluster: Any) -> None:
    c = cluster(min=2, max=3, last_call=0.5)
    c.start(2, ["next_round", "complete"])
    c.wait(step("complete"), 2, timeout=60)
    c.start(1, ["next_round"], first=5)
    late = c.wait(step("next_round", ok=False), 1, timeout=30)[0]
    assert late["error"] == "RendezvousClosed"  # told at once, not timed out


def test_join_timeout_names_who_joined(cluster: Any) -> None:
    c = cluster(min=3, max=3, join_timeout=3.0)
    c.start(2, ["next_round"])
    failed = c.wait(step("next_round", ok=False), 2, timeout=30)
    for f in failed:
        assert f["error"] == "RendezvousTimeout"
        assert "2 of min 3 nodes joined before join_timeout=3s" in f["message"]
        assert "n0" in f["message"] and "n1" in f["message"]


def test_node_waits_while_the_round_is_full_until_a_member_is_lost(cluster: Any) -> None:
    c = cluster(min=2, max=2, ttl=1.0, last_call=0.5, progress=True)
    c.start(1, ["next_round", "wait_change", "next_round", "complete"])
    victim = c.start(1, ["next_round", "hang"], first=9)
    c.wait(step("next_round", round=0), 2, timeout=60)
    late = c.start(1, ["next_round", "complete"], first=7)
    # It reports why it waits, and it waits: no re-round while the world is max.
    waiting = late.wait_lines(lambda x: x["step"] == "progress", 1, timeout=30)[0]
    assert waiting["state"] == "waiting"
    assert waiting["detail"] == "round 0 is full (2 of max 2 nodes)"
    assert waiting["deadline"] == "join_timeout"
    # That it keeps waiting for three lease TTLs while the members renew their
    # leases is checked in virtual time (tests/unit/test_rdzv_timers.py).
    assert not c.lines(step("wait_change")), "a full round was re-formed for a waiting node"
    assert not c.lines(step("next_round", round=1))
    victim.kill()
    change = c.wait(step("wait_change"), 1, timeout=30)[0]
    assert change["reason"] == "member_lost" and "n9" in change["detail"]
    second = c.wait(step("next_round", round=1), 2, timeout=30)
    assert_one_world(second, 2)
    assert sorted(second[0]["members"]) == ["n0", "n7"]
    c.wait(step("complete"), 2, timeout=30)


def test_joining_node_reports_progress(cluster: Any) -> None:
    c = cluster(min=2, max=3, last_call=1.0, join_timeout=30.0, progress=True)
    first = c.start(1, ["next_round", "complete"])
    got = first.wait_lines(lambda x: x["step"] == "progress", 1, timeout=30)[0]
    assert (got["state"], got["joined"], got["deadline"]) == ("joining", 1, "join_timeout")
    assert 0 < got["left"] <= 30.0
    c.start(1, ["next_round", "complete"], first=1)
    last_call = first.wait_lines(lambda x: x.get("deadline") == "last_call", 1, timeout=30)[0]
    assert last_call["joined"] == 2 and 0 < last_call["left"] <= 1.0
    c.wait(step("complete"), 2, timeout=30)
