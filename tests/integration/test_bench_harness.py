"""The benchmark harness is correct (not fast): it runs both launchers, parses
the workers' events, counts a launcher that fails as failed rather than
crashing, and writes the side-by-side table. Timings are not asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bench.configs import DEFAULT_CONFIGS
from bench.harness import WARM_MARK, EventLog, Run, all_ranks_time
from bench.paths import WORKER, BenchFailure
from bench.report import RunResult, markdown, summarize, wall_time
from bench.scenarios import GROUPS, catalogue, estimate, select
from bench.simulated import parse_simulated

from tests.conftest import REPO
from tests.helpers import SUITE_KNOBS

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
        "store_host_loss",
        "partition",
        "rdzv_scale",
        "memory",
        "scale_up_1to3",
        "node_loss_1to3",
        "worker_crash_floor",
        "spares",
        "spares_partition",
    }
    names = [sc.name for sc in catalogue(quick=False)]
    assert len(names) == len(set(names))
    # The full run makes every phase once: node loss includes the scale-up,
    # the 1:3 variants are asked for by name.
    full = [sc.name for sc in select(list(GROUPS), quick=False)]
    assert "node_loss_2to3" in full
    assert not [n for n in full if n.startswith("scale_up") or n.endswith("1to3")]
    assert [sc.name for sc in select(["node_loss_1to3"], quick=False)] == ["node_loss_1to3"]
    assert not [n for n in full if n.startswith("spare")]
    assert [sc.name for sc in select(["spares"], quick=False)] == [
        "spare_loss_2to3",
        "spare_agent_kill_2to3",
    ]


def test_every_scenario_has_an_estimate_and_the_report_shows_wall_time() -> None:
    scenarios = catalogue(quick=False)
    for sc in scenarios:
        assert {name for name, _ in sc.est_s} == {c.name for c in DEFAULT_CONFIGS}, sc.name
    est = estimate(select(["cold_start"], quick=True), DEFAULT_CONFIGS, reps=2)
    assert set(est) == {"cold_start"}
    assert est["cold_start"] == 2 * sum(s for _, s in scenarios[0].est_s)
    wall = wall_time({"floor": 6.0, **est}, {"floor": 5.0, "cold_start": 30.0}, {}, 40.0)
    assert wall["rows"][-1] == {"part": "other", "runs": 0, "estimated_s": None, "actual_s": 5.0}
    text = markdown([], DEFAULT_CONFIGS, [], [], {"wall_time": wall}, {})
    assert "## Wall time" in text
    assert "| cold_start | - |" in text
    assert "| 40 (0.7 min) |" in text


def test_wait_reports_a_run_without_worker_events_as_stuck(tmp_path: Path) -> None:
    run = Run(tmp_path / "run", {})
    # The stall bound (0.3 s) ends the wait, not its timeout (an hour)
    with pytest.raises(BenchFailure, match=r"stuck: no worker event for 0s \(bound\)"):
        run.wait("nothing", lambda _log: False, timeout=3600.0, stall=0.3)
    with pytest.raises(BenchFailure, match="timed out after 0s"):
        run.wait("nothing", lambda _log: False, timeout=0.2)
    run.cleanup()


def test_memory_keeps_warm_interpreters_apart(tmp_path: Path) -> None:
    """A warm interpreter (its command line names elastrun's _runner.py and the worker
    script) is summed into warm_rss, a helper into the agent tree, a worker
    in neither."""
    sleeper = "import time; time.sleep(60)"
    script = (
        "import subprocess, sys, time\n"
        f"spare = [sys.executable, '-c', {sleeper!r}, '/x/{WARM_MARK}', {str(WORKER)!r}]\n"
        f"helper = [sys.executable, '-c', {sleeper!r}, 'helper']\n"
        "procs = [subprocess.Popen(spare), subprocess.Popen(helper)]\n"
        "print(' '.join(str(p.pid) for p in procs), flush=True)\n"
        "time.sleep(60)\n"
    )
    run = Run(tmp_path / "run", {})
    try:
        agent = run.start_agent("agent", [sys.executable, "-c", script])
        run.track_memory(agent)
        deadline = time.monotonic() + 20
        while len(agent.log_tail(1).split()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        spare, helper = (int(p) for p in agent.log_tail(1).split())
        run.wait("both children sampled", lambda _log: helper in run.mem_pids, 20.0)
        run.wait("the spare sampled", lambda _log: spare in run.warm_pids, 20.0)
        assert agent.pid in run.mem_pids
        assert spare not in run.mem_pids
        assert run.warm_pids[spare] > 0
        assert not run.warm_settled()  # no torch mapped: still preloading
    finally:
        run.cleanup()


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


@pytest.mark.bench
@pytest.mark.timeout(960)
def test_quick_bench_runs_both_launchers_side_by_side(tmp_path: Path) -> None:
    # A whole benchmark (marked `bench`): `make soak` runs it, not `make test`, whose
    # tests may not depend on how busy the machine is (a benchmark's runs are bounded
    # in time). The harness's parts are tested above and below without running it.
    out = tmp_path / "results"
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
        timeout=900,
        start_new_session=True,
        # the launchers exactly as configured (not with the suite's defaults)
        env={k: v for k, v in os.environ.items() if k not in SUITE_KNOBS},
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
    # torchrun is the reference: its side must have worked and been parsed. A
    # torchrun worker may abort at exit under load (its own teardown race, which
    # elastrun's runner settles: docs/reliability.md); the harness must then
    # count the run as failed, with torchrun's report of the abort as the reason.
    torch_rows = {(r["scenario"], r["metric"]): r for r in rows if r["config"] == "torchrun-tuned"}
    keys = [
        ("cold_start_np2", "first_step"),
        ("cold_start_np2", "total"),
        ("worker_crash_np2", "resumed"),
    ]
    worked = {key: torch_rows[key]["failures"] == 0 for key in keys}
    for key in keys:
        row = torch_rows[key]
        if worked[key]:
            assert row["median"] > 0, (key, row)
        else:
            aborted = row["errors"] and all("SIGABRT" in e for e in row["errors"])
            assert row["failures"] == 1 and aborted, (key, row["errors"])
    assert any(worked.values()), torch_rows  # parsed at least once
    if worked[keys[0]] and worked[keys[1]]:
        cold = torch_rows[keys[0]]["median"]
        assert torch_rows[keys[1]]["median"] > cold
    assert doc["floor"] and doc["floor"][0]["first_step"] > doc["floor"][0]["torch_imported"] > 0

    # The events were parsed from a real run: every kind is there, and the
    # restart after the worker kill shows in the restart count.
    run_dir = out / "runs" / "worker_crash_np2-torchrun-tuned-rep0"
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    kinds = {e["ev"] for e in events}
    assert {"start", "imported", "pg_ready", "resume", "step"} <= kinds
    if worked[keys[2]]:
        assert "exit" in kinds
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


def test_memory_save_bench_prints_a_row_per_digest() -> None:
    out = subprocess.run(
        [
            *(sys.executable, "-m", "bench.memory_save", "--mib", "4", "--saves", "5"),
            *("--interval", "0.01", "--digests", "sha256-chunks,sha256"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    rows = [ln for ln in out.splitlines() if ln.startswith("| sha256")]
    assert [r.split(" | ")[0] for r in rows] == ["| sha256-chunks", "| sha256"], out
