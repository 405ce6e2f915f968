"""The goodput benchmark's arithmetic (bench/goodput_summary.py), on made-up
events: the failure schedule, steps redone and the pause per failure kind,
the samples a run's steps stand for, the time blocked per checkpoint."""

from __future__ import annotations

from bench.goodput_summary import (
    NODE_LOSS,
    REJOIN,
    WORKER_KILL,
    Disruption,
    schedule,
    summarize,
)


def _step(step: int, t: float, world: int = 2, blocked: float = 0.001) -> dict[str, object]:
    return {
        "ev": "step",
        "step": step,
        "rank": 0,
        "world": world,
        "t": t,
        "compute": 0.01,
        "blocked": blocked,
        "saved": True,
    }


def _resume(step: int, t: float, world: int = 2) -> dict[str, object]:
    return {"ev": "resume", "step": step, "rank": 0, "world": world, "t": t, "pid": 1}


def test_the_schedule_kills_a_worker_every_30s_and_loses_a_node_every_90s() -> None:
    assert schedule(200, 30, 90) == [
        (30, WORKER_KILL),
        (60, WORKER_KILL),
        (90, NODE_LOSS),
        (120, WORKER_KILL),
        (150, WORKER_KILL),
        (180, NODE_LOSS),
    ]
    # none in the last half interval: its restart would not be measured
    assert schedule(120, 30, 90) == [(30, WORKER_KILL), (60, WORKER_KILL), (90, NODE_LOSS)]
    assert schedule(100, 30, 0) == [(30, WORKER_KILL), (60, WORKER_KILL)]
    assert schedule(90, 0, 40) == [(40, NODE_LOSS)]


def test_steps_redone_are_counted_from_the_newest_step_before_each_kill() -> None:
    events = [_step(s, 100 + s * 0.05) for s in range(1, 41)]  # to t=102
    events.append(_resume(30, 103.0))
    events += [_step(s, 104 + s * 0.05) for s in range(31, 61)]  # to t=107
    events.append(_resume(60, 110.0))
    events += [_step(61, 110.5)]
    kills = [Disruption(WORKER_KILL, 102.5, 40, "x"), Disruption(WORKER_KILL, 109.0, 60, "y")]
    out = summarize(events, kills)
    assert out["per_failure"][WORKER_KILL]["redone"] == [10, 0]
    pauses = out["per_failure"][WORKER_KILL]["pause"]
    assert [round(p, 6) for p in pauses] == [round(104 + 31 * 0.05 - 102.5, 6), 1.5]
    assert out["final_step"] == 61 and out["failures"][WORKER_KILL] == 2
    assert abs(out["step_s"] - 0.05) < 1e-9 and abs(out["blocked_s"] - 0.001) < 1e-12


def test_a_kill_whose_restart_never_came_counts_no_redone_steps() -> None:
    events = [_step(s, 100 + s) for s in range(1, 5)]
    out = summarize(events, [Disruption(WORKER_KILL, 104.5, 4, "x")])
    assert out["failures"][WORKER_KILL] == 1 and out["per_failure"][WORKER_KILL]["redone"] == []


def test_a_node_loss_then_the_rejoin_each_count_their_restart() -> None:
    events = [_step(s, 100 + s) for s in range(1, 11)]  # world 2 to t=110
    events.append(_resume(9, 111.0, world=1))  # the survivor alone, from step 9
    events += [_step(s, 102 + s, world=1) for s in range(10, 16)]  # to t=117
    events.append(_resume(14, 118.0))  # the replacement joins: 1 step redone
    events += [_step(s, 104 + s) for s in range(15, 21)]  # world 2 again, to t=124
    out = summarize(events, [Disruption(NODE_LOSS, 110.5, 10, "node b")])
    assert out["per_failure"][NODE_LOSS]["redone"] == [1]
    assert out["per_failure"][REJOIN]["redone"] == [1]
    assert out["per_failure"][NODE_LOSS]["pause"] == [112.0 - 110.5]
    assert out["per_failure"][REJOIN]["pause"] == [119.0 - 117.0]
    # steps 10-14 count at world 1 (their last run), the rest at world 2
    assert out["final_step"] == 20 and out["samples"] == 15 * 2 + 5 * 1
    assert out["smaller_world_s"] == 5.0  # steps 11-15 at world 1, one second each


def test_steps_after_the_end_are_not_counted() -> None:
    events = [_step(s, 100 + s) for s in range(1, 11)]
    assert summarize(events, [], t_end=105.5)["final_step"] == 5


def test_a_standby_s_start_before_the_failure_pauses_nothing() -> None:
    """A rank served by a standby: its first line and setup came before the
    kill; its pause counts from the kill (no phase below zero)."""
    events = [_step(s, 100 + s * 0.05) for s in range(1, 41)]  # to t=102
    resume = _resume(40, 102.9)
    resume["phases"] = {
        "script": 95.0,  # the standby's first line, 7.5 s before the kill
        "start": 102.6,  # it entered the function, 0.1 s after the kill
        "process_group": 102.7,
        "model": 102.8,
        "checkpoint": 102.85,
    }
    events += [resume, _step(41, 103.0)]
    out = summarize(events, [Disruption(WORKER_KILL, 102.5, 40, "x")])
    phases = {k: [round(x, 6) for x in v] for k, v in out["per_failure"]["phases"].items()}
    assert phases == {
        "script": [0.0],
        "start": [0.1],
        "process_group": [0.1],
        "model": [0.1],
        "checkpoint": [0.05],
        "first step": [0.15],
    }
