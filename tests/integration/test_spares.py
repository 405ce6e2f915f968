"""Warm spares (agent/spares.py): a restarted worker is a pre-started
interpreter that already imported torch, and the training script cannot tell
it from a cold start, except that ``import torch`` is instant.

Real ``elastrun`` processes, real gloo workers, loopback only.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from elastrun.agent import WorkerSpec
from elastrun.agent.spares import ROUND_VARS, SparePool, python_entry
from elastrun.events import ListSink
from tests.conftest import PYTHON
from tests.integration.elastic_harness import free_port, pid_alive, wait_for
from tests.integration.test_cli import ELASTRUN, RUN_TIMEOUT, elastrun, env_without_pet

# Records what a worker sees, all-reduces over gloo, and fails once (rank 1 of
# the first attempt) so that the job restarts.
PROBE = textwrap.dedent(
    """
    import json, os, sys, time
    warm = "torch" in sys.modules            # before the script imports anything
    import torch
    import torch.distributed as dist

    rc, rank = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["RANK"]
    dist.init_process_group("gloo")
    t = torch.tensor([1.0])
    dist.all_reduce(t)
    rec = dict(warm=warm, argv=sys.argv, path0=sys.path[0], file=__file__, name=__name__,
               spec=None if __spec__ is None else __spec__.name, env=dict(os.environ),
               pid=os.getpid(), world=dist.get_world_size(), sum=t.item(),
               stdin_tty=os.isatty(0), stdin=os.read(0, 10).decode())
    out = os.environ["PROBE_OUT"]
    with open(os.path.join(out, f"r{rc}-{rank}.json"), "w") as f:
        json.dump(rec, f)
    dist.destroy_process_group()
    if rc == "0" and rank == "1" and not os.environ.get("PROBE_NO_FAIL"):
        sys.exit(3)
    if os.environ.get("PROBE_RAISE") and rc == "1" and rank == "0":
        raise ValueError("probe failure in the restarted worker")
    """
)


def _setup(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "probe.py").write_text(PROBE)
    env = env_without_pet()
    env["PROBE_OUT"] = str(out)
    return out, env


def _records(out: Path) -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}


def _events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _probe_run(
    tmp_path: Path, *flags: str
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    out, env = _setup(tmp_path)
    events = tmp_path / "events.jsonl"
    proc = elastrun(
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "--rdzv-id=probe",
        f"--events-file={events}",
        *flags,
        "probe.py",
        "a",
        "--b=c",
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = _records(out)
    assert set(recs) == {"r0-0", "r0-1", "r1-0", "r1-1"}
    return recs, _events(events)


def _rel(value: Any, root: Path) -> Any:
    """Paths under a run's folder, made comparable between two runs."""
    if isinstance(value, str):
        return value.replace(str(root.resolve()), "ROOT").replace(str(root), "ROOT")
    return value


def test_warm_workers_see_what_cold_workers_see(tmp_path):
    cold_dir, warm_dir = tmp_path / "cold", tmp_path / "warm"
    cold_dir.mkdir()
    warm_dir.mkdir()
    cold_recs, cold_events = _probe_run(cold_dir, "--no-prewarm")
    warm_recs, events = _probe_run(warm_dir)
    assert not [e for e in cold_events if e["kind"].startswith("spare_")]
    for name, cold in cold_recs.items():
        warm = warm_recs[name]
        assert cold["warm"] is False, name
        if name.startswith("r1-"):  # restarts; the first start takes only ready spares
            assert warm["warm"] is True, f"{name} started cold"
        for key in ("argv", "file", "path0", "name", "spec", "world", "sum", "stdin"):
            assert _rel(warm[key], warm_dir) == _rel(cold[key], cold_dir), (name, key)
        assert warm["argv"] == ["probe.py", "a", "--b=c"]
        assert warm["name"] == "__main__" and warm["stdin"] == ""  # /dev/null, not a socket
        # The same environment, but for the variables that change per round.
        assert set(warm["env"]) == set(cold["env"])
        changed = {
            k
            for k in cold["env"]
            if _rel(warm["env"][k], warm_dir) != _rel(cold["env"][k], cold_dir)
        }
        # (--standalone draws a new run id for every run, as torchrun does.)
        assert changed <= ROUND_VARS | {"TORCHELASTIC_RUN_ID"}, changed - ROUND_VARS
    assert warm_recs["r1-1"]["env"]["TORCHELASTIC_RESTART_COUNT"] == "1"
    used = {e["pid"] for e in events if e["kind"] == "spare_used"}
    assert used == {r["pid"] for r in warm_recs.values() if r["warm"]}
    assert {warm_recs["r1-0"]["pid"], warm_recs["r1-1"]["pid"]} <= used
    started = [e["pid"] for e in events if e["kind"] == "spare_started"]
    # A spare not ready for the first start is kept for the restart; after the
    # restart no restart is left, and no spare is kept for nothing.
    first_warm = sum(1 for n, r in warm_recs.items() if n.startswith("r0-") and r["warm"])
    assert len(started) == 2 + first_warm and len(used) == len(started)
    assert not [e for e in events if e["kind"] == "spare_discarded"]
    for pid in started:
        assert not pid_alive(pid), f"spare {pid} outlived the agent"


def test_the_first_workers_start_from_spares_ready_during_the_rendezvous(tmp_path):
    # Agent A waits in the rendezvous for B; its spares import torch meanwhile.
    out, env = _setup(tmp_path)
    env["PROBE_NO_FAIL"] = "1"  # (rank 0 is done before rank 1 would fail: no restart)
    port = free_port()
    events_a, events_b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    common = [
        "--nnodes=2",
        "--nproc-per-node=1",
        "--max-restarts=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=spares-first",
    ]
    conf = "--rdzv-conf=join_timeout=90,last_call_timeout=1,is_host="

    def agent(events: Path, *extra: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [ELASTRUN, *common, *extra, f"--events-file={events}", "probe.py"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    a = agent(events_a, conf + "1")
    procs = [a]
    try:
        wait_for(
            lambda: (
                events_a.exists() and any(e["kind"] == "spare_ready" for e in _events(events_a))
            ),
            90,
            "agent A's spare ready",
        )
        procs.append(agent(events_b, conf + "0"))
        for p in procs:
            _, err = p.communicate(timeout=RUN_TIMEOUT)
            assert p.returncode == 0, err[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
    evs = _events(events_a)
    first = next(e for e in evs if e["kind"] == "workers_started")
    assert first["warm"] == [True]
    ready = next(e for e in evs if e["kind"] == "spare_ready")
    (rec,) = [r for r in _records(out).values() if r["pid"] == first["pids"][0]]
    assert rec["warm"] is True and rec["env"]["TORCHELASTIC_RESTART_COUNT"] == "0"
    assert rec["pid"] == ready["pid"] and rec["world"] == 2


def test_module_mode_runs_as_python_dash_m(tmp_path):
    out, env = _setup(tmp_path)
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "probe.py").write_text(PROBE)
    proc = elastrun(
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "-m",
        "pkg.probe",
        "x",
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = _records(out)
    warm = recs["r1-0"]
    assert warm["warm"] is True  # (the first start may be cold)
    assert warm["argv"] == [str(pkg / "probe.py"), "x"]
    assert warm["path0"] == str(tmp_path) and warm["file"] == str(pkg / "probe.py")
    assert warm["spec"] == "pkg.probe" and warm["name"] == "__main__"


def test_a_warm_worker_failure_reads_like_the_scripts_own(tmp_path):
    out, env = _setup(tmp_path)
    env["PROBE_RAISE"] = "1"
    proc = elastrun(
        "--standalone", "--nproc-per-node=2", "--max-restarts=1", "probe.py", cwd=tmp_path, env=env
    )
    assert proc.returncode == 1
    assert _records(out)["r1-0"]["warm"] is True
    assert "ValueError: probe failure in the restarted worker" in proc.stderr
    assert 'probe.py", line' in proc.stderr
    assert "_spare.py" not in proc.stderr  # the spare's own frames are not shown
    assert "no restarts are left" in proc.stderr


SLEEPER = textwrap.dedent(
    """
    import time
    time.sleep(120)
    """
)


def test_spares_die_with_a_killed_agent(tmp_path):
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    events = tmp_path / "events.jsonl"
    agent = subprocess.Popen(
        [
            str(Path(sys.executable).with_name("elastrun")),
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=2",
            f"--events-file={events}",
            "sleeper.py",
        ],
        cwd=tmp_path,
        env=env_without_pet(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:

        def spares() -> list[int]:
            if not events.exists():
                return []
            return [e["pid"] for e in _events(events) if e["kind"] == "spare_started"]

        pids = wait_for(lambda: len(spares()) == 2 and spares(), 60, "two spares started")
        assert all(pid_alive(p) for p in pids)
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait(timeout=10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
            time.sleep(0.1)
        assert not any(pid_alive(p) for p in pids), "a spare outlived its SIGKILLed agent"
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait(timeout=10)


def _pool(script: Path, *args: str, preload: tuple[str, ...], sink: ListSink) -> SparePool:
    """A spare pool on its own (no agent) for one worker running ``script``."""
    spec = WorkerSpec(argv=(PYTHON, "-u", str(script), *args), nproc=1, run_id="spare-test")
    entry = python_entry(spec.argv)
    assert entry is not None
    return SparePool(spec, entry, sink, preload=preload)


def test_a_spare_still_importing_is_used_and_runs_the_script(tmp_path):
    # The pool on its own: a spare whose preload takes 3 s is needed at once,
    # by a script that imports the same module (a head start).
    (tmp_path / "slowmod.py").write_text("import time\ntime.sleep(3)\nLOADED = time.time()\n")
    script = tmp_path / "s.py"
    script.write_text(
        "import os, sys, time\n"
        "T0 = time.time()\n"
        "import slowmod\n"
        "print('RAN', slowmod.LOADED < T0, os.environ['RANK'], sys.argv[1:], flush=True)\n"
    )
    sink = ListSink()
    pool = _pool(script, "z", preload=("slowmod",), sink=sink)
    env = {**os.environ, "RANK": "0"}
    pool.replenish({0: env})
    popen = pool.take(0, {**env, "RANK": "5"})
    assert popen is not None
    try:
        out, err = popen.communicate(timeout=60)
    finally:
        asyncio.run(pool.close())
    assert popen.returncode == 0, err
    assert b"RAN True 5 ['z']" in out  # slowmod was loaded before the script ran
    (used,) = [e for e in sink.events if e["kind"] == "spare_used"]
    assert used["ready"] is False


def test_a_first_start_does_not_wait_for_a_spare_still_importing(tmp_path):
    # The same script, but a first start: it must not wait for the import
    # (a script failing on a mistyped argument fails at once).
    (tmp_path / "slowmod.py").write_text("import time\ntime.sleep(30)\n")
    script = tmp_path / "s.py"
    script.write_text("import slowmod\n")
    pool = _pool(script, preload=("slowmod",), sink=ListSink())
    assert pool.head_start is True
    pool.replenish({0: dict(os.environ)})
    try:
        (pid,) = pool.pids
        assert pool.take(0, dict(os.environ), restart=False) is None
        assert pool.pids == [pid] and pid_alive(pid)  # kept for a later start
    finally:
        asyncio.run(pool.close())


def test_a_spare_still_importing_is_kept_for_a_script_that_does_not_need_it(tmp_path):
    (tmp_path / "slowmod.py").write_text("import time\ntime.sleep(30)\n")
    script = tmp_path / "s.py"
    script.write_text("print('no slowmod here')\n")
    sink = ListSink()
    pool = _pool(script, preload=("slowmod",), sink=sink)
    assert pool.head_start is False
    pool.replenish({0: dict(os.environ)})
    try:
        (pid,) = pool.pids
        assert pool.take(0, dict(os.environ)) is None  # the worker starts cold, at once
        assert pool.pids == [pid] and pid_alive(pid)  # kept for a later start
    finally:
        asyncio.run(pool.close())
    assert not pid_alive(pid)
    assert not [e for e in sink.events if e["kind"] in ("spare_used", "spare_discarded")]


def test_a_spare_started_with_another_environment_is_not_used(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("print('ran')\n")
    sink = ListSink()
    pool = _pool(script, preload=(), sink=sink)
    env = {**os.environ, "RANK": "0", "OMP_NUM_THREADS": "1"}
    pool.replenish({0: env})
    spare_pid = pool.pids[0]
    try:
        assert pool.take(0, {**env, "OMP_NUM_THREADS": "8"}) is None
    finally:
        asyncio.run(pool.close())
    (gone,) = [e for e in sink.events if e["kind"] == "spare_discarded"]
    assert gone["reason"] == "started with a different OMP_NUM_THREADS"
    assert not pid_alive(spare_pid)
