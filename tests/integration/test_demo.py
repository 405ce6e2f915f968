"""``make demo`` end to end: ``examples/demo.py`` as the Makefile runs it, but for 4 epochs
instead of 6 (``--epochs 4``, as long as its memory-checkpoint run: the fault at step 75 is in
epoch 3 either way, and no assertion depends on the last two epochs).

Its second run, the same fault with memory checkpoints, must resume from the step the failure
interrupted: 0 steps redone, as the demo says and elastrun's goodput account agrees.

The demo's injected failure (rank 1 SIGKILLs itself at step 75, first attempt only) must lead to
an elastrun restart and a resume from the step-70 checkpoint, read from what a user sees: the
agent's event log and the output. A demo run in which nothing fails must say so and exit non-zero
(the demo checks its own story): that run is the undisturbed reference run of
tests/integration/test_example_elastic.py, checked there.

The memory-checkpoint run is also the end-to-end test of ``examples/train.py
--memory-checkpoint``: the disk checkpoints its agent wrote in the background are complete.
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

from elastrun.event_kinds import parse_event
from elastrun.worker.checkpoint_files import check, list_checkpoints
from tests.conftest import REPO

pytest.importorskip("torch")

DEMO = REPO / "examples" / "demo.py"


def run_demo(run_dir: Path, *extra: str, timeout: float = 360) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(DEMO), "--run-dir", str(run_dir), *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        check=False,
    )


def events(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            out.append(json.loads(line))
    # every line is an event of the catalogue (elastrun/event_kinds.py)
    assert [e for e in out if parse_event(e) is None] == []
    return out


@pytest.mark.timeout(420)
def test_demo_injected_kill_restarts_and_resumes_from_the_checkpoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "demo"
    done = run_demo(run_dir, "--epochs", "4")
    out = done.stdout
    assert done.returncode == 0, out[-4000:] + done.stderr[-2000:]

    # What the demo promises up front, and the command it shows, are what ran.
    assert "--max-restarts=1" in out
    assert "--crash-at-step 75 --crash-how sigkill" in out
    assert "[rank 1] injected failure at step 75: SIGKILL to itself" in out

    evs = events(run_dir / "events.jsonl")
    kinds = [e["kind"] for e in evs]
    started = [e for e in evs if e["kind"] == "workers_started"]
    assert [e["restart_count"] for e in started] == [0, 1], started
    # Rank 1 died of SIGKILL, which elastrun never sends first ...
    exits = [e for e in evs if e["kind"] == "worker_exited" and e["attempt"] == 0]
    assert [e["signal"] for e in exits if e["rank"] == 1] == ["SIGKILL"], exits
    # ... and one failure is the root cause: rank 1's, though rank 0's failure
    # (its all-reduce broken by rank 1's death) may reach the agent while the
    # kernel does not report rank 1's exit yet.
    roots = [e for e in evs if e["kind"] == "worker_exited" and e["cause"] == "root_cause"]
    assert len(roots) == 1, roots
    assert roots[0]["rank"] == 1 and not roots[0]["stopped_by_agent"], roots[0]
    assert roots[0]["pid"] in started[0]["pids"]
    # ... which costs the one restart of the budget ...
    restarts = [e for e in evs if e["kind"] == "restart"]
    assert len(restarts) == 1 and restarts[0]["counted"] and restarts[0]["count"] == 1, restarts
    assert restarts[0]["reason"] == "worker_failed"
    failure = restarts[0]["failure"]
    assert failure["rank"] == roots[0]["rank"], failure
    assert kinds.index("restart") < kinds.index("workers_started", kinds.index("restart"))
    # ... and the job then finishes.
    assert any(e["kind"] == "job_finished" and e["source"] == "agent" for e in evs)
    assert evs[-1]["kind"] == "agent_exited" and evs[-1]["exit_code"] == 0

    # The restarted workers agreed on the step-70 checkpoint (epoch 3) and resumed there.
    assert "=> using checkpoint from rank: 0, step: 70" in out
    m = re.search(
        r"=> resumed: epoch=(\d+) offset=(\d+)/1437 global_step=70 \(world 2, restart 1\)", out
    )
    assert m and int(m[1]) == 3, out[-4000:]
    assert out.index("injected failure") < m.start()
    steps_after = [int(s) for s in re.findall(r"epoch \d+ step (\d+) offset", out[m.end() :])]
    assert steps_after and steps_after[0] == 80, steps_after  # no step before 70 is redone

    final = re.search(r"final: epoch=4 test_acc=([0-9.]+) world=2 restarts=1", out)
    assert final and float(final[1]) >= 0.90, out[-2000:]
    # The checkpoints went where the demo said, not into the repository.
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("ckpt-*.pt"))

    # The demo's own summary tells the same story.
    summary = out[out.index("What happened") :]
    assert "rank 1 (pid" in summary
    assert "killed by SIGKILL: the root cause" in summary, summary
    assert "restart 1 of 1" in summary
    assert "resumed from the checkpoint of step 70" in summary and "5 steps redone" in summary
    assert f"finished: test accuracy {float(final[1]):.4f} after 4 epochs" in summary
    # ... and `elastrun timeline` drew it.
    assert f"timeline): {run_dir / 'timeline.html'}" in summary
    assert "<html" in (run_dir / "timeline.html").read_text(encoding="utf-8").lower()

    # Then the best path: the same fault with memory checkpoints redoes no step.
    best = summary[summary.index("The best path: memory checkpoints") :]
    assert "--memory-checkpoint" in best and "--epochs 4" in best
    assert "[rank 1] injected failure at step 75: SIGKILL to itself" in best
    assert "=> using memory checkpoint: step 75" in best, best[-4000:]
    assert "=> resumed: epoch=3 offset=384/1437 global_step=75 (world 2, restart 1)" in best
    steps_after = [int(s) for s in re.findall(r"epoch \d+ step (\d+) offset", best)]
    assert steps_after[-2:] == [80, 90], steps_after  # on from 75, none again
    mem = events(run_dir / "memory-events.jsonl")
    started = [e for e in mem if e["kind"] == "workers_started"]
    assert [e["restart_count"] for e in started] == [0, 1], started
    goodput = [e for e in mem if e["kind"] == "goodput"]
    assert [(e["steps_redone"], e["steps_known"], e["failures"]) for e in goodput] == [
        (0, True, 1)
    ], goodput
    told = best[best.index("What happened with memory checkpoints") :]
    assert (
        "resumed from step 75, held in memory by the agent: 0 steps redone "
        "(from the disk checkpoint: 5)" in told
    ), told
    assert "goodput account agrees: 0 steps redone" in told
    assert "final: epoch=4" in best and "did not go as expected" not in done.stderr
    # The disk checkpoints of the memory run were written by the agent (the workers only
    # copied into memory): the newest ones it kept, the last the final epoch end (92 steps),
    # each complete and verified.
    written = [e for e in mem if e["kind"] == "memory_checkpoint_persisted"]
    persisted = {e["step"] for e in written if e["local_rank"] == 0}
    infos = list_checkpoints(run_dir / "memory-checkpoints")
    assert infos and infos[-1].step == 4 * 23, [i.step for i in infos]
    assert {i.step for i in infos} <= persisted, (persisted, [i.step for i in infos])
    assert all(check(i, i.path.read_bytes()).status == "verified" for i in infos)
