"""The in-process restart benchmark's reading of a launcher's output
(bench/in_process_restart.py): recovery times from the fault's line to the
first step after it, the processes started after each fault, and rank 0's
pid; the worker output quoted in elastrun's failure summary is not counted."""

from __future__ import annotations

import argparse

from bench.in_process_restart import KILLED, RAISED, Line, Outcome, report

ARGS = argparse.Namespace(nproc=3, setup_seconds=3.0, crash_at_step=6, raise_at_step=14)


def outcome(name: str, prefix: str, kept: bool) -> Outcome:
    """A run: setups, the SIGKILL at step 6, a restart, the exception at step 14, a restart."""
    p = prefix
    lines = [
        (0.0, f"{p}setup done: pid 10 (3 s)"),
        (0.1, f"{p}setup done: pid 11 (3 s)"),
        (0.2, f"{p}setup done: pid 12 (3 s)"),
        (1.0, f"{p}=> start: world 3 restarts 0/3 run_id x pid 10"),
        (2.0, f"{p}epoch 0 step 6 offset 576/1437 loss 2.0"),
        (2.1, f"{p}[rank 2] injected failure at step 6: SIGKILL to itself"),
        (2.2, "    setup done: pid 12 (3 s)"),  # a failure summary's quote
        (2.3, "  said: epoch 0 step 7 offset 672/1437 loss 2.0"),
        (6.0, f"{p}setup done: pid 22 (3 s)"),
    ]
    if not kept:
        lines += [(6.1, f"{p}setup done: pid 20 (3 s)"), (6.2, f"{p}setup done: pid 21 (3 s)")]
    lines += [
        (7.0, f"{p}=> start: world 3 restarts 1/3 run_id x pid {10 if kept else 20}"),
        (7.6, f"{p}epoch 0 step 7 offset 672/1437 loss 2.0"),
        (9.0, f"{p}[rank 0] injected exception at step 14"),
        (9.1, "    [rank 0] injected exception at step 14"),
        (12.0, f"{p}setup done: pid 30 (3 s)"),
        (13.5, f"{p}epoch 0 step 15 loss 1.8 test_acc 0.5 samples/s 1 world 3 restarts 2"),
    ]
    return Outcome(name, [Line(t, text) for t, text in lines], 0)


def test_recovery_runs_from_the_fault_s_line_to_the_first_step_after_it() -> None:
    o = outcome("elastrun --in-process", "[vm:0]: ", kept=True)
    assert o.recovery(KILLED, 6) == 7.6 - 2.1
    assert o.recovery(RAISED, 14) == 13.5 - 9.0


def test_the_report_counts_new_processes_and_rank_0_s_pid_per_launcher() -> None:
    runs = [
        [outcome("torchrun", "", kept=False), outcome("elastrun --in-process", "[vm:0]: ", True)]
    ]
    text = report(runs, ARGS)
    runs_table, medians = text.split("\n\n")[2:4]
    rows = {ln.split("|")[1].strip(): ln for ln in runs_table.splitlines()[2:]}
    assert "| 3 of 3 | no |" in rows["torchrun"]
    assert "| 1 of 3 | yes |" in rows["elastrun --in-process"]
    assert "| 5.5 s (1.00x) |" in rows["torchrun"] and "| 4.5 s (1.00x) |" in rows["torchrun"]
    assert "| elastrun --in-process | 5.5 s (1.00x) | 4.5 s (1.00x) |" in medians


def test_a_fault_line_glued_to_another_worker_s_line_is_found() -> None:
    # torchrun's workers share one unprefixed output: rank 2's line may follow
    # rank 0's on the same line.
    o = Outcome(
        "torchrun",
        [
            Line(2.0, "epoch 0 step 6 offset 576/1437 loss 2.2[rank 2] injected failure at step 6"),
            Line(9.0, "epoch 0 step 7 offset 672/1437 loss 2.2"),
        ],
        0,
    )
    assert o.recovery(KILLED, 6) == 9.0 - 2.0
