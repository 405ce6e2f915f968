"""Goodput accounting and the metrics endpoint end to end: a real agent and
worker (torch), a crash that redoes 10 steps; ``elastrun status`` and the
agent's ``/metrics`` show the figures while the job runs, the agent's end
prints them in one line and its event log has them."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

from tests.helpers import free_port, stop_groups, wait_for
from tests.integration.elastic_harness import ELASTRUN, SCRIPTS

BOUND = 120.0  # generous: a loaded 2-core machine
RUN_ID = "goodput-e2e"


def status(port: int, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*ELASTRUN, "status", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", RUN_ID, *extra],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def figures(port: int) -> dict[str, Any] | None:
    proc = status(port, "--json")
    if proc.returncode != 0:
        return None
    found: dict[str, Any] | None = json.loads(proc.stdout).get("goodput")
    return found if found is not None and found["failures"] == 1 else None


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as answer:
        text = answer.read().decode()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def kinds(events: Path) -> set[str]:
    """The kinds of the events the agent has written so far."""
    found = set()
    for line in events.read_text().splitlines() if events.exists() else []:
        with contextlib.suppress(json.JSONDecodeError):
            found.add(json.loads(line)["kind"])
    return found


def test_a_crash_is_accounted_live_and_at_the_end(tmp_path: Path) -> None:
    port, metrics_port = free_port(), free_port()
    events = tmp_path / "events.jsonl"
    log = tmp_path / "agent.log"
    env = dict(os.environ, GOODPUT_DIR=str(tmp_path), PYTHONUNBUFFERED="1")
    args = [
        "--nnodes=1",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={RUN_ID}",
        "--rdzv-conf=is_host=1",
        "--max-restarts=3",
        f"--events-file={events}",
        f"--metrics-port={metrics_port}",
        str(SCRIPTS / "goodput_worker.py"),
    ]
    with open(log, "wb") as out:
        agent = subprocess.Popen(
            [*ELASTRUN, *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        wait_for((tmp_path / "crashed").exists, BOUND, "the crash")
        wait_for(lambda: "restart" in kinds(events), BOUND, "the restart in the event log")
        # Live: group rank 0's agent publishes its figures (every 5 s). Each look
        # is an `elastrun status` process (a Python start): once a second is enough.
        live = wait_for(lambda: figures(port), BOUND, "status showing the restart's cost", 1.0)
        assert live["seconds"]["restart"] > 0 and 0 < live["goodput"] < 1, live
        table = status(port)
        assert table.returncode == 0, table.stderr
        assert "goodput   " in table.stdout and "lost to: " in table.stdout, table.stdout
        # The agent's metrics say the same (loopback, the port given).
        m = scrape(metrics_port)
        assert m['elastrun_restarts_total{reason="worker_failed",counted="true"}'] == 1, m
        assert m['elastrun_worker_failures_total{cause="root_cause"}'] == 1, m
        assert m["elastrun_recovery_seconds_count"] == 1 and m["elastrun_round"] >= 1, m
        assert 0 < m["elastrun_goodput_ratio"] < 1 and m["elastrun_steps_redone"] == 10, m
        assert m["elastrun_step_rate"] > 0 and m['elastrun_goodput_seconds{cause="restart"}'] > 0
        # The crashed worker's 5 memory checkpoint saves at least (steps 10 to
        # 50, the model's 5 floats each), and the time they kept it waiting.
        assert m["elastrun_memory_checkpoint_saves_total"] >= 5, m
        assert m["elastrun_memory_checkpoint_save_bytes_total"] >= 5 * 5 * 4, m
        assert m["elastrun_memory_checkpoint_save_blocked_seconds_total"] > 0, m
        (tmp_path / "finish").touch()
        assert agent.wait(BOUND) == 0, log.read_text()[-3000:]
    finally:
        stop_groups(agent)
    lines = [json.loads(x) for x in events.read_text().splitlines()]
    final = [e for e in lines if e["kind"] == "goodput"]
    assert len(final) == 1, final
    g = final[0]
    # Resumed from the checkpoint of step 40 after reaching step 50.
    assert (g["failures"], g["steps_redone"], g["steps_known"], g["hangs"]) == (1, 10, True, 0)
    assert g["seconds"]["redone"] > 0 and g["seconds"]["saves"] > 0, g
    assert 0 < g["goodput"] < 1, g
    assert "elastrun: goodput " in log.read_text()
    assert "1 failure cost " in log.read_text() and "(10 steps redone)" in log.read_text()
