"""Hang watchdog, orphan guard, per-host log folders (real worker processes).

The rendezvous is the one-node test double; workers are real processes that
call ``elastrun.train.heartbeat``. The orphan-guard test SIGKILLs an agent
running in its own process (scripts/agent_driver.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from elastrun.agent import Agent, Executable, WorkerSpec
from elastrun.agent.spec import HangSettings, LogSettings
from elastrun.events import ListSink
from elastrun.names import RunId
from tests.conftest import PYTHON, REPO
from tests.helpers import pid_alive, stop_groups
from tests.integration.scripts.one_node import OneNodeRendezvous
from tests.integration.test_agent import SCRIPTS, assert_reaped, run_agent, started_pids

HANG = 3.0


def hb_spec(tmp_path: Path, mode: str, nproc: int, **kw) -> tuple[WorkerSpec, Path]:
    out = tmp_path / "out"
    out.mkdir()
    kw.setdefault("host", "testhost")
    kw.setdefault("run_id", "wd-test")
    spec = WorkerSpec(
        command=Executable((PYTHON, str(SCRIPTS / "heartbeat_worker.py"), str(out), mode)),
        nproc=nproc,
        hang=HangSettings(timeout=HANG),
        shutdown_timeout=5,
        **kw,
    )
    return spec, out


def test_hung_rank_fails_the_group_and_consumes_a_restart(tmp_path, capfd):
    spec, out = hb_spec(tmp_path, "hang", 2)
    rdzv = OneNodeRendezvous(run_id="wd-test", nproc=2, max_restarts=1)
    code, sink = run_agent(spec, rdzv)
    assert code == 0
    assert rdzv.restart_count == 1
    assert (out / "hung.1").exists()
    # the restarted round finished normally
    assert sorted(p.name for p in out.glob("1.*.done")) == ["1.0.done", "1.1.done"]
    hangs = [e for e in sink.events if e["kind"] == "hang_detected"]
    assert len(hangs) == 1
    (h,) = hangs
    assert (h["rank"], h["last_step"], h["hang_timeout"]) == (1, 4, HANG)
    assert h["idle_s"] >= HANG  # never declared before the timeout
    restarts = [e for e in sink.events if e["kind"] == "restart"]
    assert [(e["reason"], e["counted"]) for e in restarts] == [("worker_failed", True)]
    msg = "rank 1 made no progress for 3 s (last step 4)"
    assert rdzv.failures[0]["rank"] == 1 and rdzv.failures[0]["message"] == msg
    assert rdzv.failures[0]["role"] == "root_cause" and rdzv.failures[0]["hang"] == msg
    err = capfd.readouterr().err
    root = err.index("[ROOT CAUSE] rank 1 (local rank 1) on testhost")
    assert "hung, stopped by elastrun" in err[root : err.index("\n", root)]
    assert f"error: {msg}" in err
    assert f"elastrun: restarting workers (restart 1/1): {msg} on testhost" in err
    exited = [e for e in sink.events if e["kind"] == "worker_exited" and e["attempt"] == 0]
    assert {e["rank"]: e["cause"] for e in exited} == {0: "collateral", 1: "root_cause"}
    assert_reaped(started_pids(sink))


def test_hang_is_declared_after_the_rank_stopped(tmp_path):
    # When exactly (the timeout after the last progress) is checked in
    # virtual time: tests/unit/test_watchdog_blind_spots.py.
    spec, out = hb_spec(tmp_path, "hang", 2)
    rdzv = OneNodeRendezvous(run_id="wd-test", nproc=2, max_restarts=1)
    times: dict[str, float] = {}

    def on_event(event):
        if event["kind"] == "hang_detected":
            times["hang"] = time.monotonic()

    sink = ListSink(on_event)

    async def main() -> int:
        return await asyncio.wait_for(Agent(spec, rdzv, sink).run(), 150)

    assert asyncio.run(main()) == 0
    hung_at = float((out / "hung.1").read_text())  # worker's monotonic: same clock
    assert hung_at <= times["hang"]  # in that order


def test_slow_but_steady_heartbeats_are_not_a_hang(tmp_path):
    # every 1.5 s: slower than the rate limit (0.75 s at S=3), faster than S
    spec, out = hb_spec(tmp_path, "slow", 2, env={"SLOW_EVERY": "1.5", "RUN_FOR": "9"})
    rdzv = OneNodeRendezvous(run_id="wd-test", nproc=2, max_restarts=1)
    code, sink = run_agent(spec, rdzv)
    assert code == 0
    assert "hang_detected" not in sink.kinds() and rdzv.restart_count == 0
    assert sorted(p.name for p in out.glob("*.done")) == ["0.0.done", "0.1.done"]


def test_no_heartbeat_is_never_judged(tmp_path):
    spec, out = hb_spec(tmp_path, "silent", 1, env={"RUN_FOR": str(HANG * 2.5)})
    rdzv = OneNodeRendezvous(run_id="wd-test", nproc=1)
    code, sink = run_agent(spec, rdzv)
    assert code == 0
    assert "hang_detected" not in sink.kinds() and rdzv.restart_count == 0
    assert (out / "0.0.done").exists()


# ------------------------------------------------------------ no orphans


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(x) for x in (task / "children").read_text().split()]
    return out


def test_sigkill_of_agent_kills_the_workers_whole_trees(tmp_path):
    piddir = tmp_path / "pids"
    piddir.mkdir()
    cfg = {
        "argv": [PYTHON, str(SCRIPTS / "tree_worker.py"), str(piddir)],
        "nproc": 2,
        "events_file": str(tmp_path / "events.jsonl"),
    }
    proc = subprocess.Popen(
        [PYTHON, str(SCRIPTS / "agent_driver.py"), json.dumps(cfg)],
        cwd=REPO,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(list(piddir.glob("*.pids"))) < 2:
            assert time.monotonic() < deadline, "workers did not start"
            time.sleep(0.05)
        for f in piddir.glob("*.pids"):
            pids += [int(x) for x in f.read_text().split()]
        assert len(pids) == 6 and all(pid_alive(p) for p in pids)
        guard = [p for p in _children(proc.pid) if p not in pids]
        assert len(guard) == 1, f"expected the orphan guard among {_children(proc.pid)}"
        pids += guard
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
            time.sleep(0.02)
        alive = [p for p in pids if pid_alive(p)]
        assert alive == [], f"processes of the workers' trees outlived the agent: {alive}"
    finally:
        stop_groups(proc)
        for pid in pids:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


# ------------------------------------------------------------ log folders


def test_log_dir_has_a_folder_per_host_and_live_agent(tmp_path):
    log_dir = tmp_path / "logs"
    spec = WorkerSpec(
        command=Executable((PYTHON, "-c", "print('hi')")),
        nproc=1,
        run_id=RunId("lay"),
        host="node-a",
        logs=LogSettings(dir=str(log_dir)),
    )
    code, _ = run_agent(spec, OneNodeRendezvous(run_id="lay", nproc=1))
    assert code == 0
    assert (log_dir / "lay" / "node-a" / "attempt_0" / "0" / "stdout.log").read_text() == "hi\n"
    assert not (log_dir / "lay" / "node-a" / ".agent.pid").exists()  # released at exit
    # a live agent of the same run on the same host holds node-a: the next one gets node-a.1
    (log_dir / "lay" / "node-a" / ".agent.pid").write_text(str(os.getppid()))
    code, _ = run_agent(spec, OneNodeRendezvous(run_id="lay", nproc=1))
    assert code == 0
    assert (log_dir / "lay" / "node-a.1" / "attempt_0" / "0" / "stdout.log").read_text() == "hi\n"


def test_agent_and_worker_agree_on_the_heartbeat_variables():
    import importlib

    from elastrun.agent import watchdog

    worker_side = importlib.import_module("elastrun.train.heartbeat")
    assert watchdog.HEARTBEAT_ENV == worker_side.HEARTBEAT_ENV
    assert watchdog.HEARTBEAT_INTERVAL_ENV == worker_side.HEARTBEAT_INTERVAL_ENV
    assert watchdog.heartbeat_interval(3.0) == 0.75
    assert watchdog.heartbeat_interval(60.0) == worker_side.HEARTBEAT_INTERVAL_S
