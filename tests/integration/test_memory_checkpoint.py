"""Memory checkpoints with real agents and real torch workers (gloo on CPU).

A worker SIGKILLed after step N resumes from step N, taken from its agent's
shared memory (the workers have no checkpoint folder at all: nothing on disk
to read); with a folder, the agent writes every 5th step to disk in the
background, and those files load with ``load_checkpoint``; a worker
SIGKILLed in the middle of copying a large state leaves the previous
snapshots intact, and the ranks agree on the step before
(tests/integration/scripts/mem_worker.py).

``examples/train.py --memory-checkpoint`` end to end (a SIGKILLed rank, the resume from the
step it interrupted, the disk copies the agent wrote): the demo's memory-checkpoint run,
tests/integration/test_demo.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from elastrun.train import load_checkpoint
from elastrun.worker.checkpoint_files import check, list_checkpoints
from tests.helpers import finished, free_port, kill_group, needs, stop_groups, wait_for
from tests.integration.elastic_harness import SCRIPTS

torch = pytest.importorskip("torch")

BOUND = 120.0


def replay(steps: int, world: int = 2) -> float:
    w = 0.0
    c = sum(r + 1 for r in range(world))
    for s in range(1, steps + 1):
        w = w * 0.5 + c + s
    return w


def run_job(tmp_path: Path, env: dict[str, str]) -> tuple[str, list[dict[str, Any]]]:
    events = tmp_path / "events.jsonl"
    argv = [
        sys.executable,
        "-m",
        "elastrun",
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=1",
        f"--events-file={events}",
        str(SCRIPTS / "mem_worker.py"),
    ]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, **env},
        start_new_session=True,
    )
    text = finished(proc, BOUND)
    return text, [json.loads(line) for line in events.read_text().splitlines()]


def result(text: str) -> dict[str, Any]:
    (line,) = [ln for ln in text.splitlines() if "RESULT " in ln]
    return json.loads(line.split("RESULT ", 1)[1])  # type: ignore[no-any-return]


def loaded(text: str) -> list[dict[str, Any]]:
    """The workers' LOADED lines (not their repetition in a failure summary)."""
    lines = [ln for ln in text.splitlines() if re.match(r"^\[[^\]]+:\d+\]: LOADED ", ln)]
    return [json.loads(ln.split("LOADED ", 1)[1]) for ln in lines]


def test_a_killed_worker_resumes_from_its_agents_memory_without_a_disk_read(
    tmp_path: Path,
) -> None:
    text, events = run_job(tmp_path, {"MEM_STEPS": "20", "MEM_CRASH_AT": "13"})
    assert "SIGKILLs itself after step 13" in text
    res = result(text)
    # No checkpoint folder exists: step 13 can only have come from memory.
    assert res["restarts"] == 1 and res["resumed_from"] == 13, text[-3000:]
    assert res["step"] == 20 and res["w"] == replay(20)
    assert sorted((d["rank"], d["step"]) for d in loaded(text)) == [
        (0, 0),
        (0, 13),
        (1, 0),
        (1, 13),
    ]
    assert "=> using memory checkpoint: step 13" in text
    assert [e for e in events if e["kind"] == "restart"]
    assert not [e for e in events if e["kind"].startswith("memory_checkpoint_persist")]


def test_a_state_saved_by_rank_0_only_reaches_every_rank_from_memory(tmp_path: Path) -> None:
    text, _ = run_job(tmp_path, {"MEM_STEPS": "18", "MEM_CRASH_AT": "9", "MEM_SHARED": "1"})
    res = result(text)
    assert res["resumed_from"] == 9 and res["w"] == replay(18), text[-3000:]
    assert "=> using memory checkpoint: step 9 from rank 0's agent, sent to 1 rank(s)" in text
    restarted = sorted((d["rank"], d["step"]) for d in loaded(text) if d["step"] > 0)
    assert restarted == [(0, 9), (1, 9)]


def test_the_agent_writes_marked_steps_to_disk_in_the_background(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    env = {"MEM_STEPS": "23", "MEM_CRASH_AT": "13", "MEM_PERSIST": "5", "MEM_DIR": str(d)}
    text, events = run_job(tmp_path, env)
    res = result(text)
    assert res["resumed_from"] == 13 and res["w"] == replay(23), text[-3000:]  # not disk's 10
    persisted = [e for e in events if e["kind"] == "memory_checkpoint_persisted"]
    # Marked steps are written newest first: one marked while another is
    # written waits, and a newer one takes its place (the steps here take ms).
    written = [e["step"] for e in persisted]
    assert written == sorted(set(written)) and written[-1] == 20, written
    assert all(s % 5 == 0 for s in written) and all(e["local_rank"] == 0 for e in persisted)
    kept = [c.step for c in list_checkpoints(d)]
    assert kept == written[-3:]  # keep=3, pruned by the agent
    for info in list_checkpoints(d):
        assert check(info, info.path.read_bytes()).status == "verified"
        plain = torch.load(info.path, weights_only=True)  # a user's tools read it
        assert plain["step"] == info.step and plain["w"].shape == (256,)
    state = load_checkpoint(d, log=None)
    assert state is not None and state["step"] == 20 and float(state["w"][0]) == replay(20)
    assert (d / "latest").read_text().strip() == "ckpt-000000000020.pt"


def test_a_disk_write_that_fails_is_said_once_and_training_goes_on(tmp_path: Path) -> None:
    full = tmp_path / "full"
    full.mkdir()
    if os.system(f"mount -t tmpfs -o size=4k tmpfs {full} 2>/dev/null") != 0:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        with contextlib.suppress(OSError), open(full / "filler", "wb") as f:
            f.write(bytes(1 << 16))  # the disk is full
        env = {"MEM_STEPS": "12", "MEM_PERSIST": "3", "MEM_DIR": str(full)}
        text, events = run_job(tmp_path, env)
    finally:
        os.system(f"umount {full}")
    assert result(text)["step"] == 12
    failed = [e for e in events if e["kind"] == "memory_checkpoint_persist_failed"]
    assert failed and all(e["local_rank"] == 0 and e["step"] % 3 == 0 for e in failed), failed
    assert "No space left on device" in failed[0]["reason"]
    lines = [ln for ln in text.splitlines() if "could not be written to disk" in ln]
    assert len(lines) == 1 and "local rank 0" in lines[0], text[-2000:]
    assert not [e for e in events if e["kind"] == "memory_checkpoint_persisted"]


def test_a_worker_killed_mid_copy_leaves_the_previous_snapshot_intact(tmp_path: Path) -> None:
    env = {"MEM_STEPS": "16", "MEM_CRASH_AT": "11", "MEM_KILL_MID_COPY": "256"}
    text, _ = run_job(tmp_path, env)
    assert "SIGKILL mid-copy at step 12" in text, text[-3000:]
    res = result(text)
    assert res["resumed_from"] == 11 and res["w"] == replay(16), text[-3000:]
    restarted = [d for d in loaded(text) if d["step"] > 0]
    assert sorted(d["rank"] for d in restarted) == [0, 1]
    assert all(d["step"] == 11 for d in restarted)


@needs("lightning")  # the workers import it; this process need not
def test_lightning_resumes_from_rank_0s_memory_copy(tmp_path: Path) -> None:
    """MemoryCheckpointIO: a checkpoint every step (rank 0's memory copy, on
    disk every 5 steps); rank 1 SIGKILLed when step 7 starts; both ranks
    resume at step 7 (6 if rank 0's last commit was cut short) from memory,
    not from the disk copy of step 5, and the fit ends at max_steps."""
    argv = [
        sys.executable,
        "-m",
        "elastrun",
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=1",
        # Workers forked from a warm interpreter of torch alone: Lightning reads
        # LOCAL_RANK when it is imported, so a learned module list would start
        # per-rank warm interpreters at the restart (test_frameworks.py's subject),
        # a second import of Lightning per rank that this test has no use for.
        "--warm-modules=torch",
        str(SCRIPTS / "lightning_memory.py"),
        str(tmp_path),
        "--kill-at=7",
        "--max-steps=10",
        "--persist-every=5",
    ]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    text = finished(proc, BOUND)
    assert "SIGKILLs itself at step 7" in text
    fits = [json.loads(ln) for ln in (tmp_path / "fits.jsonl").read_text().splitlines()]
    assert sorted(f["rank"] for f in fits) == [0, 1] and all(f["restart"] == 1 for f in fits)
    starts = {f["start_step"] for f in fits}
    assert len(starts) == 1 and starts <= {6, 7}, fits
    assert all(f["end_step"] == 10 for f in fits)
    assert "from rank 0's agent, sent to 1 rank(s)" in text
    assert [c.step for c in list_checkpoints(tmp_path / "ckpt")][-1] in (5, 10)


def test_after_a_node_loss_survivors_and_a_replacement_resume_from_memory(
    tmp_path: Path,
) -> None:
    """Two agents of one worker each train a state that is the same on every
    rank (every rank saves; load(shared=True)); agent b is SIGKILLed with its
    worker: a's worker resumes at world 1 from its own memory copy; agent c
    then joins with nothing: it receives a's copy (no disk anywhere)."""
    port = free_port()
    progress = tmp_path / "progress.jsonl"
    env = {
        **os.environ,
        # 20 s of steps at least, for c to join before the end: few steps, each
        # slow (the steps' CPU, not their time, is what the suite pays)
        "MEM_STEPS": "200",
        "MEM_SHARED": "all",
        "MEM_STEP_DELAY": "0.1",
        "MEM_PROGRESS": str(progress),
    }
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs: dict[str, Path] = {}

    def start(name: str, host: bool) -> None:
        logs[name] = tmp_path / f"agent-{name}.log"
        argv = [
            sys.executable,
            "-m",
            "elastrun",
            "--nnodes=1:3",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=memloss",
            "--max-restarts=2",
            f"--rdzv-conf=last_call_timeout=1,lease_ttl=2,join_timeout=60,is_host={int(host)}",
            str(SCRIPTS / "mem_worker.py"),
        ]
        with open(logs[name], "wb") as log:
            procs[name] = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def records() -> list[dict[str, Any]]:
        if not progress.exists():
            return []
        out = []
        for line in progress.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
        return out

    try:
        start("a", True)
        start("b", False)
        wait_for(lambda: any(r["world"] == 2 and r["step"] >= 10 for r in records()), BOUND, "w2")
        killed_at = max(r["step"] for r in records())
        b_copies = Path("/dev/shm", f"elastrun-{os.geteuid()}", "memloss", str(procs["b"].pid))
        assert (b_copies / "local-0").is_dir()
        kill_group(procs["b"].pid)
        # b's orphan guard frees b's shared memory
        wait_for(lambda: not b_copies.exists(), BOUND, "b's copies removed")
        wait_for(lambda: any(r["world"] == 1 for r in records()), BOUND, "world 1")
        mark = len(records())
        start("c", False)  # a join is not counted as a restart
        wait_for(lambda: any(r["world"] == 2 for r in records()[mark:]), BOUND, "world 2 again")
        assert procs["a"].wait(BOUND) == 0 and procs["c"].wait(BOUND) == 0
    finally:
        stop_groups(*procs.values())
    text_a, text_c = logs["a"].read_text(), logs["c"].read_text()
    loads_a, loads_c = loaded(text_a), loaded(text_c)
    # a: world 2 from scratch, world 1 from its own memory, world 2 again with c
    assert [d["world"] for d in loads_a] == [2, 1, 2], loads_a
    assert loads_a[0]["step"] == 0 and loads_a[1]["step"] >= killed_at - 1, (killed_at, loads_a)
    assert loads_c and loads_c[0]["step"] == loads_a[2]["step"] > loads_a[1]["step"]
    assert "sent to 1 rank(s) without it" in text_a
    assert result(text_a)["step"] == 200
