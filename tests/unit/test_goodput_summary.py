"""The goodput benchmark's arithmetic (bench/goodput.py), on made-up events:
steps redone per failure, the time blocked per checkpoint and the step time."""

from __future__ import annotations

from bench.goodput import summarize


def _step(step: int, t: float, blocked: float = 0.001, rank: int = 0) -> dict[str, object]:
    return {
        "ev": "step",
        "step": step,
        "rank": rank,
        "t": t,
        "compute": 0.01,
        "blocked": blocked,
        "saved": True,
    }


def test_steps_redone_are_counted_from_the_newest_step_before_each_kill() -> None:
    events = [_step(s, 100 + s * 0.05) for s in range(1, 41)]
    events.append({"ev": "resume", "step": 30, "rank": 0, "restart": 1, "t": 103.0, "pid": 1})
    events += [_step(s, 104 + s * 0.05) for s in range(31, 61)]
    events.append({"ev": "resume", "step": 60, "rank": 0, "restart": 2, "t": 110.0, "pid": 2})
    out = summarize(events, [(102.5, 40), (109.0, 60)])
    assert out["steps_redone"] == [10, 0]
    assert out["final_step"] == 60 and out["failures"] == 2 and out["resumed"] == 2
    assert abs(out["step_s"] - 0.05) < 1e-9 and abs(out["blocked_s"] - 0.001) < 1e-12


def test_a_kill_whose_restart_never_came_counts_no_redone_steps() -> None:
    events = [_step(s, 100 + s) for s in range(1, 5)]
    out = summarize(events, [(104.5, 4)])
    assert out["failures"] == 1 and out["steps_redone"] == [] and out["resumed"] == 0
