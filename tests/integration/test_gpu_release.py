"""Restarts wait for the stopped workers' GPU memory (agent/gpu_release.py).

This machine has no GPU, so ``nvidia-smi`` is a stand-in put first on the
agent's ``PATH``: a script that answers ``--query-compute-apps`` as the real
one does, listing the pids in a file as holding 512 MiB for its first
``HOLD`` answers that name them (the driver freeing a dead process's memory
late), then nothing. Real agents, real worker processes: attempt 0's worker
writes its pid to that file and fails; the restart must wait until the
stand-in no longer lists it (or the bound), say so, and start the new worker
only then.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import textwrap
from pathlib import Path
from typing import Any

from tests.integration.test_cli import elastrun, env_without_pet

WORKER = textwrap.dedent(
    """
    import os, sys
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        with open(os.environ["HELD_FILE"], "a") as f:
            f.write(f"{os.getpid()}\\n")
        sys.exit(1)
    print("RESTARTED", os.getpid(), flush=True)
    """
)

STAND_IN = textwrap.dedent(
    """\
    #!{python}
    import os, sys
    assert sys.argv[1:] == ["--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
    path = os.environ["HELD_FILE"]
    held = open(path).read().split() if os.path.exists(path) else []
    calls = path + ".calls"
    n = len(open(calls).read()) if os.path.exists(calls) else 0
    if held:
        open(calls, "a").write("x")
    if held and n < int(os.environ["HOLD"]):
        for pid in held:
            print(f"{{pid}}, 512")
    print("99999999, 100")  # another user's process: never waited for
    """
)


def _run(tmp_path: Path, hold: int, **env: str) -> tuple[Any, list[dict[str, Any]], list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(STAND_IN.format(python=sys.executable))
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    (tmp_path / "w.py").write_text(WORKER)
    held = tmp_path / "held"
    run_env = {**env_without_pet(), "HELD_FILE": str(held), "HOLD": str(hold), **env}
    run_env["PATH"] = f"{bin_dir}{os.pathsep}{run_env.get('PATH', '')}"
    events = tmp_path / "events.jsonl"
    proc = elastrun(
        "--standalone",
        "--nproc-per-node=1",
        "--max-restarts=1",
        "--no-warm",
        f"--events-file={events}",
        "w.py",
        cwd=tmp_path,
        env=run_env,
    )
    evs = [json.loads(line) for line in events.read_text().splitlines()]
    return proc, evs, held.read_text().split()


def _kinds(evs: list[dict[str, Any]]) -> list[str]:
    return [e["kind"] for e in evs if e["kind"] in ("workers_started", "gpu_memory_wait")]


def test_a_restart_waits_until_the_dead_workers_gpu_memory_is_released(tmp_path: Path) -> None:
    proc, evs, held = _run(tmp_path, hold=3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (dead,) = held
    (wait,) = [e for e in evs if e["kind"] == "gpu_memory_wait"]
    assert wait["pids"] == [int(dead)] and wait["mib"] == 512
    assert wait["released"] is True and wait["timeout"] == 30.0
    # In order: the first workers, the wait, then the new worker.
    assert _kinds(evs) == ["workers_started", "gpu_memory_wait", "workers_started"]
    assert (
        "waiting up to 30s for the GPU memory of the stopped workers to be released "
        f"(pid {dead}: 512 MiB)" in proc.stderr
    )
    assert "GPU memory of the stopped workers released" in proc.stderr
    assert "RESTARTED" in proc.stdout
    # Asked until it no longer listed the dead worker: 3 answers naming it, then one without.
    assert len((tmp_path / "held.calls").read_text()) == 4


def test_the_wait_is_bounded_and_the_workers_start_anyway(tmp_path: Path) -> None:
    proc, evs, held = _run(tmp_path, hold=10**6, ELASTRUN_GPU_RELEASE_TIMEOUT="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wait,) = [e for e in evs if e["kind"] == "gpu_memory_wait"]
    assert wait["pids"] == [int(held[0])] and wait["released"] is False and wait["timeout"] == 1.0
    assert wait["waited_s"] >= 1.0
    assert (
        "GPU memory still held after 1s" in proc.stderr
        and "starting the new workers anyway" in proc.stderr
    )
    assert _kinds(evs) == ["workers_started", "gpu_memory_wait", "workers_started"]
    assert "RESTARTED" in proc.stdout


def test_no_wait_when_turned_off_or_nothing_is_held(tmp_path: Path) -> None:
    (tmp_path / "off").mkdir()
    (tmp_path / "free").mkdir()
    off, evs, _ = _run(tmp_path / "off", hold=10**6, ELASTRUN_GPU_RELEASE_TIMEOUT="0")
    assert off.returncode == 0 and "gpu_memory_wait" not in _kinds(evs), off.stderr[-2000:]
    free, evs, _ = _run(tmp_path / "free", hold=0)
    assert free.returncode == 0 and "gpu_memory_wait" not in _kinds(evs), free.stderr[-2000:]
    assert "GPU memory" not in free.stderr
