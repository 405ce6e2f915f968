"""Rendezvous records written by a stranger while a job trains: anyone who
reaches a store without a token can put any bytes under any key. Real agents
(the ``elastrun`` command) with real workers on one real embedded store
(``elastrun store serve``, so that it outlives the agents), a raw store client
for the stranger, and ``elastrun status`` as a real command
(docs/rendezvous.md, *Values that are not records*).

* Three bytes that are not JSON under ``waiting/``, ``nodes/`` and the join
  prefixes of the round that trains and of the next one: the agents leave them
  out with one line each, a worker crash restarts the job past them, and it
  finishes normally; status shows the job running meanwhile.
* The same bytes in ``round``: every agent stops its workers and exits 1 with
  one line naming the key (no traceback, no hang); status names it too.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastrun.names import RunId
from elastrun.rendezvous.keys import Keys
from elastrun.rendezvous.records import RoundRecord
from elastrun.store.client import TcpStore
from tests.helpers import pid_alive, stop_groups, wait_for
from tests.integration.elastic_harness import BOUND, check_finished, crash_and_train_again, job
from tests.integration.test_elastic import c10d_flags
from tests.integration.test_hostile_notes import SCRIPTS, agent, status
from tests.store.conftest import ServerProcess, start_server_process, stop_process

JUNK = b"\x00\xffx"  # three bytes, not JSON


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = start_server_process()
    yield proc
    stop_process(proc.proc)


async def _put_junk(port: int, keys: list[str]) -> None:
    store = await TcpStore.connect("127.0.0.1", port, timeout=30.0)
    try:
        for key in keys:
            await store.put(key, JUNK)  # no lease, no token: a stranger's put
    finally:
        await store.close()


async def _round(port: int, run_id: str) -> int:
    store = await TcpStore.connect("127.0.0.1", port, timeout=30.0)
    try:
        kv = await store.get(Keys(RunId(run_id)).round)
        assert kv is not None
        return RoundRecord.decode(kv.key, kv.value).round
    finally:
        await store.close()


def test_junk_under_the_per_node_prefixes_is_left_out_and_the_job_finishes(
    tmp_path: Path, server: ServerProcess
) -> None:
    port, keys = server.port, Keys(RunId("e2e"))  # c10d_flags' job id
    with job(tmp_path) as j:
        a, b = (j.start_agent(n, c10d_flags(port, host=False)) for n in ("a", "b"))
        wait_for(lambda: any(s["world"] == 2 for s in j.steps()), BOUND, "training at world 2")
        r = asyncio.run(_round(port, "e2e"))
        junk = [keys.waiting("junk"), keys.node("junk"), keys.join(r, "junk")]
        junk.append(keys.join(r + 1, "junk"))  # where the restart's round gathers
        asyncio.run(_put_junk(port, junk))

        running = status(port, "e2e")
        assert running.returncode == 0 and b"running" in running.stdout, running

        crash_and_train_again(j, 2)  # the round after it forms past the junk
        check_finished(j, tmp_path, a, b)
        logs = {x.name: x.output() for x in (a, b)}
    for name, log in logs.items():
        assert "elastrun: error" not in log, log[-3000:]  # (the workers' crash has tracebacks)
        for key in junk:  # never more than one line per key
            assert sum(key in line for line in log.splitlines()) <= 1, (name, key, log[-3000:])
    both = logs["a"] + logs["b"]
    # Read while they trained (waiting/ by each member, nodes/ by the round's
    # watcher) and while the restart's round gathered (its joins, by its decider).
    for key in (keys.waiting("junk"), keys.node("junk"), keys.join(r + 1, "junk")):
        assert re.search(f"elastrun: warning: a store key left out .*{key}", both), (key, both)
    for log in logs.values():
        assert keys.waiting("junk") in log  # every member reads waiting/


def test_junk_in_round_stops_every_agent_with_one_line_naming_the_key(
    tmp_path: Path, server: ServerProcess
) -> None:
    run_id, port = "junk-round", server.port
    flags = [
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={run_id}",
        "--rdzv-conf=is_host=0,join_timeout=60",
        "--no-warm",
    ]
    round_key = Keys(RunId(run_id)).round
    with (
        agent(*flags, str(SCRIPTS / "sleeper.py"), str(tmp_path)) as a,
        agent(*flags, str(SCRIPTS / "sleeper.py"), str(tmp_path)) as b,
    ):
        pids = [tmp_path / f"{rank}.pids" for rank in (0, 1)]
        wait_for(lambda: all(p.exists() for p in pids), BOUND, "both workers running")
        workers = [int(p.read_text().split()[0]) for p in pids]
        asyncio.run(_put_junk(port, [round_key]))
        errs: dict[str, str] = {}
        for name, proc in (("a", a), ("b", b)):
            try:
                _, raw = proc.communicate(timeout=BOUND)  # no hang
            except subprocess.TimeoutExpired:
                stop_groups(proc)
                raise AssertionError(f"agent {name} still running after {BOUND:.0f}s") from None
            errs[name] = raw.decode(errors="replace")
            assert proc.returncode == 1, (name, proc.returncode, errs[name][-3000:])
    for name, text in errs.items():
        assert "Traceback" not in text, text[-3000:]
        verdict = [line for line in text.splitlines() if line.startswith("elastrun: error:")]
        assert len(verdict) == 1, (name, text[-3000:])
        assert f"round record is damaged: store key {round_key} is not valid JSON" in verdict[0]
    assert not any(pid_alive(pid) for pid in workers), "a worker outlived its agent"

    seen = status(port, run_id)
    assert seen.returncode == 1, seen
    assert f"store key {round_key} is not valid JSON".encode() in seen.stderr, seen.stderr
    assert b"Traceback" not in seen.stderr
