"""Reusing a job id, with real agents, on a store that outlives the jobs:
``elastrun store serve`` (the embedded store as its own process) and etcd.

* After a failed job, a new job under the same id starts afresh (restart
  count 0) with its own settings (other ``--nnodes`` and ``--max-restarts``
  are not refused against the dead job's), says so on the console and in the
  event log, and its first crash is a restart, not the end.
* After a job whose agent was SIGKILLed at restart 1 (nobody left), the same.
* A finished job's id exits 0 with nothing to do (a pod restarted after
  completion), even with other settings; no worker starts.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import free_port, stop_groups, wait_for, without_pet
from tests.integration.elastic_harness import ELASTRUN, SCRIPTS
from tests.store.etcd_fixture import ETCD, start_cluster

WORKER = str(SCRIPTS / "launch_input_worker.py")
RUN = 120.0
GONE = 30.0  # a SIGKILLed agent's presence: 2 s grace (embedded), the 2 s TTL (etcd)


@dataclass
class Backend:
    name: str
    endpoint: str

    def flags(self, run_id: str, *extra: str) -> list[str]:
        return [
            f"--rdzv-backend={self.name}",
            f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-id={run_id}",
            "--rdzv-conf=last_call_timeout=0.5,lease_ttl=2,join_timeout=60"
            + (",is_host=0" if self.name == "c10d" else ""),
            "--shutdown-timeout=5",
            "--no-warm",
            *extra,
        ]

    async def _live(self, run_id: str) -> int:
        from elastrun.store.factory import open_store

        store = await open_store(self.name, self.endpoint, timeout=10.0)
        try:
            kvs, _ = await store.get_prefix(f"/elastrun/{run_id}/nodes/")
            return len(kvs)
        finally:
            await store.close()

    def live_nodes(self, run_id: str) -> int:
        return asyncio.run(self._live(run_id))


@pytest.fixture(params=["c10d", "etcd"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "etcd":
        if ETCD is None:
            pytest.skip("needs the etcd server binary")
        cluster = start_cluster(1)
        try:
            yield Backend("etcd", cluster.endpoints)
        finally:
            cluster.stop()
        return
    port = free_port()
    log = tmp_path / "store.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [*ELASTRUN, "store", "serve", "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_for(lambda: "listening on" in log.read_text(), 30, "the store to listen")
        yield Backend("c10d", f"127.0.0.1:{port}")
    finally:
        stop_groups(server)


def run(
    flags: list[str], *args: str, cwd: Path, timeout: float = RUN
) -> subprocess.CompletedProcess[str]:
    env = without_pet()
    return subprocess.run(
        [*ELASTRUN, *flags, WORKER, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def restarts_seen(stdout: str) -> list[int]:
    return [
        int(line.split("restart=")[1].split()[0])
        for line in stdout.splitlines()
        if "WORKER run_id=" in line
    ]


def events_of(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_failed_jobs_id_starts_afresh(backend: Backend, tmp_path: Path) -> None:
    old = run(backend.flags("reused", "--max-restarts=1"), "fail", cwd=tmp_path)
    assert old.returncode == 1 and restarts_seen(old.stdout) == [0, 1], old.stderr
    # Another node count and budget: once refused against the dead job's settings.
    events = tmp_path / "events.jsonl"
    marks = tmp_path / "marks"
    marks.mkdir()
    new = run(
        backend.flags("reused", "--nnodes=1:2", "--max-restarts=2", f"--events-file={events}"),
        "fail-once",
        str(marks),
        cwd=tmp_path,
    )
    assert new.returncode == 0, new.stderr
    assert restarts_seen(new.stdout) == [0, 1]  # a fresh count: the first crash is restart 1
    assert "job 'reused': the previous job with this id failed (1 of 1 restarts used" in new.stderr
    assert "starting a new job with this id" in new.stderr
    reset = [e for e in events_of(events) if e["kind"] == "job_reset"]
    assert len(reset) == 1 and reset[0]["reason"] == "failed", reset
    assert reset[0]["previous_restarts"] == 1


def test_an_abandoned_jobs_restart_count_is_not_inherited(backend: Backend, tmp_path: Path) -> None:
    old_dir = tmp_path / "old"
    old_dir.mkdir()
    log = tmp_path / "old.log"
    env = without_pet()
    with open(log, "wb") as out:
        flags = backend.flags("dropped", "--max-restarts=1")
        agent = subprocess.Popen(
            [*ELASTRUN, *flags, WORKER, "fail-once-wait", str(old_dir)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
    try:
        wait_for(lambda: "restart=1" in log.read_text(), RUN, "the old job at restart 1")
        agent.kill()  # SIGKILL: the agent leaves nothing behind but its records
        agent.wait(30)
        wait_for(lambda: backend.live_nodes("dropped") == 0, GONE, "its presence to expire")
    finally:
        stop_groups(agent)
    new_dir = tmp_path / "new"
    new_dir.mkdir()
    new = run(backend.flags("dropped", "--max-restarts=1"), "fail-once", str(new_dir), cwd=tmp_path)
    # Inherited, it would start at restart 1 and its first crash would fail it.
    assert new.returncode == 0, new.stderr
    assert restarts_seen(new.stdout) == [0, 1]
    assert "stopped with no node left (round 1, 1 of 1 restarts used)" in new.stderr


def test_a_finished_jobs_id_exits_0_with_nothing_to_do(backend: Backend, tmp_path: Path) -> None:
    done = run(backend.flags("done"), "ok", cwd=tmp_path)
    assert done.returncode == 0 and restarts_seen(done.stdout) == [0], done.stderr
    for extra in ([], ["--nnodes=2:3", "--max-restarts=4"]):
        again = run(backend.flags("done", *extra), "ok", cwd=tmp_path)
        assert again.returncode == 0, again.stderr
        assert "WORKER" not in again.stdout  # nothing ran
        assert "the job is already finished" in again.stderr
        assert "to run it again, use a new --rdzv-id" in again.stderr
