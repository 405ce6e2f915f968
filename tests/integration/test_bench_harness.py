"""The benchmark harness is correct (not fast): it runs both launchers, parses
the workers' events, counts a launcher that fails as failed rather than
crashing, and writes the side-by-side table. Timings are not asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.harness import DEFAULT_CONFIGS, EventLog, all_ranks_time
from bench.report import RunResult, markdown, summarize
from bench.scenarios import catalogue, parse_simulated, select

from tests.conftest import REPO

TABLE_HEADER = "| scenario | metric | launcher | ok/runs | median | min | max | elastrun/torchrun |"


def test_event_log_reads_appended_and_partial_lines(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path)
    assert log.poll() == []
    with path.open("w") as f:
        f.write(json.dumps({"ev": "step", "t": 2.0, "rank": 1, "step": 1}) + "\n")
        f.write('{"ev": "step", "t": 1.0, "ra')
    assert len(log.poll()) == 1
    with path.open("a") as f:
        f.write('nk": 0, "step": 1}\n')
    assert len(log.poll()) == 2
    assert all_ranks_time(log.select("step"), 2) == 2.0
    assert all_ranks_time(log.select("step"), 3) is None
    assert log.select("step", after=1.5) == [{"ev": "step", "t": 2.0, "rank": 1, "step": 1}]


def test_failed_launcher_gets_rows_and_ratios_use_medians() -> None:
    scenarios = select(["cold_start"], quick=True)
    results = []
    for rep, value in enumerate([4.0, 6.0, 5.0]):
        for cfg in DEFAULT_CONFIGS:
            if cfg.launcher == "torchrun":
                metrics = {"workers_started": 1.0, "first_step": value, "exit": 1.0, "total": 9}
                results.append(RunResult(scenarios[0].name, cfg.name, rep, metrics))
            elif cfg.tuned:
                metrics = {"workers_started": 0.5, "first_step": value / 2}
                results.append(RunResult(scenarios[0].name, cfg.name, rep, metrics, "hung"))
            else:
                results.append(RunResult(scenarios[0].name, cfg.name, rep, error="unavailable"))
    rows = summarize(scenarios, DEFAULT_CONFIGS, results)
    first = {r.config: r for r in rows if r.metric == "first_step"}
    assert first["torchrun-default"].median == 5.0
    assert (first["torchrun-default"].min, first["torchrun-default"].max) == (4.0, 6.0)
    assert first["elastrun-default"].failures == 3
    assert first["elastrun-default"].median is None
    assert first["elastrun-tuned"].ratio == 0.5
    exits = {r.config: r for r in rows if r.metric == "exit"}
    assert exits["elastrun-tuned"].failures == 3
    assert exits["elastrun-tuned"].errors == ["hung"]
    text = markdown(scenarios, DEFAULT_CONFIGS, rows, [], {}, {"mode": "test"})
    assert TABLE_HEADER in text
    assert "| cold_start_np2 | first_step | elastrun-default | 0/3 (3 failed) |" in text
    tuned = "| cold_start_np2 | first_step | elastrun-tuned | 3/3 | 2.50 | 2.00 | 3.00 | 0.50x |"
    assert tuned in text
    assert "- cold_start_np2 / elastrun-default: unavailable" in text


def test_full_catalogue_covers_every_group() -> None:
    groups = {sc.group for sc in catalogue(quick=False)}
    assert groups == {
        "cold_start",
        "worker_crash",
        "scale_up",
        "node_loss",
        "partition",
        "rdzv_scale",
        "memory",
    }
    names = [sc.name for sc in catalogue(quick=False)]
    assert len(names) == len(set(names))


def _our_workers(folder: Path) -> list[int]:
    """Worker processes still alive whose environment points into ``folder``."""
    alive = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if f"BENCH_DIR={folder}".encode() in environ:
            alive.append(int(entry))
    return alive


def test_quick_bench_runs_both_launchers_side_by_side(tmp_path: Path) -> None:
    out = tmp_path / "results"
    # The tuned pair keeps this under ~90 s on a loaded 2-core machine;
    # `make bench-quick` runs all four configurations.
    cmd = [
        sys.executable,
        "-m",
        "bench",
        "--quick",
        "--launchers",
        "torchrun-tuned,elastrun-tuned",
        "--out",
        str(out),
    ]
    proc = subprocess.run(
        cmd,
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        start_new_session=True,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "results.json").read_text())
    table = (out / "results.md").read_text()
    assert TABLE_HEADER in table
    assert "Physical floor" in table
    assert "last_call_timeout=1" in table  # the rendezvous settings are printed

    rows = doc["summary"]
    for scenario in ("cold_start_np2", "worker_crash_np2"):
        for config in ("torchrun-tuned", "elastrun-tuned"):
            mine = [r for r in rows if r["scenario"] == scenario and r["config"] == config]
            assert mine, (scenario, config)
            assert all(r["runs"] == 1 for r in mine)
    # torchrun is the reference: its side must have worked and been parsed.
    torch_rows = {(r["scenario"], r["metric"]): r for r in rows if r["config"] == "torchrun-tuned"}
    for key in [
        ("cold_start_np2", "first_step"),
        ("cold_start_np2", "total"),
        ("worker_crash_np2", "resumed"),
    ]:
        row = torch_rows[key]
        assert row["failures"] == 0, (key, row["errors"])
        assert row["median"] > 0
    cold = torch_rows[("cold_start_np2", "first_step")]["median"]
    assert torch_rows[("cold_start_np2", "total")]["median"] > cold
    assert doc["floor"] and doc["floor"][0]["first_step"] > doc["floor"][0]["torch_imported"] > 0

    # The events were parsed from a real run: every kind is there, and the
    # restart after the worker kill shows in the restart count.
    run_dir = out / "runs" / "worker_crash_np2-torchrun-tuned-rep0"
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    kinds = {e["ev"] for e in events}
    assert {"start", "imported", "pg_ready", "resume", "step", "exit"} <= kinds
    assert {e["restart"] for e in events if e["ev"] == "step"} >= {0, 1}
    assert not _our_workers(out / "runs")


def test_simulated_rendezvous_table_is_parsed() -> None:
    out = (
        "rendezvous on the embedded store (4 processes, 1 reps)\n"
        " agents  rendezvous s (median) exit barrier s\n"
        "     64                  0.123           0.010\n"
        "   1024                  2.500           0.300\n"
    )
    rows = parse_simulated(out)
    assert rows == [
        {"participants": 64.0, "rendezvous_s": 0.123, "exit_barrier_s": 0.01},
        {"participants": 1024.0, "rendezvous_s": 2.5, "exit_barrier_s": 0.3},
    ]


def test_ratio_says_when_torchrun_never_got_there() -> None:
    scenarios = select(["cold_start"], quick=True)
    name = scenarios[0].name
    results = [
        RunResult(name, "torchrun-default", 0, error="timed out"),
        RunResult(name, "elastrun-default", 0, {"first_step": 2.0}),
    ]
    configs = DEFAULT_CONFIGS[:2]
    rows = summarize(scenarios, configs, results)
    text = markdown(scenarios, configs, rows, [], {}, {})
    assert "| elastrun-default | 1/1 | 2.00 | 2.00 | 2.00 | torchrun-default failed 1/1 |" in text
