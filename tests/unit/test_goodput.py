"""The goodput ledger (agent/goodput.py), fed in virtual time: each case is a
script of rounds, progress records and ends, and the seconds per cause it
must come to."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from elastrun.agent.goodput import Ledger
from elastrun.agent.watchdog import Beat, parse_beat
from elastrun.event_kinds import GoodputAccounted, parse_event
from elastrun.goodput import Cause, Goodput
from elastrun.worker._progress import Progress


def beat(
    at: float,
    step: int,
    *,
    first: tuple[float, int],
    step_time: float = 0.1,
    saving: float = 0.0,
    reported: bool = True,
    loaded: float | None = None,
    steps: int | None = None,
) -> Beat:
    """``loaded``: of ``saving``, the seconds before the first step (a load);
    ``steps``: the process's count of optimizer steps (the pace's)."""
    return Beat(
        step=step,
        monotonic=at,
        steps=steps,
        step_time=step_time,
        first_at=first[0],
        first_step=first[1],
        saving_s=saving,
        reported=reported,
        first_saving_s=loaded,
    )


@dataclass(frozen=True)
class Start:
    at: float


@dataclass(frozen=True)
class See:
    beat: Beat


@dataclass(frozen=True)
class End:
    at: float
    restart: bool = False
    hang: bool = False
    change: bool = False  # a membership change that is no restart
    charged: bool = True  # the next round's close charged the restart


Step = Start | See | End


def run(script: list[Step], now: float) -> Goodput:
    ledger = Ledger(0.0)
    for s in script:
        match s:
            case Start(at):
                ledger.started(at)
            case See(b):
                ledger.beat(b)
            case End(at, restart, hang, change, charged):
                ledger.ended(at)
                if restart:
                    ledger.restarting(hang=hang)
                    if charged:
                        ledger.charged()
                elif change:
                    ledger.changing()
    return ledger.figures(now)


# From 1 s, a step every 0.1 s, counted by the process (the pace: 0.1 s).
STEADY = [Start(0.0)] + [
    See(beat(1.0 + k, 1 + 10 * k, first=(1.0, 1), steps=1 + 10 * k)) for k in range(3)
]


def slow_start(end: End, saving: float = 0.0) -> list[Step]:
    """STEADY, ``end``, then a new process whose first second makes 2
    steps (its first at 4 s), and its next 10 (at the pace)."""
    return [
        *STEADY,
        end,
        Start(3.5),
        See(beat(5.0, 23, first=(4.0, 22), steps=2, saving=saving)),
        See(beat(6.0, 33, first=(4.0, 22), steps=12, saving=saving)),
    ]


CASES: dict[str, tuple[list[Step], float, dict[str, float], dict[str, int]]] = {
    # Start-up to the first step is outside the figure; then all training.
    "no failure": (
        [Start(2.0), See(beat(5.0, 1, first=(5.0, 1))), See(beat(14.9, 100, first=(5.0, 1)))],
        15.0,
        {"startup": 5.0, "training": 10.0},
        {"failures": 0, "steps_redone": 0},
    ),
    # A crash at 15 s, resumed from the step reached (a memory checkpoint
    # every step): the time from the crash to the first step is the restart.
    "crash, nothing redone": (
        [
            Start(1.0),
            See(beat(5.0, 1, first=(5.0, 1))),
            See(beat(15.0, 101, first=(5.0, 1))),
            End(15.0, restart=True),
            Start(16.0),
            See(beat(17.0, 102, first=(17.0, 102))),
        ],
        27.0,
        {"startup": 5.0, "training": 20.0, "restart": 2.0},
        {"failures": 1, "steps_redone": 0},
    ),
    # Resumed from step 41 after reaching 100: 60 steps (6 s at 0.1 s) redone,
    # taken from the training after the restart.
    "crash, disk checkpoint 60 steps back": (
        [
            Start(0.0),
            See(beat(1.0, 1, first=(1.0, 1))),
            See(beat(10.9, 100, first=(1.0, 1))),
            End(10.9, restart=True),
            Start(11.0),
            See(beat(12.0, 41, first=(12.0, 41))),
        ],
        30.0,
        {"startup": 1.0, "training": 9.9 + 12.0, "restart": 1.1, "redone": 6.0},
        {"failures": 1, "steps_redone": 60},
    ),
    # The time from the last step to the crash is lost (the step in flight,
    # or a rank waiting for a peer that is gone): the restart's.
    "time after the last step is lost": (
        [
            Start(0.0),
            See(beat(1.0, 1, first=(1.0, 1))),
            See(beat(9.0, 100, first=(1.0, 1))),
            End(10.0, restart=True),
            Start(10.5),
            See(beat(11.0, 101, first=(11.0, 101))),
        ],
        12.0,
        {"startup": 1.0, "training": 8.0 + 1.0, "restart": 1.0 + 1.0},
        {"failures": 1, "steps_redone": 0},
    ),
    # The last step is 3 s older than the crash (a stall): resuming at 91
    # after reaching 100 redoes 10.
    "stalled before the crash": (
        [
            Start(0.0),
            See(beat(1.0, 1, first=(1.0, 1))),
            See(beat(10.0, 100, first=(1.0, 1))),
            End(13.0, restart=True),
            Start(13.5),
            See(beat(14.0, 91, first=(14.0, 91))),
        ],
        16.0,
        {"startup": 1.0, "training": 9.0 + 2.0 - 1.0, "restart": 3.0 + 1.0, "redone": 1.0},
        {"failures": 1, "steps_redone": 10},
    ),
    # The record written between the new process's first optimizer step and
    # its report of the step's number has the count (1, not reported): the
    # steps redone are counted from the first record that reports it.
    "first record before the script reports its step": (
        [
            Start(0.0),
            See(beat(1.0, 1, first=(1.0, 1))),
            See(beat(10.9, 100, first=(1.0, 1))),
            End(10.9, restart=True),
            Start(11.0),
            See(beat(12.0, 1, first=(12.0, 1), reported=False)),
            See(beat(12.5, 46, first=(12.0, 41))),
        ],
        30.0,
        {"startup": 1.0, "training": 9.9 + 12.0, "restart": 1.1, "redone": 6.0},
        {"failures": 1, "steps_redone": 60},
    ),
    # A hang declared 30 s after the last progress: those 30 s are the hang's.
    "hang": (
        [
            Start(0.0),
            See(beat(1.0, 1, first=(1.0, 1))),
            See(beat(10.0, 90, first=(1.0, 1))),
            End(40.0, restart=True, hang=True),
            Start(41.0),
            See(beat(42.0, 91, first=(42.0, 91))),
        ],
        50.0,
        {"startup": 1.0, "training": 9.0 + 8.0, "hang": 30.0, "restart": 2.0},
        {"failures": 1, "steps_redone": 0, "hangs": 1},
    ),
    # Checkpoint phases (saving_s, the process's running count) move out of
    # training; a new process counts from 0 again.
    "saves": (
        [
            Start(0.0),
            See(beat(1.0, 1, first=(1.0, 1), saving=0.0)),
            See(beat(6.0, 50, first=(1.0, 1), saving=1.5)),
            See(beat(11.0, 100, first=(1.0, 1), saving=2.0)),
            End(11.0, restart=True),
            Start(11.5),
            See(beat(12.0, 101, first=(12.0, 101), saving=0.5)),
        ],
        13.0,
        {"startup": 1.0, "training": 10.0 - 2.0 + 1.0 - 0.5, "saves": 2.5, "restart": 1.0},
        {"failures": 1, "steps_redone": 0},
    ),
    # The restarted process loads its checkpoint (0.8 s in a checkpoint
    # phase) before its first step: that is the restart's time, not a save
    # taken from training; its first save after (0.2 s) is.
    "a checkpoint loaded before the first step": (
        [
            Start(0.0),
            See(beat(1.0, 1, first=(1.0, 1))),
            See(beat(11.0, 100, first=(1.0, 1))),
            End(11.0, restart=True),
            Start(11.5),
            See(beat(13.0, 101, first=(13.0, 101), saving=1.0, loaded=0.8)),
        ],
        14.0,
        {"startup": 1.0, "training": 10.0 + 1.0 - 0.2, "saves": 0.2, "restart": 2.0},
        {"failures": 1, "steps_redone": 0},
    ),
    # A node joins: the round ends without a restart; from its last step to
    # the first step of the next round, the time is waiting.
    "membership change": (
        [
            Start(0.0),
            See(beat(1.0, 1, first=(1.0, 1))),
            See(beat(4.5, 40, first=(1.0, 1))),
            End(5.0, change=True),
            Start(6.0),
            See(beat(7.0, 41, first=(7.0, 41))),
        ],
        10.0,
        {"startup": 1.0, "training": 3.5 + 3.0, "waiting": 0.5 + 2.0},
        {"failures": 0, "steps_redone": 0},
    ),
    # No step numbers of the script's own: the restart is seen, redone steps
    # are not (the count restarts at 1 in every process).
    "steps not reported": (
        [
            Start(0.0),
            See(beat(1.0, 1, first=(1.0, 1), reported=False)),
            See(beat(5.0, 40, first=(1.0, 1), reported=False)),
            End(5.0, restart=True),
            Start(6.0),
            See(beat(7.0, 1, first=(7.0, 1), reported=False)),
        ],
        9.0,
        {"startup": 1.0, "training": 6.0, "restart": 2.0},
        {"failures": 1, "steps_redone": 0},
    ),
    # A failure collateral to a lost node (or one the rendezvous charged to
    # another report of the same round): its time is the restart's, and it
    # is no failure more than the rendezvous charged.
    "restart not charged": (
        [
            Start(0.0),
            See(beat(1.0, 1, first=(1.0, 1))),
            See(beat(5.0, 40, first=(1.0, 1))),
            End(5.0, restart=True, charged=False),
            Start(6.0),
            See(beat(7.0, 41, first=(7.0, 41))),
        ],
        9.0,
        {"startup": 1.0, "training": 6.0, "restart": 2.0},
        {"failures": 0, "steps_redone": 0},
    ),
    # A step every 0.1 s; after the crash, the new process's first steps are
    # slow (2 steps in its first second): what they took beyond the pace
    # before (0.8 s) is the restart's, until the pace is back (10 in 1 s).
    "the warm-up after a restart": (
        [
            *STEADY,
            See(beat(4.0, 31, first=(1.0, 1), steps=31)),
            End(4.0, restart=True),
            Start(4.5),
            See(beat(6.0, 34, first=(5.0, 32), steps=3)),
            See(beat(7.0, 44, first=(5.0, 32), steps=13)),
            See(beat(8.0, 51, first=(5.0, 32), steps=20)),  # slower again: training
        ],
        9.0,
        {"startup": 1.0, "training": 3.0 + 4.0 - 0.8, "restart": 1.0 + 0.8},
        {"failures": 1, "steps_redone": 0},
    ),
    # A save among the slow steps is the saves' (0.3 s), not the warm-up's.
    "a save during the warm-up": (
        slow_start(End(3.0, restart=True), saving=0.3),
        7.0,
        {"startup": 1.0, "training": 2.0 + 3.0 - 0.6 - 0.3, "restart": 1.0 + 0.6, "saves": 0.3},
        {"failures": 1, "steps_redone": 0},
    ),
    # A round that stays slower (a smaller world: 0.2 s a step against 0.1)
    # is no warm-up past WARM_MAX (10 s) after its first step: 10 reads of
    # 0.5 s beyond the pace each, then training.
    "a slower round's warm-up is bounded": (
        [
            *STEADY,
            End(3.0, restart=True),
            Start(4.0),
            *(
                See(beat(5.0 + k, 22 + 5 * k, first=(5.0, 22), steps=1 + 5 * k))
                for k in range(1, 16)
            ),
        ],
        20.0,
        {"startup": 1.0, "training": 2.0 + 15.0 - 5.0, "restart": 2.0 + 5.0},
        {"failures": 1, "steps_redone": 0},
    ),
    # A membership change (a node joins) is no failure: the next round's
    # pace is not compared with the one before.
    "no warm-up after a membership change": (
        slow_start(End(3.0, change=True)),
        7.0,
        {"startup": 1.0, "training": 2.0 + 3.0, "waiting": 1.0},
        {"failures": 0, "steps_redone": 0},
    ),
    # A script that reports no step at all: everything is start-up, and the
    # figure is unknown.
    "no step ever": (
        [Start(0.0), End(5.0, restart=True), Start(6.0)],
        9.0,
        {"startup": 5.0, "restart": 4.0},
        {"failures": 1},
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_ledger(name: str) -> None:
    script, now, seconds, counts = CASES[name]
    got = run(script, now)
    assert {k: round(v, 6) for k, v in got.seconds.items()} == pytest.approx(seconds)
    for key, want in counts.items():
        assert getattr(got, key) == want, key
    # Every second of the agent's life goes to exactly one cause.
    assert sum(got.seconds.values()) == pytest.approx(now)


def test_figure_and_line() -> None:
    got = run(CASES["crash, disk checkpoint 60 steps back"][0], 30.0)
    assert got.ratio == pytest.approx(21.9 / 29.0)
    assert got.line() == "goodput 75.5%: 1 failure cost 7.1 s (60 steps redone)"
    cause, seconds = got.losses()[0]
    assert cause is Cause.REDONE
    assert seconds == pytest.approx(6.0)
    saves = run(CASES["saves"][0], 13.0)
    assert saves.line() == "goodput 70.8%: 1 failure cost 1.0 s (0 steps redone), saves 21%"
    unseen = run(CASES["steps not reported"][0], 9.0)
    assert "(redone steps unseen)" in unseen.line()
    assert run(CASES["no step ever"][0], 9.0).line().startswith("goodput unknown")


def test_live_figures_do_not_change_the_ledger() -> None:
    ledger = Ledger(0.0)
    ledger.started(0.0)
    ledger.beat(beat(1.0, 1, first=(1.0, 1)))
    assert ledger.figures(5.0).of(Cause.TRAINING) == pytest.approx(4.0)
    assert ledger.figures(3.0).of(Cause.TRAINING) == pytest.approx(2.0)
    ledger.ended(6.0)
    assert ledger.figures(6.0).of(Cause.TRAINING) == pytest.approx(5.0)


def test_json_round_trip_and_event() -> None:
    got = run(CASES["hang"][0], 50.0)
    back = Goodput.from_json(got.to_json())
    assert back == got
    event = parse_event({"kind": "goodput", **got.to_json()})
    assert isinstance(event, GoodputAccounted)
    assert event.goodput == pytest.approx(17.0 / 49.0, abs=1e-4)
    with pytest.raises(ValueError, match="seconds"):
        Goodput.from_json({"seconds": {"bogus": 1.0}})


def test_progress_record_fields_read() -> None:
    b = parse_beat(
        {
            "monotonic": 10.0,
            "step": 7,
            "first_at": 2.5,
            "first_step": 3,
            "saving_s": 0.25,
            "first_saving_s": 0.125,
            "reported": True,
        }
    )
    assert b is not None
    assert (b.first_at, b.first_step, b.saving_s, b.reported) == (2.5, 3, 0.25, True)
    assert b.first_saving_s == 0.125
    old = parse_beat({"monotonic": 10.0, "step": 7})  # a record without them
    assert old is not None and old.first_at is None and old.reported is False


def test_the_record_says_which_checkpoint_phases_came_before_the_first_step(tmp_path) -> None:
    """A restarted process loads its checkpoint (a checkpoint phase) before
    its first step: the record gives those seconds apart (``first_saving_s``)
    so that the ledger does not take them from training a second time."""
    now = [100.0]
    p = Progress(str(tmp_path / "hb.json"), 0.5, clock=lambda: now[0])
    with p.in_phase("checkpoint"):  # the load
        now[0] += 0.75
    now[0] += 0.5  # the first step
    p.optimizer_step()
    with p.in_phase("checkpoint"):  # its save
        now[0] += 0.25
    record = p.snapshot()
    assert (record["saving_s"], record["first_saving_s"]) == (1.0, 0.75)
    b = parse_beat(record)
    assert b is not None and (b.first_at, b.first_saving_s) == (101.25, 0.75)
