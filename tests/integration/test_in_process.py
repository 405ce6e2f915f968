"""In-process restarts with a real agent and real torch workers (gloo on CPU).

examples/train.py --in-process --setup-seconds: three ranks, one SIGKILLed at
step 10 (its process is replaced), then one raising at step 20 (its process
is replaced too: an exception of its own makes it suspect). The survivors'
processes are kept: their pids never change, their setup is not done again
(``setup done`` is printed once per process), and the training resumes from
the memory checkpoint of the step it was at (no step redone).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import stop_groups
from tests.integration.elastic_harness import SCRIPTS

pytest.importorskip("torch")

BOUND = 240.0
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train.py"


def events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_example_keeps_the_survivors_processes(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    argv = [
        sys.executable,
        "-m",
        "elastrun",
        "--standalone",
        "--nproc-per-node=3",
        "--max-restarts=2",
        f"--events-file={log}",
        str(EXAMPLE),
        "--epochs=2",
        "--in-process",
        "--setup-seconds=1",
        "--memory-checkpoint",
        f"--checkpoint-dir={tmp_path / 'ckpt'}",
        "--crash-at-step=10",
        "--crash-how=sigkill",
        "--raise-at-step=20",
        "--log-every=5",
    ]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=BOUND)
    finally:
        stop_groups(proc)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    assert "final: epoch=2" in text

    evs = events(log)
    started = [e for e in evs if e["kind"] == "workers_started"]
    assert [e["round"] for e in started] == [0, 1, 2]
    pids = [dict(zip(e["ranks"], e["pids"], strict=True)) for e in started]
    # Round 1: rank 2 was SIGKILLed, ranks 0 and 1 kept their processes.
    assert pids[1][0] == pids[0][0] and pids[1][1] == pids[0][1]
    assert pids[1][2] != pids[0][2]
    # Round 2: rank 0 raised, its process replaced; ranks 1 and 2 kept theirs.
    assert pids[2][1] == pids[1][1] and pids[2][2] == pids[1][2]
    assert pids[2][0] != pids[1][0]
    kept = [e for e in evs if e["kind"] == "ranks_kept"]
    assert [(e["kept"], e["started"]) for e in kept] == [([0, 1], [2]), ([1, 2], [0])]
    left = [e for e in evs if e["kind"] == "ranks_left"]
    assert [(e["kept"], e["replaced"]) for e in left] == [([0, 1], [2]), ([1, 2], [0])]

    # The setup ran once per process: 3 first ones, then only the 2 replaced.
    # (the console's lines, "[host:local_rank]: ..."; not the failure summaries' quotes)
    setups = [int(p) for p in re.findall(r"^\[[^]]+\]: setup done: pid (\d+)", text, re.M)]
    assert sorted(setups) == sorted({*pids[0].values(), pids[1][2], pids[2][0]})

    # Each restart resumed at the step the failure happened at: none redone.
    resumed = re.findall(
        r"^\[[^]]+\]: => resumed: epoch=\d+ offset=\d+/\d+ global_step=(\d+)", text, re.M
    )
    assert resumed == ["10", "20"], text[-4000:]


def test_a_hung_rank_is_replaced_and_its_peers_kept(tmp_path: Path) -> None:
    """Rank 1 stops making progress outside any collective; the others wait
    for it in theirs. The watchdog declares the hang: rank 1 is stopped first,
    which ends its peers' collectives, and their processes are kept."""
    log = tmp_path / "events.jsonl"
    env = dict(
        os.environ,
        ELASTIC_TEST_DIR=str(tmp_path),
        INPROC_PLAN=json.dumps([{"rank": 1, "how": "hang", "step": 2}]),
        INPROC_STEPS="5",
    )
    argv = [
        sys.executable,
        "-m",
        "elastrun",
        "--standalone",
        "--nproc-per-node=3",
        "--max-restarts=1",
        "--hang-timeout=10",
        f"--events-file={log}",
        str(SCRIPTS / "inproc_worker.py"),
    ]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, env=env
    )
    try:
        out, _ = proc.communicate(timeout=BOUND)
    finally:
        stop_groups(proc)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    evs = events(log)
    assert any(e["kind"] == "hang_detected" for e in evs), text[-3000:]
    left = [e for e in evs if e["kind"] == "ranks_left"]
    assert [(e["kept"], e["replaced"]) for e in left] == [([0, 2], [1])], text[-3000:]
    started = [e for e in evs if e["kind"] == "workers_started"]
    before, after = (dict(zip(e["ranks"], e["pids"], strict=True)) for e in started)
    assert after[0] == before[0] and after[2] == before[2] and after[1] != before[1]
