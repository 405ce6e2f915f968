"""Rendezvous waiting progress: the status the rendezvous reports, the console line."""

from __future__ import annotations

import asyncio
import io
import math

from elastrun.agent.waiting import WaitingConsole, describe
from elastrun.clock import Clock, VirtualTimeLoop, duration_text, run_virtual
from elastrun.events import ListSink
from elastrun.names import RunId
from elastrun.rendezvous.api import RendezvousSettings, WaitingStatus
from elastrun.rendezvous.plan import View
from elastrun.rendezvous.protocol import Context, State, Timer
from elastrun.rendezvous.records import MemberRecord, ResultRecord, RoundRecord, RoundState
from elastrun.rendezvous.reports import ProgressReporter, waiting_status
from elastrun.rendezvous.rules import Rules


def loop_clock() -> Clock:
    """The clock of the running virtual-time loop (see run_virtual)."""
    loop = asyncio.get_running_loop()
    assert isinstance(loop, VirtualTimeLoop)
    return loop.clock


S = RendezvousSettings(
    run_id=RunId("j"), min_nodes=2, max_nodes=3, join_timeout=600, last_call_timeout=30
)


def rules(state: State, **ctx: object) -> Rules:
    return Rules(Context(min_nodes=2, max_nodes=3, **ctx), state)  # type: ignore[arg-type]


def test_joining_below_min_waits_for_the_join_timeout() -> None:
    st = waiting_status(
        rules(State.DECIDING, round=0, count=1), {Timer.JOIN: 700.0}, View(), S, 100.0
    )
    assert st is not None
    assert (st.state, st.joined, st.deadline, st.seconds_left, st.live) == (
        "joining",
        1,
        "join_timeout",
        600.0,
        True,
    )


def test_decider_at_min_waits_for_the_last_call() -> None:
    timers = {Timer.JOIN: 700.0, Timer.LAST_CALL: 125.0}
    st = waiting_status(rules(State.DECIDING, round=0, count=2), timers, View(), S, 100.0)
    assert st is not None and (st.deadline, st.seconds_left) == ("last_call", 25.0)


def test_follower_estimates_the_last_call_and_its_count_is_not_live() -> None:
    r = rules(State.JOINING, round=0, count=2, min_reached_at=90.0)
    st = waiting_status(r, {Timer.JOIN: 700.0}, View(), S, 100.0)
    assert st is not None and (st.deadline, st.seconds_left, st.live) == ("last_call", 20.0, False)


def test_waiting_node_says_the_round_is_full() -> None:
    view = View(round=RoundRecord(4, RoundState.CLOSED))
    members = tuple(MemberRecord(n, n, "a", 1, g) for g, n in enumerate("abc"))
    view.results[4] = ResultRecord(4, members, "a", 29500)
    st = waiting_status(rules(State.WAITING, round=4), {Timer.JOIN: 160.0}, view, S, 100.0)
    assert st is not None
    assert (st.state, st.round, st.joined, st.deadline) == ("waiting", 4, 3, "join_timeout")
    assert st.detail == "round 4 is full (3 of max 3 nodes)"


def test_not_waiting_as_a_member() -> None:
    assert waiting_status(rules(State.MEMBER, round=0), {}, View(), S, 0.0) is None


def test_reporter_emits_only_on_change() -> None:
    sink, seen = ListSink(), list[WaitingStatus]()
    rep = ProgressReporter(sink, "n0", lambda: seen.append)
    a = WaitingStatus(0, "joining", 1, 2, 3, "join_timeout", 600.0)
    rep.update(a)
    rep.update(WaitingStatus(0, "joining", 1, 2, 3, "join_timeout", 590.0))  # only time moved
    rep.update(WaitingStatus(0, "joining", 2, 2, 3, "last_call", 30.0))
    assert sink.kinds() == ["rendezvous_waiting", "rendezvous_waiting"]
    assert [s.joined for s in seen] == [1, 2]
    ev = sink.events[1]
    assert (ev["joined"], ev["min"], ev["max"], ev["deadline"], ev["seconds_left"]) == (
        2,
        2,
        3,
        "last_call",
        30.0,
    )


def test_describe() -> None:
    assert duration_text(598.2, up=True) == "9m59s" and duration_text(5, up=True) == "5s"
    st = WaitingStatus(0, "joining", 1, 2, 3, "join_timeout", 600.0)
    assert describe(st, 598.2) == (
        "elastrun: rendezvous round 0: 1 of min 2 nodes joined (max 3); join timeout in 9m59s"
    )
    st = WaitingStatus(1, "joining", 2, 2, 3, "last_call", 30.0)
    assert describe(st, 12) == (
        "elastrun: rendezvous round 1: 2 nodes joined (min 2, max 3); "
        "last call closes the round in 12s"
    )
    st = WaitingStatus(0, "waiting", 3, 2, 3, "join_timeout", 60, detail="round 0 is full (x)")
    assert describe(st, 60).startswith("elastrun: waiting for the next round: round 0 is full")


def test_console_log_lines_on_change_after_the_quiet_period() -> None:
    # Virtual time: each step happens at an exact instant, after every task
    # ran what was due by then.
    async def main() -> str:
        clock = loop_clock()
        at = clock.monotonic()
        out = io.StringIO()
        con = WaitingConsole(out, tty=False, clock=clock, quiet=0.1, every=10.0)
        con.start()
        con.update(WaitingStatus(0, "joining", 1, 2, 3, "join_timeout", 600.0))
        await clock.sleep_until(at + 0.05)
        assert out.getvalue() == ""  # quiet period: nothing yet
        await clock.sleep_until(at + 0.2)
        con.update(WaitingStatus(0, "joining", 1, 2, 3, "join_timeout", 599.0))  # no change
        await clock.sleep_until(at + 0.25)
        con.update(WaitingStatus(0, "joining", 2, 2, 3, "last_call", 30.0))
        await clock.sleep_until(at + 0.3)
        con.stop()
        return out.getvalue()

    lines = run_virtual(main()).splitlines()
    assert len(lines) == 2, lines
    assert "1 of min 2" in lines[0] and "2 nodes joined" in lines[1]


def test_console_on_a_terminal_redraws_in_place_and_clears() -> None:
    async def main() -> str:
        clock = loop_clock()
        out = io.StringIO()
        con = WaitingConsole(out, tty=True, clock=clock, quiet=0.0)
        con.start()
        con.update(WaitingStatus(0, "waiting", 3, 2, 3, "join_timeout", 60.0, detail="full"))
        await clock.sleep_until(clock.monotonic() + 0.05)
        con.stop()
        return out.getvalue()

    text = run_virtual(main())
    assert text.startswith("\r\x1b[K") and "\n" not in text
    assert text.endswith("\r\x1b[K")


SPARE_LINE = "round 1 trains 2 nodes; waiting as a spare"


def test_a_spare_prints_one_line_with_no_deadline_not_one_every_interval() -> None:
    async def main() -> str:
        clock = loop_clock()
        at = clock.monotonic()
        out = io.StringIO()
        con = WaitingConsole(out, tty=False, clock=clock, quiet=0.1, every=10.0)
        con.start()
        con.update(
            WaitingStatus(1, "waiting", 2, 2, 3, "join_timeout", math.inf, detail=SPARE_LINE)
        )
        await clock.sleep_until(at + 3600.0)  # an hour as a spare
        con.stop()
        return out.getvalue()

    lines = run_virtual(main()).splitlines()
    assert lines == [
        "elastrun: waiting for the next round: round 1 trains 2 nodes; waiting as a spare"
    ]


def test_a_duration_reads_the_same_in_every_line_and_table() -> None:
    spent = [duration_text(s) for s in (0, 59.9, 184.5, 7500, 3 * 86400 + 4 * 3600 + 59)]
    assert spent == ["0s", "59s", "3m04s", "2h05m", "3d04h"]
    left = [duration_text(s, up=True) for s in (0.2, 59.1, math.inf)]
    assert left == ["1s", "1m00s", "never"]  # time left: never "0s" while some remains
    assert duration_text(-5) == duration_text(math.nan) == "0s"
