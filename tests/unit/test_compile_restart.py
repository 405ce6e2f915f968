"""The compile benchmark's arithmetic (bench/compile_restart.py), on made-up
worker events: which ranks kept their process and how many graphs each
process compiled after the kill."""

from __future__ import annotations

from typing import Any

from bench.compile_restart import RankAfter, outcome


def step(t: float, pid: int, rank: int, restart: int, compiles: int) -> dict[str, Any]:
    return {
        "ev": "step",
        "t": t,
        "pid": pid,
        "rank": rank,
        "restart": restart,
        "compiles": compiles,
    }


def setup(pid: int, seconds: float) -> dict[str, Any]:
    return {"ev": "setup", "t": 0.0, "pid": pid, "compiles": 1, "seconds": seconds}


def test_kept_and_new_processes_counted_apart() -> None:
    events = [
        setup(10, 4.0),
        setup(11, 5.0),
        step(1.0, 10, 0, 0, 1),
        step(1.0, 11, 1, 0, 1),
        {"ev": "kill", "t": 1.5, "pid": 11, "step": 1, "rank": 1},
        setup(12, 6.0) | {"t": 8.0},
        step(9.0, 10, 0, 1, 1),  # kept, compiled nothing more
        step(9.5, 12, 1, 1, 1),  # new: its own compilation counts
        step(10.0, 10, 0, 1, 2),  # kept, recompiled once later
    ]
    got = outcome("x", 0, events)
    assert got.ranks == (RankAfter(0, 10, True, 1), RankAfter(1, 12, False, 1))
    assert got.recovery_s == 9.5 - 1.5  # the slowest rank's first step after the kill
    assert got.setup_s == (6.0,)  # the processes started after the kill


def test_no_kill_no_recovery() -> None:
    got = outcome("x", None, [setup(10, 4.0), step(1.0, 10, 0, 0, 1)])
    assert got.recovery_s is None and got.ranks == ()
