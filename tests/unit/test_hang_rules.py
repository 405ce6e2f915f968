"""Hang detection and stragglers, the pure parts: progress calibration, the
timeout policy, ``--hang-timeout auto`` parsing, reading faulthandler dumps,
the straggler rule and the status summary of the agents' notes."""

from __future__ import annotations

import faulthandler
import os
import threading
from pathlib import Path

import pytest

from elastrun.agent.stacks import (
    RankStacks,
    frames,
    hung_rank,
    in_torch,
    main_thread,
    report,
    top_frame,
)
from elastrun.agent.stragglers import StragglerRule
from elastrun.agent.watchdog import PHASE_FACTOR, Beat, HangPolicy, read_beat
from elastrun.errors import ConfigError
from elastrun.launcher.cli import parse
from elastrun.rendezvous.notes import NoteInvalid
from elastrun.rendezvous.records import MemberRecord, ResultRecord
from elastrun.status.summary import ShownNotes, hang_stacks, rank_progress
from elastrun.worker._progress import GAP_MAX_MULT, GAP_QUANTILE_MULT, MIN_GAPS, Progress
from tests.unit.test_notes import shown_notes


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _progress(tmp_path: Path) -> tuple[Progress, Clock]:
    clock = Clock()
    return Progress(str(tmp_path / "hb.json"), 0.5, clock), clock


# -- progress -------------------------------------------------------------------


def test_calibration_needs_enough_gaps_then_follows_the_quantile_and_the_longest(tmp_path):
    p, clock = _progress(tmp_path)
    for _ in range(MIN_GAPS):  # MIN_GAPS - 1 gaps after the first event
        p.event()
        clock.t += 0.05
    assert p.calibrated() is None
    p.event()
    assert p.calibrated() == pytest.approx(
        max(GAP_QUANTILE_MULT * 0.05, GAP_MAX_MULT * 0.05), rel=1e-6
    )
    for _ in range(200):
        clock.t += 0.05
        p.event()
    # One long pause (an epoch boundary) among many steps is remembered:
    # twice it, at least (the 99th percentile stays a step's gap).
    clock.t += 4.0
    p.event()
    assert p.calibrated() == pytest.approx(GAP_MAX_MULT * 4.0, rel=1e-6)
    # Among a few gaps, a long one is the 99th percentile itself.
    q, qclock = _progress(tmp_path)
    for _ in range(MIN_GAPS + 1):
        q.event()
        qclock.t += 0.05
    qclock.t += 4.0
    q.event()
    assert q.calibrated() == pytest.approx(GAP_QUANTILE_MULT * (4.0 + 0.05), rel=1e-6)


def test_a_phase_is_not_a_gap_and_not_a_step_time(tmp_path):
    p, clock = _progress(tmp_path)
    for _ in range(20):
        clock.t += 0.1
        p.optimizer_step()
    with p.in_phase("checkpoint"):
        assert p.snapshot()["phase"] == "checkpoint"
        clock.t += 60.0  # a long save
    clock.t += 0.1
    p.optimizer_step()
    assert max(p.gaps) == pytest.approx(0.1)
    assert p.step_time() == pytest.approx(0.1)
    assert p.snapshot()["phase"] is None
    assert p.snapshot()["steps"] == 21 and p.snapshot()["step"] == 21


def test_own_time_leaves_out_backward_passes(tmp_path):
    p, clock = _progress(tmp_path)
    for _ in range(10):
        clock.t += 0.03
        p.waiting += 0.07  # waiting in the all-reduce for a slower peer
        clock.t += 0.07
        p.optimizer_step()
    assert p.step_time() == pytest.approx(0.1)
    assert p.own_time() == pytest.approx(0.03)


def test_explicit_heartbeat_steps_win_over_the_count(tmp_path):
    p, _ = _progress(tmp_path)
    p.heartbeat(1000)
    p.optimizer_step()
    assert p.step == 1000


def test_the_file_is_written_only_on_change_and_reads_back(tmp_path):
    p, clock = _progress(tmp_path)
    path = tmp_path / "hb.json"
    p.write()
    assert not path.exists()  # nothing happened yet
    for _ in range(12):
        clock.t += 0.05
        p.optimizer_step()
    p.write()
    beat = read_beat(str(path))
    assert beat is not None
    assert beat.monotonic == pytest.approx(clock.t) and beat.steps == 12
    assert beat.step_time == pytest.approx(0.05) and beat.calib is not None
    mtime = path.stat().st_mtime_ns
    p.write()
    assert path.stat().st_mtime_ns == mtime


def test_a_bad_progress_file_is_no_progress(tmp_path):
    f = tmp_path / "hb.json"
    for text in ("", "{", "[]", '{"monotonic": "x"}', '{"monotonic": NaN}'):
        f.write_text(text)
        assert read_beat(str(f)) is None
    f.write_text('{"monotonic": 5, "calib": -1, "step_time": true, "phase": 3}')
    beat = read_beat(str(f))
    assert beat is not None and beat.calib is None and beat.step_time is None
    assert beat.phase is None


# -- the timeout policy -------------------------------------------------------------


def test_fixed_timeout_ignores_calibration_and_phases():
    beat = Beat(step=1, monotonic=0.0, calib=999.0, phase="checkpoint")
    assert HangPolicy(30.0).timeout_for(beat) == 30.0


def test_auto_timeout_is_the_floor_or_the_calibration_and_longer_in_a_phase():
    auto = HangPolicy(30.0, auto=True)
    assert auto.timeout_for(None) == 30.0
    assert auto.timeout_for(Beat(1, 0.0, calib=5.0)) == 30.0
    assert auto.timeout_for(Beat(1, 0.0, calib=80.0)) == 80.0
    assert auto.timeout_for(Beat(1, 0.0, calib=5.0, phase="checkpoint")) == 30.0 * PHASE_FACTOR


@pytest.mark.parametrize(
    ("flag", "expect"),
    [("auto", (300.0, True)), ("auto:30", (30.0, True)), ("45", (45.0, False))],
)
def test_hang_timeout_flag(tmp_path, flag, expect):
    script = tmp_path / "s.py"
    script.write_text("")
    plan, _ = parse(["--hang-timeout", flag, str(script)])
    assert (plan.workers.hang.timeout, plan.workers.hang.auto) == expect


@pytest.mark.parametrize("flag", ["auto:", "auto:x", "auto:-1", "auto:0", "automatic", "0"])
def test_bad_hang_timeout_is_refused_naming_the_flag(tmp_path, flag):
    script = tmp_path / "s.py"
    script.write_text("")
    with pytest.raises(ConfigError, match="--hang-timeout"):
        parse(["--hang-timeout", flag, str(script)])


# -- stacks -----------------------------------------------------------------------


def stuck_here(ready: threading.Event, go: threading.Event) -> None:
    ready.set()
    go.wait(30)


def test_a_real_dump_names_the_main_threads_frame(tmp_path):
    """A faulthandler dump of this process: another thread sits in
    stuck_here, the main thread in this test."""
    ready, go = threading.Event(), threading.Event()
    t = threading.Thread(target=stuck_here, args=(ready, go))
    t.start()
    ready.wait(10)
    path = tmp_path / "stacks.txt"
    try:
        with open(path, "w") as f:
            f.write(f"# elastrun: main thread 0x{threading.get_ident():x}\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
    finally:
        go.set()
        t.join()
    dump = path.read_text()
    main = main_thread(str(path))
    assert main == threading.get_ident()
    top = top_frame(dump, main)
    assert top is not None and top.func == "test_a_real_dump_names_the_main_threads_frame"
    assert top.file == os.path.abspath(__file__)
    other = top_frame(dump, t.ident)
    assert other is not None and other.func in ("wait", "stuck_here")
    assert any(f.func == "stuck_here" for f in frames(dump, t.ident))
    assert not in_torch(dump, main)


_WAITING = """Thread 0x00007f0000000001 (most recent call first):
  File "/v/lib/site-packages/torch/autograd/graph.py", line 979 in _engine_run_backward
  File "/v/lib/site-packages/torch/_tensor.py", line 623 in backward
  File "/job/train.py", line 66 in train_step
"""
_STUCK = """Current thread 0x00007f0000000001 (most recent call first):
  File "/job/train.py", line 44 in stuck_in_my_function
  File "/job/train.py", line 79 in <module>
"""


def test_stuck_ranks_come_before_those_waiting_in_torch():
    assert in_torch(_WAITING) and not in_torch(_STUCK)
    text = report(
        [
            RankStacks.of(0, "a", _WAITING, None, hung=True),
            RankStacks.of(1, "b", _STUCK, None, hung=False),
        ]
    )
    lines = text.splitlines()
    assert "rank 1 on b [stuck in its own code] sits in stuck_in_my_function" in lines[1]
    assert "rank 0 on a [waiting in torch, judged hung by the watchdog]" in text


_ENDING = "Current thread 0x00007f0000000001 (most recent call first):\n"


def test_a_hang_is_blamed_on_the_rank_stuck_in_its_own_code_whichever_timer_fired():
    """Rank 1 is stuck in its own code; ranks 0 and 2 wait in torch for it
    since the same step, so their timeouts expire with rank 1's, and any of
    the three may be the one the watchdog judged: the verdict is rank 1."""
    dumps = {0: (_WAITING, None), 1: (_STUCK, None), 2: (_WAITING, None)}
    idle = {0: 10.0, 1: 10.0, 2: 10.0}
    assert [hung_rank(judged, dumps, idle, 10.0) for judged in (0, 1, 2)] == [1, 1, 1]
    # The judged rank without a stack (a process kept from an earlier round
    # whose stack was not collected, a rank that ignores the signal): nothing
    # says it is stuck, rank 1's stack does.
    assert hung_rank(0, {1: (_STUCK, None), 2: (_WAITING, None)}, idle, 10.0) == 1
    assert hung_rank(0, {0: (_ENDING, None), 1: (_STUCK, None)}, idle, 10.0) == 1
    # Another rank in its own code is no culprit if it progressed in the last
    # half timeout, or if its progress is unknown: then the judged rank is.
    assert hung_rank(0, dumps, {**idle, 1: 4.9}, 10.0) == 0
    assert hung_rank(0, dumps, {**idle, 1: None}, 10.0) == 0
    assert hung_rank(0, dumps, {0: 10.0}, 10.0) == 0
    # The judged rank in its own code is the culprit, whatever the others show.
    both = {0: (_STUCK, None), 1: (_STUCK, None)}
    assert hung_rank(1, both, idle, 10.0) == 1
    assert hung_rank(0, {}, {}, 10.0) == 0  # no stacks at all: the watchdog's rank
    # A rank that was ending (no Python frame) is no culprit either.
    assert hung_rank(0, {0: (_WAITING, None), 1: (_ENDING, None)}, idle, 10.0) == 0


def test_rank_stacks_from_a_note_are_checked_and_bounded():
    good = RankStacks.of(3, "h", _STUCK, None, hung=True)
    assert RankStacks.from_json(good.to_json()) == good
    bad: list[object] = [None, [], {"rank": "1", "frames": []}, {"rank": 1}]
    bad.append({"rank": True, "frames": []})
    bad.append({"rank": 1, "host": "h", "frames": ["x" * 10_000], "in_torch": False})
    bad.append({"rank": 1, "host": "h", "frames": ["x"] * 1000, "in_torch": False})
    for raw in bad:
        with pytest.raises(NoteInvalid):
            RankStacks.from_json(raw)
    long = RankStacks.of(1, "h" * 1000, _STUCK * 40, None, hung=False)
    assert len(long.host) == 300 and len(long.frames) <= 30


# -- stragglers ---------------------------------------------------------------------


def test_a_rank_persistently_slower_than_the_median_is_a_straggler():
    rule = StragglerRule(ratio=1.2, sustain=3)
    everyone_else = [0.050, 0.051, 0.049]
    assert rule.observe({2: 0.080}, [*everyone_else, 0.080]) == set()
    assert rule.observe({2: 0.080}, [*everyone_else, 0.080]) == set()
    assert rule.observe({2: 0.080}, [*everyone_else, 0.080]) == {2}
    # back in line: no longer flagged, and it takes a sustained window again
    assert rule.observe({2: 0.050}, [*everyone_else, 0.050]) == set()
    assert rule.observe({2: 0.080}, [*everyone_else, 0.080]) == set()


def test_a_single_slow_report_or_a_lone_rank_is_no_straggler():
    rule = StragglerRule(ratio=1.2, sustain=3)
    for t in (0.08, 0.05, 0.08, 0.05, 0.08):
        assert rule.observe({0: t}, [0.05, 0.05, t]) == set()
    assert StragglerRule(sustain=1).observe({0: 9.0}, [9.0]) == set()


# -- the status summary -------------------------------------------------------------


def test_status_shows_the_round_s_step_times_and_the_last_hang_s_stacks():
    def ranks_of(*rows: dict[str, object]) -> list[dict[str, object]]:
        return [{"step": 10, "step_time": 0.1, **r} for r in rows]

    notes = {
        "progress_0": {
            "round": 4,
            "group_rank": 0,
            "node_id": "a",
            "host": "a",
            "at": 1.0,
            "ranks": ranks_of({"rank": 1, "own_time": 0.1}, {"rank": 0, "own_time": 0.05}),
        },
        "progress_1": {"round": 3, "host": "old", "ranks": [{"rank": 7}]},  # an older round
        "stragglers": {
            "round": 4,
            "at": 1.0,
            "median": 0.07,
            "stragglers": [{"rank": 1, "own_time": 0.1}],
        },
        "stacks_2_0": {"round": 2, "group_rank": 0, "node_id": "a", "ranks": []},
        "stacks_3_0": {
            "round": 3,
            "group_rank": 0,
            "node_id": "a",
            "ranks": [
                {"rank": 0, "host": "a", "frames": ["wait (t.py:1)"], "in_torch": True},
                {"rank": 1, "host": "a", "frames": ["mine (m.py:2)"], "in_torch": False},
            ],
        },
    }
    members = (MemberRecord("a", "a", "127.0.0.1", 2, 0),)
    shown = shown_notes(
        notes,
        ResultRecord(4, members, "127.0.0.1", 29500),
        ResultRecord(3, members, "127.0.0.1", 29500),
    )
    ranks = rank_progress(shown)
    assert [(r.rank, r.straggler, r.own_time_s) for r in ranks] == [
        (0, False, 0.05),
        (1, True, 0.1),
    ]
    stacks = hang_stacks(shown)
    assert stacks is not None and stacks.round == 3
    assert [r.rank for r in stacks.ranks] == [1, 0]
    assert rank_progress(ShownNotes()) == () and hang_stacks(ShownNotes()) is None
