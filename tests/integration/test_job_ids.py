"""Job ids with real agents: a bad id never reaches the store or the disk.

* With job ``A`` running, nodes started with ``--rdzv-id=A/waiting``,
  ``A/nodes``, ``A/round``... exit 2 at once, naming the flag; job A's keys
  are untouched and it finishes in its one round (such a node used to leave
  lease-less keys under A's prefix and make A re-form ~40 times a second).
* ``--rdzv-id=../../x`` cannot put a file outside ``--log-dir``; nor can a
  hostile host name (root only: a UTS namespace with hostname
  ``../../../../evil host``).
* An empty id (``--rdzv-id=``, or torch's ``run_id=""`` from Python) runs
  with a generated one; for a job that may have more nodes it is printed.
* ``elastrun status`` refuses a bad id the same way.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.helpers import free_port, wait_for
from tests.integration.elastic_harness import BOUND, ELASTRUN, SCRIPTS, Agent, Job, job

WORKER = str(SCRIPTS / "launch_input_worker.py")
RUN = 120.0  # bound of one short job on a loaded 2-core machine


def elastrun(*args: str, cwd: Path, timeout: float = RUN) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    return subprocess.run(
        [*ELASTRUN, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def start_agent(j: Job, name: str, flags: list[str], *script_args: str) -> Agent:
    """An agent running the test worker with ``script_args``, in its own
    process group (the job's cleanup kills it)."""
    log = j.dir / f"agent-{name}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*ELASTRUN, *flags, WORKER, *script_args],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
    agent = Agent(name, proc, log)
    j.agents.append(agent)
    return agent


async def store_keys(port: int) -> list[str]:
    """The store's keys, but job A's notes."""
    from elastrun.store.factory import open_store

    store = await open_store("c10d", f"127.0.0.1:{port}", timeout=10.0)
    try:
        kvs, _ = await store.get_prefix("/elastrun/")
        # The job's own notes (progress, stragglers) come and go as it trains.
        return [kv.key for kv in kvs if not kv.key.startswith("/elastrun/A/notes/")]
    finally:
        await store.close()


def test_bad_ids_cannot_disturb_a_running_job(tmp_path: Path) -> None:
    port = free_port()
    events = tmp_path / "events-A.jsonl"
    flags = [
        "--nnodes=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=A",
        "--rdzv-conf=is_host=1,last_call_timeout=0.5",
        f"--events-file={events}",
    ]
    with job(tmp_path) as j:
        a = start_agent(j, "A", flags, "wait", str(tmp_path))
        wait_for(lambda: "WORKER run_id=A" in a.output(), BOUND, "job A's worker running")
        before = asyncio.run(store_keys(port))
        assert before and all(k.startswith("/elastrun/A/") for k in before), before

        for bad in ["A/waiting", "A/nodes", "A/round", "A/rounds/0/join", "A/../A"]:
            res = elastrun(
                "--nnodes=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                f"--rdzv-id={bad}",
                "--rdzv-conf=is_host=0",
                WORKER,
                cwd=tmp_path,
                timeout=30,
            )
            assert res.returncode == 2, (bad, res.stderr)
            assert f"--rdzv-id: {bad!r} is not a valid job id" in res.stderr, res.stderr
            assert "Traceback" not in res.stderr and "WORKER" not in res.stdout

        after = asyncio.run(store_keys(port))
        assert after == before, (before, after)  # not one key written or deleted
        (tmp_path / "finish").write_text("")
        assert a.wait(BOUND) == 0, a.output()[-3000:]
    kinds = [json.loads(line)["kind"] for line in events.read_text().splitlines()]
    assert kinds.count("round_closed") == 1, kinds  # A never re-formed


def test_log_dir_cannot_be_escaped(tmp_path: Path) -> None:
    base = tmp_path / "a" / "b"
    logs = base / "logs"
    for bad in ["../../escape", "..", ".", "x/../../../escape"]:
        res = elastrun(
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=127.0.0.1:0",
            f"--rdzv-id={bad}",
            f"--log-dir={logs}",
            WORKER,
            cwd=tmp_path,
            timeout=30,
        )
        assert res.returncode == 2 and res.stderr.count("--rdzv-id:") == 1, res.stderr
    assert not (tmp_path / "a" / "escape").exists() and not (tmp_path / "escape").exists()
    assert not logs.exists()  # refused before anything was created
    res = elastrun(
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:0",
        "--rdzv-id=legit.id-1",
        f"--log-dir={logs}",
        "--nproc-per-node=2",
        WORKER,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    made = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert made and all(logs.resolve() in p.resolve().parents for p in made), made
    assert (logs / "legit.id-1").is_dir()


HOSTILE_HOST = "../../../../evil host"  # from logs/RUN/events-HOST: up to tmp_path


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for a UTS namespace")
def test_a_hostile_host_name_stays_inside_the_log_dir(tmp_path: Path) -> None:
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("needs unshare(1)")
    probe = subprocess.run(
        [unshare, "--uts", "hostname", "x"], capture_output=True, text=True, timeout=30, check=False
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot make a UTS namespace: {probe.stderr.strip()}")
    logs = tmp_path / "deep" / "logs"
    code = (
        "import socket, sys; socket.sethostname(sys.argv[1]); "
        "from elastrun.cli import main; sys.exit(main(sys.argv[2:]))"
    )
    res = subprocess.run(
        [
            unshare,
            "--uts",
            sys.executable,
            "-c",
            code,
            HOSTILE_HOST,
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=127.0.0.1:0",
            "--rdzv-id=hostile",
            f"--log-dir={logs}",
            "--tee=3",
            WORKER,
        ],
        capture_output=True,
        text=True,
        timeout=RUN,
        cwd=tmp_path,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    made = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name == "stdout.log" for p in made), made
    assert all(logs.resolve() in p.resolve().parents for p in made), made
    assert not (tmp_path / "evil host").exists() and not (tmp_path / "deep" / "evil host").exists()
    names = {p.name for p in (logs / "hostile").iterdir()}
    assert names == {"_.._.._.._evil_host", "events-_.._.._.._evil_host.jsonl"}, names


def test_empty_run_id_generates_one(tmp_path: Path) -> None:
    res = elastrun(
        "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", "--rdzv-id=", WORKER, cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr
    line = next(x for x in res.stdout.splitlines() if "WORKER" in x)
    run_id = line.split("run_id=")[1].split()[0]
    uuid.UUID(run_id)
    assert "warning" not in res.stderr  # a single node: nothing to tell
    # A job that may have more nodes: the generated id is printed.
    res = elastrun(
        "--nnodes=1:2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--rdzv-id=",
        "--rdzv-conf=is_host=1,last_call_timeout=0.5",
        WORKER,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    run_id = res.stdout.split("run_id=")[1].split()[0]
    assert f"other nodes can join it only if started with --rdzv-id={run_id}" in res.stderr


def test_python_launch_with_torchs_default_run_id(tmp_path: Path) -> None:
    code = (
        "import sys, elastrun\n"
        "cfg = elastrun.LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, run_id='',\n"
        f"    rdzv_backend='c10d', rdzv_endpoint='127.0.0.1:0')\n"
        f"sys.exit(elastrun.launch(cfg, {WORKER!r}))\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=RUN,
        cwd=tmp_path,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    ids = {x.split("run_id=")[1].split()[0] for x in res.stdout.splitlines() if "WORKER" in x}
    assert len(ids) == 1
    uuid.UUID(ids.pop())
    bad = code.replace("run_id=''", "run_id='A/waiting'")
    res = subprocess.run(
        [sys.executable, "-c", bad],
        capture_output=True,
        text=True,
        timeout=RUN,
        cwd=tmp_path,
        check=False,
    )
    assert res.returncode != 0 and "LaunchConfig.run_id: 'A/waiting'" in res.stderr
    assert "--rdzv-id" not in res.stderr


def test_status_refuses_a_bad_id(tmp_path: Path) -> None:
    res = elastrun(
        "status", "--rdzv-endpoint=127.0.0.1:1", "--rdzv-id=A/waiting", cwd=tmp_path, timeout=30
    )
    assert res.returncode == 2, res.stderr
    assert "--rdzv-id: 'A/waiting' is not a valid job id: it contains '/'" in res.stderr
