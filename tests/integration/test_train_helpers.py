"""Training-script helpers with real processes: checkpoints, agreement over gloo, the example."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from elastrun.errors import ConfigError
from elastrun.train import WorkerContext, heartbeat, latest_checkpoint, list_checkpoints
from elastrun.train.heartbeat import _reset_for_tests
from elastrun.worker.checkpoint_files import check
from tests.conftest import PYTHON, REPO
from tests.helpers import (
    OPTIMIZER_MODULES,
    needs,
    plant_modules,
    run_ranks,
    stop_groups,
)

pytestmark = needs("torch")

TORCHRUN = Path(PYTHON).parent / "torchrun"


def _stop(proc: subprocess.Popen[str]) -> None:
    """Stop a process we started, and its session (workers of torchrun)."""
    stop_groups(proc, timeout=30)


def _run(cmd: list[str], timeout: float, **kw: object) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        **kw,  # type: ignore[call-overload]
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(proc)
        out, _ = proc.communicate()
        pytest.fail(f"{cmd} did not finish in {timeout}s; output:\n{out[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)


# -- context and heartbeat ----------------------------------------------------


def test_context_reads_the_torchrun_environment() -> None:
    env = {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "ROLE_NAME": "trainer",
        "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_MAX_RESTARTS": "3",
        "TORCHELASTIC_RUN_ID": "job-7",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29501",
    }
    ctx = WorkerContext.from_env(env)
    assert (ctx.rank, ctx.local_rank, ctx.world_size, ctx.local_world_size) == (5, 1, 8, 4)
    assert (ctx.group_rank, ctx.role, ctx.restart_count, ctx.max_restarts) == (
        1,
        "trainer",
        2,
        3,
    )
    assert (ctx.run_id, ctx.master_addr, ctx.master_port) == ("job-7", "10.0.0.1", 29501)
    assert ctx.launched and ctx.is_restart and not ctx.is_main
    alone = WorkerContext.from_env({})
    assert (alone.rank, alone.world_size, alone.launched, alone.is_main) == (0, 1, False, True)
    with pytest.raises(ConfigError, match="TORCHELASTIC_RESTART_COUNT"):
        WorkerContext.from_env({**env, "TORCHELASTIC_RESTART_COUNT": "x"})
    with pytest.raises(ConfigError, match="RANK=8"):
        WorkerContext.from_env({**env, "RANK": "8"})


def test_heartbeat_writes_step_and_monotonic_time_rate_limited(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hb = tmp_path / "hb.json"
    monkeypatch.delenv("ELASTRUN_HEARTBEAT_FILE", raising=False)
    _reset_for_tests()
    heartbeat(1)  # no launcher watchdog: a no-op
    assert not hb.exists()
    monkeypatch.setenv("ELASTRUN_HEARTBEAT_FILE", str(hb))
    _reset_for_tests()
    try:
        before = time.monotonic()
        heartbeat(7)
        first = json.loads(hb.read_text())
        assert first["step"] == 7 and first["pid"] == os.getpid() and first["v"] == 1
        assert before <= first["monotonic"] <= time.monotonic()
        for step in range(8, 1000):
            heartbeat(step)  # within the same second: not written
        assert json.loads(hb.read_text())["step"] == 7
        time.sleep(1.05)
        heartbeat(1000)
        assert json.loads(hb.read_text())["step"] == 1000
    finally:
        _reset_for_tests()


# -- atomic save under SIGKILL ------------------------------------------------

# One interpreter imports torch; each round, a child forked from it saves in a
# loop (its first line: its pid) until the test SIGKILLs it mid-save.
_SAVER = """
import os, sys, torch
from elastrun.train import save_checkpoint
d = sys.argv[1]
for line in sys.stdin:  # a round: the step to go on from
    step = int(line)
    child = os.fork()
    if child == 0:
        while True:
            step += 1
            state = {"step": step, "w": torch.full((3_000_000,), float(step))}
            save_checkpoint(state, d, step=step, keep=2)
            print(os.getpid(), step, flush=True)
    os.waitpid(child, 0)
    print("reaped", flush=True)
"""


def test_atomic_save_survives_sigkill_mid_save(tmp_path: Path) -> None:
    import torch

    from elastrun.train import load_checkpoint

    d = tmp_path / "ckpt"
    rng = random.Random()
    step = 0
    saver = subprocess.Popen(
        [PYTHON, "-c", _SAVER, str(d)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert saver.stdin is not None and saver.stdout is not None
    try:
        for _round in range(4):
            saver.stdin.write(f"{step}\n")
            saver.stdin.flush()
            first = saver.stdout.readline().split()  # one complete save in this round
            assert len(first) == 2, f"saver produced no checkpoint: {first}"
            time.sleep(rng.uniform(0.0, 0.4))
            os.kill(int(first[0]), signal.SIGKILL)
            while (line := saver.stdout.readline()) and line.strip() != "reaped":
                pass
            assert line.strip() == "reaped", "the saver did not reap its killed child"
            newest = latest_checkpoint(d)
            assert newest is not None and newest.step > step
            step = newest.step
            # `latest` names a complete checkpoint (it may lag one behind the newest)
            pointed = d / (d / "latest").read_text().strip()
            assert pointed.exists()
            for info in list_checkpoints(d):
                # record and data agree
                assert check(info, info.path.read_bytes()).status == "verified"
                st = torch.load(info.path, weights_only=True)
                assert st["step"] == info.step
                assert bool((st["w"] == float(info.step)).all())
            state = load_checkpoint(d, log=None)
            assert state is not None and state["step"] == step
    finally:
        _stop(saver)
    # a later successful save removes the dead savers' temp files and old checkpoints
    from elastrun.train import save_checkpoint

    save_checkpoint({"step": step + 1}, d, step=step + 1, keep=2)
    assert not [p for p in os.listdir(d) if p.endswith(".tmp")]
    assert [c.step for c in list_checkpoints(d)] == [step, step + 1]
    assert (d / "latest").read_text().strip() == f"ckpt-{step + 1:012d}.pt"


# -- agreement over gloo ------------------------------------------------------

_AGREE = """
import json, os, sys
from datetime import timedelta
import torch.distributed as dist
from elastrun.train import load_checkpoint
root = sys.argv[1]
dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
rank = dist.get_rank()
out = []
for phase, sub in (("first", "ckpt"), ("again", "ckpt"), ("empty", "none")):
    print(f"== phase {phase}", flush=True)
    state = load_checkpoint(os.path.join(root, f"rank{rank}", sub))
    out.append(None if state is None else {"step": state["step"], "w0": float(state["w"][0])})
print("RESULT " + json.dumps({"rank": rank, "out": out}), flush=True)
dist.destroy_process_group()
"""


def test_ranks_agree_on_newest_checkpoint_and_holder_broadcasts_it(tmp_path: Path) -> None:
    import torch

    from elastrun.train import save_checkpoint

    def save(rank: int, step: int) -> Path:
        return save_checkpoint(
            {"step": step, "w": torch.full((50_000,), float(step)), "note": f"from {rank}"},
            tmp_path / f"rank{rank}" / "ckpt",
            step=step,
        )

    save(0, 5)  # older
    save(1, 3)
    newest = save(1, 7)  # only rank 1 holds the newest
    (tmp_path / "rank2").mkdir()  # rank 2 holds nothing (a node that just joined)
    outs = run_ranks(_AGREE, 3, str(tmp_path))
    results = {}
    for out in outs:
        m = re.search(r"^RESULT (.*)$", out, re.M)
        assert m, out
        r = json.loads(m.group(1))
        results[r["rank"]] = r["out"]
    for rank in range(3):
        first, again, empty = results[rank]
        assert first == {"step": 7, "w0": 7.0}
        assert again == {"step": 7, "w0": 7.0}
        assert empty is None
        copy = tmp_path / f"rank{rank}" / "ckpt" / newest.name
        assert copy.read_bytes() == newest.read_bytes()
        assert (copy.parent / "latest").read_text().strip() == newest.name
    size = newest.stat().st_size
    first_phase = outs[0].split("== phase again")[0]
    assert "=> using checkpoint from rank: 1, step: 7" in first_phase
    assert f"=> checkpoint broadcast size is: {size} bytes" in first_phase
    # once everyone holds step 7, nothing is sent again
    again_phase = outs[0].split("== phase again")[1].split("== phase empty")[0]
    assert "using checkpoint from rank: 0, step: 7" in again_phase
    assert "broadcast" not in again_phase
    assert "no checkpoint on any rank" in outs[0].split("== phase empty")[1]


# -- the example under torchrun, then elastrun ---------------------------------


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed")
def test_example_trains_and_resumes_mid_epoch_at_another_world_size(tmp_path: Path) -> None:
    import torch

    ckpt = tmp_path / "checkpoints"
    common = [
        str(REPO / "examples" / "train.py"),
        "--checkpoint-dir",
        str(ckpt),
        "--checkpoint-every",
        "10",
        "--log-every",
        "0",
        "--epochs",
        "3",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    crash = ["--crash-at-step", "35"]
    # 1) two workers; the last rank fails at global step 35 (epoch 1, mid-epoch)
    crashed = _run(
        [str(TORCHRUN), "--standalone", "--nproc-per-node=2", *common, *crash],
        timeout=180,
        env=env,
    )
    assert crashed.returncode != 0, crashed.stdout[-3000:]
    assert "injected failure at step 35" in crashed.stdout
    assert re.search(r"^epoch 0 step 23 loss \S+ test_acc 0\.\d+", crashed.stdout, re.M)
    newest = latest_checkpoint(ckpt)
    assert newest is not None and newest.step == 30
    saved = torch.load(newest.path, weights_only=True)
    assert saved["sampler"]["epoch"] == 1 and saved["sampler"]["offset"] == 448  # 7 steps * 64

    # 2) restarted with three workers: continues epoch 1 at sample 448, then epoch 2. Under
    # elastrun (its workers fork from one warm interpreter: 3 fewer imports of torch than
    # torchrun's); the checkpoint torchrun's run left is what it resumes from. As on a
    # machine where the job ran before: its 3 workers (more than the 2 CPUs) are forked
    # once the warm interpreter imported what they import (once, not once per worker).
    cache = tmp_path / "cache"
    plant_modules(cache, os.getcwd(), common[0], [*common[1:], *crash], OPTIMIZER_MODULES)
    resumed = _run(
        [PYTHON, "-m", "elastrun", "--standalone", "--nproc-per-node=3", *common, *crash],
        timeout=180,
        env={**env, "ELASTRUN_CACHE_DIR": str(cache)},
    )
    out = re.sub(r"^\[[^\]\n]*\]: ", "", resumed.stdout, flags=re.M)  # elastrun's line prefix
    assert resumed.returncode == 0, out[-3000:]
    assert "=> using checkpoint from rank: 0, step: 30" in out
    assert "=> resumed: epoch=1 offset=448/1437 global_step=30 (world 3" in out
    assert "injected failure" not in out  # fault injection fires only in a fresh run
    epochs = [int(e) for e in re.findall(r"^epoch (\d+) step \d+ loss", out, re.M)]
    assert epochs == [1, 2]
    m = re.search(r"^final: epoch=(\d+) test_acc=(0\.\d+) world=3 restarts=0$", out, re.M)
    assert m, out[-3000:]
    assert int(m.group(1)) == 3
    assert float(m.group(2)) >= 0.85
    assert latest_checkpoint(ckpt) is not None
    last = torch.load(latest_checkpoint(ckpt).path, weights_only=True)  # type: ignore[union-attr]
    assert last["sampler"]["epoch"] == 3 and last["sampler"]["offset"] == 0
