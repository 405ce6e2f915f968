"""The agent with real worker processes (torch gloo over loopback).

The rendezvous is a one-node test double (tests/integration/scripts/one_node.py);
every worker is a real process. Tests whose workers import torch only for
what they do (a crash, a membership change, a root cause) start them as
elastrun does, forked from the agent's warm interpreter (one ``import torch``
a test, not one a worker start); the worker environment is checked on workers
started cold. Tests that signal or SIGKILL the agent run it in its own process
(scripts/agent_driver.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from elastrun.agent import Agent, Executable, PythonScript, Std, WorkerSpec
from elastrun.agent.spec import LogSettings, WarmModules, WarmSettings
from elastrun.events import ListSink
from elastrun.names import RunId
from tests.conftest import PYTHON, REPO
from tests.helpers import pid_alive, stop_groups
from tests.integration.scripts.one_node import OneNodeRendezvous

SCRIPTS = Path(__file__).resolve().parent / "scripts"
AGENT_TIMEOUT = 150.0


def run_agent(spec: WorkerSpec, rdzv: OneNodeRendezvous, side=None) -> tuple[int, ListSink]:
    sink = ListSink()

    async def main() -> int:
        task = asyncio.ensure_future(Agent(spec, rdzv, sink).run())
        helper = asyncio.ensure_future(side()) if side is not None else None
        try:
            return await asyncio.wait_for(task, AGENT_TIMEOUT)
        finally:
            if helper is not None:
                helper.cancel()

    return asyncio.run(main()), sink


def spec_for(script: str, *args: str, nproc: int = 2, **kw) -> WorkerSpec:
    kw.setdefault("host", "testhost")
    kw.setdefault("run_id", "agent-test")
    command = Executable((PYTHON, str(SCRIPTS / script), *args))
    return WorkerSpec(command=command, nproc=nproc, **kw)


def warm_spec_for(script: str, *args: str, nproc: int = 2, **kw) -> WorkerSpec:
    """As elastrun runs a Python script: workers forked from the agent's warm
    interpreter (one ``import torch`` for every start, not one a worker)."""
    kw.setdefault("host", "testhost")
    kw.setdefault("run_id", "agent-test")
    command = PythonScript(str(SCRIPTS / script), args, python=PYTHON)
    warm = WarmSettings(enabled=True, modules=WarmModules.TORCH)
    return WorkerSpec(command=command, nproc=nproc, warm=warm, **kw)


def records(outdir: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(outdir.glob("*.json"))]


def started_pids(sink: ListSink) -> list[int]:
    return [pid for e in sink.events if e["kind"] == "workers_started" for pid in e["pids"]]


def assert_reaped(pids: list[int]) -> None:
    # Our own children: once reaped they vanish from /proc (a zombie would stay).
    assert pids
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}"), f"worker {pid} still exists (zombie?)"


def test_workers_get_every_variable_and_all_reduce(tmp_path, capfd):
    out = tmp_path / "out"
    out.mkdir()
    rdzv = OneNodeRendezvous(run_id="agent-test", nproc=2, max_restarts=3)
    spec = spec_for("gloo_env.py", str(out), env={"EXTRA_FROM_SPEC": "yes"})
    code, sink = run_agent(spec, rdzv)
    assert code == 0
    recs = sorted(records(out), key=lambda r: int(r["RANK"]))
    assert len(recs) == 2
    (result_port,) = {e["master"] for e in sink.events if e["kind"] == "workers_started"}
    for local_rank, r in enumerate(recs):
        assert r["allreduce"] == 3.0  # 1 + 2 over both ranks
        assert (r["dist_rank"], r["dist_world"]) == (local_rank, 2)
        assert r["LOCAL_RANK"] == r["RANK"] == r["ROLE_RANK"] == str(local_rank)
        assert r["GROUP_RANK"] == "0"
        assert r["ROLE_NAME"] == "default"
        assert r["LOCAL_WORLD_SIZE"] == r["WORLD_SIZE"] == r["ROLE_WORLD_SIZE"] == "2"
        assert r["GROUP_WORLD_SIZE"] == "1"
        assert f"{r['MASTER_ADDR']}:{r['MASTER_PORT']}" == result_port
        assert r["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert r["TORCHELASTIC_MAX_RESTARTS"] == "3"
        assert r["TORCHELASTIC_RUN_ID"] == "agent-test"
        assert r["TORCHELASTIC_ERROR_FILE"].endswith(f"attempt_0/{local_rank}/error.json")
        assert r["TORCHELASTIC_USE_AGENT_STORE"] == "False"
        assert r["PYTHON_EXEC"] == sys.executable
        assert r["OMP_NUM_THREADS"] == os.environ.get("OMP_NUM_THREADS", "1")
        assert r["PYTHONUNBUFFERED"] == "1"
        assert r["EXTRA_FROM_SPEC"] == "yes"
    assert recs[0]["TORCHELASTIC_ERROR_FILE"] != recs[1]["TORCHELASTIC_ERROR_FILE"]
    # console: prefixed, line by line
    stdout = capfd.readouterr().out
    assert "[testhost:0]: hello from rank 0" in stdout
    assert "[testhost:1]: hello from rank 1" in stdout
    assert rdzv.completed == 1 and rdzv.shutdowns == 1
    kinds = sink.kinds()
    assert kinds[0] == "workers_started" and kinds[-2:] == ["job_finished", "goodput"]
    assert sorted(r["pid"] for r in recs) == sorted(started_pids(sink))
    assert_reaped(started_pids(sink))


def test_crash_consumes_a_restart_and_group_restarts(tmp_path, capfd):
    out = tmp_path / "out"
    out.mkdir()
    rdzv = OneNodeRendezvous(run_id="agent-test", nproc=2, max_restarts=2)
    spec = warm_spec_for("gloo_env.py", str(out), "--crash-rank", "1", "--crash-restart", "0")
    code, sink = run_agent(spec, rdzv)
    assert code == 0
    assert rdzv.restart_count == 1
    recs = records(out)
    assert sorted(r["RANK"] for r in recs) == ["0", "1"]
    assert {r["TORCHELASTIC_RESTART_COUNT"] for r in recs} == {"1"}
    assert rdzv.failures[0]["rank"] == 1
    assert "planned crash on rank 1" in rdzv.failures[0]["message"] + "".join(
        rdzv.failures[0]["stderr_tail"]
    )
    restarts = [e for e in sink.events if e["kind"] == "restart"]
    assert [(e["count"], e["reason"], e["counted"]) for e in restarts] == [
        (1, "worker_failed", True)
    ]
    err = capfd.readouterr().err
    # announced once: the summary's title
    assert err.count("elastrun: restarting workers (restart 1/2): rank 1 on ") == 1, err
    assert len(started_pids(sink)) == 4
    assert_reaped(started_pids(sink))


@pytest.mark.parametrize("mode", ["torch", "elastrun", "plain"])
def test_root_cause_summary_names_rank_1(tmp_path, capfd, mode):
    rdzv = OneNodeRendezvous(run_id="agent-test", nproc=2, max_restarts=0)
    log_dir = tmp_path / "logs"
    logs = LogSettings(dir=str(log_dir))
    spec = warm_spec_for("fail_rank1.py", mode, logs=logs, shutdown_timeout=10)
    code, sink = run_agent(spec, rdzv)
    assert code == 1
    err = capfd.readouterr().err
    summary = err[err.index("job failed: workers failed and no restarts are left") :]
    root = summary.index("[ROOT CAUSE] rank 1 (local rank 1) on testhost, pid ")
    assert "exit code 1" in summary[root : summary.index("\n", root)]
    assert summary.index("rank 0 (local rank 0)") > root  # collateral, after the root cause
    assert "collateral" in summary
    assert "ValueError: rank one exploded: sentinel-7f3a" in summary
    assert "explode_on_rank_one" in summary  # the traceback, decorated or not
    if mode == "plain":
        assert "lines of stderr" in summary
    else:
        assert "traceback (from the error file)" in summary
    log = log_dir / "agent-test" / "testhost" / "attempt_0" / "1" / "stderr.log"
    assert f"full log of rank 1: {log}" in summary
    assert "sentinel-7f3a" in log.read_text()
    failure = rdzv.failures[0]
    assert failure["rank"] == 1 and failure["exitcode"] == 1 and failure["role"] == "root_cause"
    exited = [e for e in sink.events if e["kind"] == "worker_exited"]
    assert [e["cause"] for e in exited if e["rank"] == 1] == ["root_cause"]
    assert [e["cause"] for e in exited if e["rank"] == 0] == ["collateral"]
    assert sink.kinds()[-2:] == ["job_failed", "goodput"]  # its end, then its goodput
    assert_reaped(started_pids(sink))


def test_membership_change_restarts_without_counting(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    # an elastic job (room for a second node: the one that waits), no restart left
    rdzv = OneNodeRendezvous(run_id="agent-test", nproc=2, max_restarts=0, max_nodes=2)
    spec = warm_spec_for("gloo_env.py", str(out), "--hold", shutdown_timeout=10)

    async def side():
        deadline = time.monotonic() + 100
        while len(records(out)) < 2:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        rdzv.change.set()  # a node waits to join: end this round
        while len(records(out)) < 4:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        (out / "release").touch()

    code, sink = run_agent(spec, rdzv, side)
    assert code == 0
    assert rdzv.restart_count == 0 and rdzv.failures == []
    recs = records(out)
    assert len(recs) == 4 and {r["TORCHELASTIC_RESTART_COUNT"] for r in recs} == {"0"}
    restarts = [e for e in sink.events if e["kind"] == "restart"]
    assert [(e["reason"], e["counted"]) for e in restarts] == [("node_waiting", False)]
    assert sink.kinds().count("workers_started") == 2
    assert_reaped(started_pids(sink))


# ---------------------------------------------------------------- agent as a process


def start_driver(
    tmp_path: Path, script_args: list[str], **cfg
) -> tuple[subprocess.Popen[bytes], Path]:
    piddir = tmp_path / "pids"
    piddir.mkdir()
    cfg.setdefault("nproc", 2)
    cfg["argv"] = [PYTHON, str(SCRIPTS / "sleeper.py"), str(piddir), *script_args]
    cfg["events_file"] = str(tmp_path / "events.jsonl")
    proc = subprocess.Popen(
        [PYTHON, str(SCRIPTS / "agent_driver.py"), json.dumps(cfg)],
        cwd=REPO,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    return proc, piddir


def wait_pids(piddir: Path, n: int, timeout: float = 60.0) -> list[list[int]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = sorted(piddir.glob("*.pids"))
        if len(files) == n:
            return [[int(x) for x in f.read_text().split()] for f in files]
        time.sleep(0.05)
    raise AssertionError(f"workers did not start within {timeout} s")


def wait_dead(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if pid_alive(p)]
        if not alive:
            return []
        time.sleep(0.02)
    return [p for p in pids if pid_alive(p)]


def cleanup(proc: subprocess.Popen[bytes], pids: list[int]) -> None:
    stop_groups(proc)
    for pid in pids:
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


def events_of(tmp_path: Path) -> list[dict[str, Any]]:
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_sigkill_of_agent_leaves_no_live_worker(tmp_path):
    proc, piddir = start_driver(tmp_path, [], log_dir=str(tmp_path / "logs"))
    pids: list[int] = []
    try:
        pids = [p for group in wait_pids(piddir, 2) for p in group]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert wait_dead(pids, 10.0) == [], "workers outlived a SIGKILLed agent"
    finally:
        cleanup(proc, pids)


def test_sigterm_of_agent_stops_workers_and_exits_143(tmp_path):
    proc, piddir = start_driver(tmp_path, ["--term-marker"], shutdown_timeout=20)
    pids: list[int] = []
    try:
        pids = [p for group in wait_pids(piddir, 2) for p in group]
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
        assert wait_dead(pids, 10.0) == []
        # the workers got the SIGTERM (their handler ran) and left on it: none
        # was killed after the grace (20 s, never waited out)
        assert sorted(p.name for p in piddir.glob("*.term")) == ["0.term", "1.term"]
        assert proc.stderr is not None
        assert "received SIGTERM" in proc.stderr.read().decode()
        kinds = [e["kind"] for e in events_of(tmp_path)]
        assert "workers_stopping" in kinds
        assert "workers_killed" not in kinds and kinds[-2:] == ["job_failed", "goodput"]
    finally:
        cleanup(proc, pids)


def test_worker_ignoring_sigterm_is_killed_after_the_grace(tmp_path):
    grace = 2.0
    proc, piddir = start_driver(
        tmp_path, ["--ignore-term", "--child"], shutdown_timeout=grace, nproc=1
    )
    pids: list[int] = []
    try:
        (worker_pids,) = wait_pids(piddir, 1)
        pids = worker_pids  # the worker and its child (same process group)
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
        assert wait_dead(pids, 10.0) == [], "worker or its child survived the teardown"
        events = events_of(tmp_path)
        # SIGTERM first, SIGKILL only once the grace ran out (the event log's
        # times: a slow machine can only make the gap longer)
        (stopping,) = [e for e in events if e["kind"] == "workers_stopping"]
        (killed,) = [e for e in events if e["kind"] == "workers_killed"]
        assert stopping["signal"] == "SIGTERM" and stopping["grace"] == grace
        assert killed["pids"] == [worker_pids[0]] and killed["after_grace"] == grace
        assert events.index(stopping) < events.index(killed)
        assert killed["ts"] - stopping["ts"] >= grace * 0.9
        exited = [e for e in events if e["kind"] == "worker_exited"]
        assert exited[0]["signal"] == "SIGKILL" and exited[0]["cause"] == "collateral"
    finally:
        cleanup(proc, pids)


def test_forwarded_signal_reaches_workers_without_stopping_them(tmp_path):
    proc, piddir = start_driver(
        tmp_path, ["--usr1-marker", "--term-marker"], forward=["SIGUSR1"], shutdown_timeout=20
    )
    pids: list[int] = []
    try:
        pids = [p for group in wait_pids(piddir, 2) for p in group]
        os.kill(proc.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 20
        while len(list(piddir.glob("*.usr1"))) < 2:
            assert time.monotonic() < deadline, "SIGUSR1 was not forwarded to every worker"
            time.sleep(0.05)
        assert all(pid_alive(p) for p in pids) and proc.poll() is None
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == 143
        assert wait_dead(pids, 10.0) == []
    finally:
        cleanup(proc, pids)


ECHO = (
    "import os, sys; r = os.environ['RANK']; print('out-' + r); print('err-' + r, file=sys.stderr)"
)


def test_redirects_tee_and_rank_filter(tmp_path, capfd):
    log_dir = tmp_path / "logs"
    spec = WorkerSpec(
        command=Executable((PYTHON, "-c", ECHO)),
        nproc=3,
        run_id=RunId("echo"),
        host="h1",
        logs=LogSettings(
            dir=str(log_dir),
            redirects={1: Std.ALL, 2: Std.OUT},
            tee={2: Std.OUT},
            local_ranks_filter=frozenset({1, 2}),
            template="<{role}/{host}/{rank}>",
        ),
    )
    code, _ = run_agent(spec, OneNodeRendezvous(run_id="echo", nproc=3))
    assert code == 0
    cap = capfd.readouterr()
    # rank 0 filtered out of the console; rank 1 redirected to files only; rank 2 tees stdout
    assert "out-0" not in cap.out and "err-0" not in cap.err
    assert "out-1" not in cap.out and "err-1" not in cap.err
    assert "<default/h1/2>: out-2" in cap.out and "<default/h1/2>: err-2" in cap.err
    for r in range(3):
        d = log_dir / "echo" / "h1" / "attempt_0" / str(r)
        assert (d / "stdout.log").read_text() == f"out-{r}\n"
        assert (d / "stderr.log").read_text() == f"err-{r}\n"


def test_finished_job_exits_0_without_starting_workers(tmp_path):
    rdzv = OneNodeRendezvous(closed=True)
    code, sink = run_agent(spec_for("sleeper.py", str(tmp_path), nproc=1), rdzv)
    assert code == 0
    assert "workers_started" not in sink.kinds() and rdzv.shutdowns == 1


def test_unstartable_worker_fails_clearly(tmp_path, capfd):
    spec = WorkerSpec(
        command=Executable((str(tmp_path / "no-such-program"),)), nproc=2, run_id=RunId("x")
    )
    code, _ = run_agent(spec, OneNodeRendezvous(nproc=2))
    assert code == 1
    assert "cannot start worker local rank 0" in capfd.readouterr().err


@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "aarch64"), reason="the exit system call's number"
)
def test_a_rank_whose_end_has_begun_is_the_root_cause_before_its_exit_is_reported(
    tmp_path: Path,
) -> None:
    """Rank 1's process has begun to end (its main thread gone, its sockets
    closed) but the kernel does not report its exit yet when rank 0's failure
    message arrives: rank 1 then dies of SIGKILL by itself. It ended first:
    it is the root cause, and elastrun did not stop it (the demo's race,
    held open here for 1.5 s instead of a few milliseconds)."""
    rdzv = OneNodeRendezvous(nproc=2, max_restarts=0)
    command = PythonScript(str(SCRIPTS / "dying_rank1.py"), (str(tmp_path),), python=PYTHON)
    spec = WorkerSpec(
        command=command, nproc=2, host="testhost", run_id=RunId("agent-test"), shutdown_timeout=10
    )
    code, sink = run_agent(spec, rdzv)
    assert code == 1
    exited = {e["rank"]: e for e in sink.events if e["kind"] == "worker_exited"}
    assert exited[1]["signal"] == "SIGKILL" and not exited[1]["stopped_by_agent"], exited
    assert exited[1]["cause"] == "root_cause", exited
    assert exited[0]["exitcode"] == 1 and exited[0]["cause"] == "collateral", exited
    failure = rdzv.failures[0]
    assert failure["rank"] == 1 and failure["role"] == "root_cause", failure
    assert_reaped(started_pids(sink))


def test_a_rank_killed_by_a_signal_is_the_root_cause_when_its_peer_reports_first(
    tmp_path: Path,
) -> None:
    """Rank 1 is SIGKILLed and says nothing; rank 0 fails because of it (as a
    peer whose collective broke does). The agent is busy meanwhile, so rank
    1's exit, rank 0's failure message and rank 0's exit all wait in the
    same turn of its event loop: rank 1, dead first, is still the root cause."""
    rdzv = OneNodeRendezvous(nproc=2, max_restarts=0)
    spec = spec_for("killed_rank1.py", str(tmp_path), shutdown_timeout=10)
    ready = (tmp_path / "rank0.ready", tmp_path / "rank1.ready")

    async def busy_while_they_fail() -> None:
        while not all(f.exists() for f in ready):  # both ranks run
            await asyncio.sleep(0.01)
        (tmp_path / "die").write_text("")  # rank 1's cue
        time.sleep(3)  # the agent's loop blocked: both ranks end meanwhile

    code, sink = run_agent(spec, rdzv, side=busy_while_they_fail)
    assert code == 1
    exited = {e["rank"]: e for e in sink.events if e["kind"] == "worker_exited"}
    assert exited[1]["signal"] == "SIGKILL" and exited[1]["cause"] == "root_cause", exited
    assert exited[0]["exitcode"] == 1 and exited[0]["cause"] == "collateral", exited
    failure = rdzv.failures[0]
    assert failure["rank"] == 1 and failure["role"] == "root_cause", failure
    assert_reaped(started_pids(sink))
