"""Warm starts (agent/warm.py): workers forked from a warm interpreter that
already imported torch (and what the script imported last time), which the
training script cannot tell from a cold start, except that its imports are
instant.

Real ``elastrun`` processes, real gloo workers, loopback only.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from elastrun.agent.warm_pool import ROUND_VARS
from tests.conftest import PYTHON
from tests.helpers import WARM_ENV, free_port, pid_alive, stop_groups, wait_for
from tests.integration.test_cli import ELASTRUN, RUN_TIMEOUT, elastrun, env_without_pet

# Records what a worker sees, all-reduces over gloo, and fails once (rank 1 of
# the first attempt) so that the job restarts. PROBE_PLAIN: only what the script
# sees of its own start, without torch (the plain run's share of the comparison).
PROBE = textwrap.dedent(
    """
    import json, os, sys, time
    warm = "torch" in sys.modules            # before the script imports anything
    plain = bool(os.environ.get("PROBE_PLAIN"))
    if not plain:
        import torch
        import torch.distributed as dist

    rc, rank = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["RANK"]
    if not plain:
        dist.init_process_group("gloo")
        t = torch.tensor([1.0])
        dist.all_reduce(t)
    rec = dict(warm=warm, argv=sys.argv, path0=sys.path[0], file=__file__, name=__name__,
               spec=None if __spec__ is None else __spec__.name, env=dict(os.environ),
               pid=os.getpid(), ppid=os.getppid(), stdin_tty=os.isatty(0),
               stdin=os.read(0, 10).decode(), sid=os.getsid(0), pgid=os.getpgid(0))
    if not plain:
        rec.update(world=dist.get_world_size(), sum=t.item())
    out = os.environ["PROBE_OUT"]
    with open(os.path.join(out, f"r{rc}-{rank}.json"), "w") as f:
        json.dump(rec, f)
    if plain:
        sys.exit(0)
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
    env = {**env_without_pet(), **WARM_ENV}  # (a cold run says --no-warm)
    env["PROBE_OUT"] = str(out)
    return out, env


def _records(out: Path) -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}


def _events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _probe_run(
    tmp_path: Path, *flags: str, extra_env: dict[str, str] | None = None
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]], str]:
    out, env = _setup(tmp_path)
    env.update(extra_env or {})
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
    return recs, _events(events), proc.stderr


def _plain_run(tmp_path: Path) -> dict[str, Any]:
    """The probe run by plain ``python -u probe.py a --b=c``: what it sees of
    its own start (``argv``, ``__file__``, ``sys.path[0]``, ``__name__``,
    ``__spec__``, stdin), not torch's (``PROBE_PLAIN``: nothing of it is
    compared)."""
    out, env = _setup(tmp_path)
    env.update(RANK="0", TORCHELASTIC_RESTART_COUNT="0", PROBE_PLAIN="1")
    subprocess.run(
        [PYTHON, "-u", "probe.py", "a", "--b=c"],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        check=True,
        timeout=RUN_TIMEOUT,
    )
    return _records(out)["r0-0"]


def _rel(value: Any, root: Path) -> Any:
    """Paths under a run's folder, made comparable between two runs."""
    if isinstance(value, str):
        return value.replace(str(root.resolve()), "ROOT").replace(str(root), "ROOT")
    return value


def test_warm_workers_see_what_cold_workers_see(tmp_path):
    plain_dir, cold_dir, warm_dir = tmp_path / "plain", tmp_path / "cold", tmp_path / "warm"
    for d in (plain_dir, cold_dir, warm_dir):
        d.mkdir()
    plain = _plain_run(plain_dir)
    cold_recs, cold_events, _ = _probe_run(cold_dir, "--no-warm")
    warm_recs, events, _ = _probe_run(warm_dir)
    assert not [e for e in cold_events if e["kind"].startswith("warm_")]
    for name, cold in cold_recs.items():
        warm = warm_recs[name]
        assert cold["warm"] is False, name
        # Restarts are forked from the warm interpreter, torch already imported
        # (the first start is forked at once, between two of its imports).
        if name.startswith("r1-"):
            assert warm["warm"] is True, f"{name} started cold"
        # What python -u probe.py sees, through elastrun's runner, cold or warm.
        for key in ("argv", "file", "path0", "name", "spec", "stdin", "stdin_tty"):
            assert _rel(cold[key], cold_dir) == _rel(plain[key], plain_dir), (name, key)
            assert _rel(warm[key], warm_dir) == _rel(cold[key], cold_dir), (name, key)
        for key in ("world", "sum"):
            assert warm[key] == cold[key], (name, key)
        assert warm["argv"] == ["probe.py", "a", "--b=c"]
        assert warm["name"] == "__main__" and warm["stdin"] == ""  # /dev/null, not a socket
        # Every worker leads its own session and process group.
        assert warm["sid"] == warm["pid"] == warm["pgid"]
        # The same environment, but for the variables that change per round.
        assert set(warm["env"]) == set(cold["env"])
        # (none of the runner's own variables reach the script)
        assert not [k for k in warm["env"] if k.startswith(("ELASTRUN_RUNNER", "ELASTRUN_CHANNEL"))]
        assert not [k for k in warm["env"] if k.startswith(("ELASTRUN_PRELOAD", "ELASTRUN_MODULE"))]
        changed = {
            k
            for k in cold["env"]
            if _rel(warm["env"][k], warm_dir) != _rel(cold["env"][k], cold_dir)
        }
        # (--standalone draws a new run id for every run, as torchrun does.)
        assert changed <= ROUND_VARS | {"TORCHELASTIC_RUN_ID"}, changed - ROUND_VARS
    assert warm_recs["r1-1"]["env"]["TORCHELASTIC_RESTART_COUNT"] == "1"
    used = {e["pid"] for e in events if e["kind"] == "warm_used"}
    assert used == {r["pid"] for r in warm_recs.values()}
    # One warm interpreter serves every start; a forked worker is the agent's child.
    (zygote,) = [e["pid"] for e in events if e["kind"] == "warm_started"]
    assert {e["zygote"] for e in events if e["kind"] == "warm_used"} == {zygote}
    agent_pid = warm_recs["r1-0"]["ppid"]
    assert all(r["ppid"] == agent_pid for r in warm_recs.values())
    # After the restart none is left: the zygote is let go, and dies with the agent.
    gone = [e["reason"] for e in events if e["kind"] == "warm_discarded"]
    assert gone == ["no restart is possible"]
    assert not pid_alive(zygote), "the warm interpreter outlived the agent"


def test_the_first_workers_are_forked_from_a_zygote_ready_during_the_rendezvous(tmp_path):
    # Agent A waits in the rendezvous for B; its zygote imports torch meanwhile.
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
        "--rdzv-id=warm-first",
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
            lambda: events_a.exists() and any(e["kind"] == "warm_ready" for e in _events(events_a)),
            90,
            "agent A's warm interpreter ready",
        )
        procs.append(agent(events_b, conf + "0"))
        for p in procs:
            _, err = p.communicate(timeout=RUN_TIMEOUT)
            assert p.returncode == 0, err[-3000:]
    finally:
        stop_groups(*procs)
    evs = _events(events_a)
    first = next(e for e in evs if e["kind"] == "workers_started")
    assert first["warm"] == [True]
    ready = next(e for e in evs if e["kind"] == "warm_ready")
    used = next(e for e in evs if e["kind"] == "warm_used")
    # It was ready before the start used it: the start did not wait for it.
    assert used["zygote"] == ready["pid"] and evs.index(ready) < evs.index(used)
    (rec,) = [r for r in _records(out).values() if r["pid"] == first["pids"][0]]
    assert rec["warm"] is True and rec["env"]["TORCHELASTIC_RESTART_COUNT"] == "0"
    assert rec["world"] == 2


@pytest.fixture(scope="module")
def module_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One job for two tests: ``-m pkg.probe x`` with ``--virtual-local-rank``
    and ``CUDA_VISIBLE_DEVICES=5,7`` (each flag changes nothing the other's
    test reads): the records of its 2 ranks over 2 attempts, its events."""
    tmp_path = tmp_path_factory.mktemp("module-run")
    out, env = _setup(tmp_path)
    env["CUDA_VISIBLE_DEVICES"] = "5,7"
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "probe.py").write_text(PROBE)
    events = tmp_path / "events.jsonl"
    proc = elastrun(
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "--virtual-local-rank",
        f"--events-file={events}",
        "-m",
        "pkg.probe",
        "x",
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = _records(out)
    assert set(recs) == {"r0-0", "r0-1", "r1-0", "r1-1"}
    return {"dir": tmp_path, "recs": recs, "events": _events(events)}


def test_module_mode_runs_as_python_dash_m(module_run: dict[str, Any]) -> None:
    tmp_path, pkg = module_run["dir"], module_run["dir"] / "pkg"
    warm = module_run["recs"]["r1-0"]
    assert warm["warm"] is True  # (the first start may be cold)
    assert warm["argv"] == [str(pkg / "probe.py"), "x"]
    assert warm["path0"] == str(tmp_path) and warm["file"] == str(pkg / "probe.py")
    assert warm["spec"] == "pkg.probe" and warm["name"] == "__main__"


def test_virtual_local_rank_restarts_warm_with_each_ranks_device(
    module_run: dict[str, Any],
) -> None:
    """--virtual-local-rank gives each local rank its own CUDA_VISIBLE_DEVICES:
    set when the worker is forked (the warm interpreter never reads it), so the
    restart is forked warm, and every worker sees what torchrun gives it."""
    recs, events = module_run["recs"], module_run["events"]
    for name, rec in recs.items():
        local = int(rec["env"]["RANK"])  # one node: the rank is the local rank
        assert rec["env"]["LOCAL_RANK"] == "0", name
        assert rec["env"]["CUDA_VISIBLE_DEVICES"] == ("5", "7")[local], name
        if name.startswith("r1-"):
            assert rec["warm"] is True, f"{name} started cold"
    used = {e["pid"] for e in events if e["kind"] == "warm_used"}
    assert used == {r["pid"] for r in recs.values()}
    # One warm interpreter, without the device variable, served both ranks.
    (zygote,) = [e["pid"] for e in events if e["kind"] == "warm_started"]
    assert {e["zygote"] for e in events if e["kind"] == "warm_used"} == {zygote}
    gone = [e["reason"] for e in events if e["kind"] == "warm_discarded"]
    assert gone == ["no restart is possible"]


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
    # The runner's and the zygote's own frames are not shown.
    assert "_runner.py" not in proc.stderr and "_zygote.py" not in proc.stderr
    assert "no restarts are left" in proc.stderr


SLEEPER = textwrap.dedent(
    """
    import os, sys, time
    import torch
    # A child of the worker that outlives it, in the worker's session.
    orphan = os.fork()
    if orphan == 0:
        time.sleep(120)
        os._exit(0)
    rc = os.environ["TORCHELASTIC_RESTART_COUNT"]
    with open(os.path.join(os.environ["OUT"], f"{rc}-{os.getpid()}.pid"), "w") as f:
        f.write(f"{os.getppid()} {orphan}")
    if rc == "0" and os.environ["RANK"] == "1" and os.environ.get("FAIL_FIRST"):
        time.sleep(1)
        sys.exit(3)
    time.sleep(float(os.environ.get("WORKER_S", "120")))
    """
)


def test_the_zygote_and_forked_workers_die_with_a_killed_agent(tmp_path):
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    events = tmp_path / "events.jsonl"
    env = {**env_without_pet(), **WARM_ENV, "OUT": str(tmp_path)}
    agent = subprocess.Popen(
        [
            ELASTRUN,
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=2",
            f"--events-file={events}",
            "sleeper.py",
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:

        def started(kind: str) -> list[int]:
            if not events.exists():
                return []
            return [e["pid"] for e in _events(events) if e["kind"] == kind]

        wait_for(lambda: started("warm_ready"), 90, "the warm interpreter ready")
        wait_for(lambda: len(list(tmp_path.glob("*.pid"))) == 2, 90, "two workers running")
        workers = [int(p.stem.split("-")[1]) for p in tmp_path.glob("*.pid")]
        orphans = [int(p.read_text().split()[1]) for p in tmp_path.glob("*.pid")]
        pids = [*started("warm_started"), *workers, *orphans]
        assert all(pid_alive(p) for p in pids)
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait(timeout=10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
            time.sleep(0.1)
        assert not [p for p in pids if pid_alive(p)], "outlived its SIGKILLed agent"
    finally:
        stop_groups(agent)


def _zombie_children(pid: int) -> list[str]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        for child in Path(f"/proc/{pid}/task/{tid}/children").read_text().split():
            stat = Path(f"/proc/{child}/stat").read_text()
            if stat.rsplit(")", 1)[1].split()[0] == "Z":
                out.append(f"{stat.split()[0]} {Path(f'/proc/{child}/cmdline').read_bytes()!r}")
    return out


def test_orphans_of_forked_workers_are_reaped(tmp_path):
    # A forked worker is the agent's child because the agent is a child
    # subreaper; the orphans of its workers come to the agent too: the failed
    # attempt's are killed with their worker's process group and reaped.
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    env = {**env_without_pet(), **WARM_ENV, "OUT": str(tmp_path), "FAIL_FIRST": "1"}
    env["WORKER_S"] = "8"
    agent = subprocess.Popen(
        [ELASTRUN, "--standalone", "--nproc-per-node=2", "--max-restarts=1", "sleeper.py"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        wait_for(lambda: len(list(tmp_path.glob("1-*.pid"))) == 2, 120, "restarted workers")
        first = [p.read_text().split() for p in tmp_path.glob("0-*.pid")]
        assert len(first) == 2 and {int(ppid) for ppid, _ in first} == {agent.pid}
        orphans = [int(o) for _, o in first]
        # Killed and reaped: not even a zombie is left of them (bounded wait).
        wait_for(
            lambda: not any(Path(f"/proc/{o}").exists() for o in orphans),
            30,
            "the old orphans killed and reaped",
        )
        assert agent.poll() is None
        assert _zombie_children(agent.pid) == []
    finally:
        stop_groups(agent)
