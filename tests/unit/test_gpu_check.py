"""The GPU check script's CPU side (bench/gpu_check.py): its arguments, the
runs it plans, what it reads from a run, and its table. The runs themselves
need GPUs (docs/benchmarks.md, *GPUs*)."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench.gpu_check import (
    CHECKS,
    EXAMPLE,
    WORKER,
    Row,
    Run,
    parse_args,
    plan,
    records,
    render_table,
    restart_gap,
    summarize,
)


def test_the_defaults_run_every_check_at_1_and_10_gib_one_worker_per_gpu():
    ns = parse_args([])
    assert ns.checks == CHECKS and ns.sizes == (1.0, 10.0) and ns.nproc == "gpu"
    runs = plan(ns, Path("/out"))
    assert [(r.check, r.setting) for r in runs] == [
        ("example", "1 epoch"),
        ("memckpt", "1 GiB per rank"),
        ("memckpt", "10 GiB per rank"),
        ("warm", "warm"),
        ("warm", "no-warm"),
        ("peer", "SIGKILL in all_reduce"),
    ]
    for r in runs:
        assert r.args[:3] == ("--standalone", "--nproc-per-node=gpu", "--max-restarts=1")
    example = runs[0].args
    assert str(EXAMPLE) in example and "--device" in example and "cuda" in example
    assert runs[2].env["GPUCHECK_GB"] == "10.0" and str(WORKER) in runs[2].args
    assert "--no-warm" in runs[4].args and "--crash-how=sigkill" in runs[4].args
    # Each run its own folder, and the example's checkpoints in it: never a previous run's.
    assert len({r.folder for r in runs}) == len(runs)
    assert f"--checkpoint-dir={runs[3].folder / 'ckpt'}" in runs[3].args


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sizes=0"], "sizes must be in"),
        (["--sizes=ten"], "not a list of GiB"),
        (["--checks=example,fast"], "unknown check fast"),
        (["--nproc=two"], "--nproc must be"),
        (["--steps=4", "--kill-at=3"], "--kill-at must be in"),
        (["--device=tpu"], "invalid choice"),
    ],
)
def test_bad_arguments_are_refused_with_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_a_cpu_dry_run_plans_the_same_with_gloo():
    ns = parse_args(["--device=cpu", "--checks=memckpt", "--sizes=0.01", "--nproc=2"])
    runs = plan(ns, Path("/out"))
    (run,) = runs
    assert run.env["GPUCHECK_DEVICE"] == "cpu" and run.args[1] == "--nproc-per-node=2"


def test_records_and_the_restart_gap_are_read_from_a_run():
    out = (
        'noise\n[host:1]: GPUCHECK {"attempt": 0, "rank": 1}\n'
        'GPUCHECK {"attempt": 1, "rank": 0}\nGPUCHECK not json\n'
    )
    assert records(out) == [{"attempt": 0, "rank": 1}, {"attempt": 1, "rank": 0}]
    events = [
        {"kind": "workers_started", "ts": 10.0},
        {"kind": "worker_exited", "ts": 12.0},
        {"kind": "workers_started", "ts": 13.25},
    ]
    assert restart_gap(events) == 1.25
    assert restart_gap(events[:1]) is None


def test_rows_say_what_happened():
    run = Run("memckpt", "1 GiB per rank", (), {"GPUCHECK_KILL_AT": "3"})
    times = [{"save_blocked_median_s": 0.2, "commit_median_s": 0.5}]
    times += [{"save_blocked_median_s": 0.3, "commit_median_s": 0.4}]
    recs = [
        {"attempt": 1, "rank": 0, "load_s": 1.5, "first_step": 4, "in_memory": True, **times[0]},
        {"attempt": 1, "rank": 1, "load_s": 1.7, "first_step": 4, "in_memory": True, **times[1]},
    ]
    recs[0]["first_step_at"], recs[1]["first_step_at"] = 105.5, 106.0
    row = summarize(run, 0, recs, 2.0, 100.0)
    assert row.result == "ok"
    assert row.numbers == (
        "death to workers started 2.00 s; death to first step 6.00 s; "
        "save blocked 0.300 s (median; slowest rank); commit 0.500 s; "
        "load 1.700 s; resumed at step 4"
    )
    assert summarize(run, None, [], None).result == "timed out"
    assert summarize(run, 1, [], None).result == "failed (exit 1)"
    disk = [recs[0], {**recs[1], "in_memory": False}]
    assert summarize(run, 0, disk, None).result == "fell back to disk"
    # The ranks found no common step and started again: not what the check wants.
    again = [{**r, "first_step": 0} for r in recs]
    assert summarize(run, 0, again, None).result == "resumed at [0], not 4"
    peer = Run("peer", "SIGKILL in all_reduce", ())
    assert summarize(peer, 0, [{"attempt": 0}], 1.0).result == "no restart finished"


def test_the_table_is_markdown_one_row_per_run():
    table = render_table([Row("example", "1 epoch", "ok", "wall 9.0 s"), Row("peer", "x|y", "ok")])
    assert table.splitlines() == [
        "| check | setting | result | numbers |",
        "|---|---|---|---|",
        "| example | 1 epoch | ok | wall 9.0 s |",
        "| peer | x/y | ok | - |",
    ]
