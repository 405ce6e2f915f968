"""Pure formatting and parsing behind torchrun/torch.distributed.launch
compatibility and the operator's messages: console prefixes, failure
summaries, argument macros, device counts, flag suggestions, the local rank
spelling, the waiting line, ``status`` output and the timeline's layout."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import io
import json
import time
from pathlib import Path
from xml.etree import ElementTree

import pytest

from elastrun.agent.command import Executable, with_local_rank
from elastrun.agent.failures import ROOT_CAUSE, WorkerFailure, format_summary
from elastrun.agent.logs import LinePump, routes_for, shows_rank, torch_prefix
from elastrun.agent.spec import LogSettings, Std, WorkerSpec
from elastrun.agent.waiting import describe
from elastrun.errors import ConfigError
from elastrun.failure import FailureRecord
from elastrun.launcher.cli import parse
from elastrun.launcher.command import Command
from elastrun.launcher.devices import count_xpus
from elastrun.launcher.flag_grammar import parse_nproc, unknown_flags_message
from elastrun.launcher.flags import LocalRankStyle, build_parser
from elastrun.launcher.legacy import local_rank_flag, parse_legacy
from elastrun.names import RunId
from elastrun.rendezvous.api import RendezvousSettings, WaitingStatus
from elastrun.rendezvous.plan import View
from elastrun.rendezvous.protocol import Context, State, Timer
from elastrun.rendezvous.records import (
    AgreedSettings,
    ConfigRecord,
    MemberRecord,
    PrevMember,
    ResultRecord,
    RoundRecord,
    RoundState,
)
from elastrun.rendezvous.reports import waiting_status
from elastrun.rendezvous.rules import Rules
from elastrun.status.cli import Printer, render_table
from elastrun.status.summary import Summary, summarize
from elastrun.status.timeline import (
    axis_ticks,
    fmt_offset,
    place_labels,
    render_html,
)
from tests.unit.timeline_events import finished, logged, opened, restart, started


# ----------------------------------------------------------------- console prefixes
def spec(**kw: object) -> WorkerSpec:
    command = Executable(("python",))
    logs = LogSettings(**kw)  # type: ignore[arg-type]
    return WorkerSpec(command=command, nproc=2, run_id=RunId("r"), host="vm", logs=logs)


def pump_lines(route_index: int, data: bytes, capsys: pytest.CaptureFixture[str], **kw: object):
    routes = routes_for(spec(**kw), None, 1, rank=5)
    # (a loop of its own: an earlier test's asyncio.run() leaves none current)
    loop = asyncio.new_event_loop()
    try:
        pump = LinePump(asyncio.StreamReader(loop=loop), routes[route_index])
        pump._take(data)
    finally:
        loop.close()
    out = capsys.readouterr()
    return (out.out if route_index == 0 else out.err), list(pump.tail)


def test_our_prefix_and_torchs_rank_tag_once(capsys: pytest.CaptureFixture[str]) -> None:
    text, tail = pump_lines(1, b"[rank5]: Traceback (most recent call last):\nplain\n", capsys)
    assert text == "[vm:5]: Traceback (most recent call last):\n[vm:5]: plain\n"
    assert tail == ["Traceback (most recent call last):", "plain"]
    # another rank's tag is not ours to drop
    text, _ = pump_lines(1, b"[rank4]: x\n", capsys)
    assert text == "[vm:5]: [rank4]: x\n"


def test_a_template_without_the_rank_keeps_torchs_tag(capsys: pytest.CaptureFixture[str]) -> None:
    text, tail = pump_lines(1, b"[rank5]: boom\n", capsys, template="<{host}>")
    assert text == "<vm>: [rank5]: boom\n" and tail == ["boom"]


def test_torch_template_is_verbatim_and_only_on_teed_streams(
    capsys: pytest.CaptureFixture[str],
) -> None:
    tmpl = "[rank${rank}]: "
    text, _ = pump_lines(0, b"hi\n", capsys, torch_template=tmpl)
    assert text == "hi\n"  # not tee'd: as the worker wrote it (torchrun)
    text, _ = pump_lines(0, b"hi\n", capsys, torch_template=tmpl, tee={-1: Std.OUT})
    assert text == "[rank5]: hi\n"
    text, _ = pump_lines(1, b"hi\n", capsys, torch_template=tmpl, tee={-1: Std.OUT})
    assert text == "hi\n"  # only stdout is tee'd
    text, _ = pump_lines(0, b"[rank5]: hi\n", capsys, torch_template=tmpl, tee={1: 3})
    assert text == "[rank5]: hi\n"


def test_torch_prefix_fields() -> None:
    t = "[${role_name}${local_rank}|${rank}|${host}]:"
    assert torch_prefix(t, role="trainer", rank=7, local_rank=1) == "[trainer1|7|${host}]:"
    assert shows_rank("[{host}:{rank}]") and shows_rank("[rank${rank}]: ")
    assert not shows_rank("[{local_rank}]") and not shows_rank("${local_rank}")


# ----------------------------------------------------------------- failure summaries
def failure(**kw: object) -> WorkerFailure:
    base: dict[str, object] = {
        "rank": 1,
        "local_rank": 1,
        "host": "vm",
        "pid": 42,
        "returncode": 3,
        "exit_time": 1_700_000_000.0,
        "exit_monotonic": 1.0,
        "role": ROOT_CAUSE,
    }
    return WorkerFailure(**{**base, **kw})  # type: ignore[arg-type]


def test_summary_shows_stdout_when_stderr_is_empty() -> None:
    f = failure(stdout_tail=("step 3", "error: bad input on stdout"), stdout_log="/l/1/stdout.log")
    text = format_summary([f], "header")
    assert "last 2 lines of stdout (nothing on stderr):" in text
    assert "    error: bad input on stdout" in text
    assert "full log of rank 1: /l/1/stdout.log" in text
    assert "nothing on stderr)" in text and "no error file" not in text
    assert f.to_json()["message"] == "error: bad input on stdout"


def test_summary_prefers_stderr_and_says_when_both_are_empty() -> None:
    f = failure(stderr_tail=("ValueError: x",), stdout_tail=("noise",))
    text = format_summary([f], "header")
    assert "last 1 line of stderr:" in text and "noise" not in text
    text = format_summary([failure()], "header")
    assert "(no error file, and nothing on stderr or stdout)" in text


# ----------------------------------------------------------------- arguments
def test_local_rank_macro_only_replaces_itself() -> None:
    argv = ("python", "-u", "t.py", "--local_rank=${local_rank}", "a$$b", "$local_rank", "${x}")
    assert with_local_rank(argv, 3) == (
        "python",
        "-u",
        "t.py",
        "--local_rank=3",
        "a$$b",
        "$local_rank",
        "${x}",
    )


def fake_card(root: Path, name: str, vendor: str, driver: str) -> None:
    dev = root / name / "device"
    dev.mkdir(parents=True)
    (dev / "vendor").write_text(vendor + "\n")
    (root / "drivers" / driver).mkdir(parents=True, exist_ok=True)
    (dev / "driver").symlink_to(root / "drivers" / driver)


def test_count_xpus_from_sysfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ZE_AFFINITY_MASK", raising=False)
    fake_card(tmp_path, "card0", "0x8086", "i915")
    fake_card(tmp_path, "card1", "0x8086", "xe")
    fake_card(tmp_path, "card2", "0x10de", "nvidia")  # not Intel
    fake_card(tmp_path, "card3", "0x8086", "vfio-pci")  # passed through, not driven
    (tmp_path / "card0-DP-1").mkdir()  # a connector, not a card
    assert count_xpus(str(tmp_path)) == 2
    monkeypatch.setenv("ZE_AFFINITY_MASK", "1")
    assert count_xpus(str(tmp_path)) == 1
    monkeypatch.setenv("ZE_AFFINITY_MASK", "0.0,0.1")  # two tiles of one device
    assert count_xpus(str(tmp_path)) == 1
    assert count_xpus(str(tmp_path / "missing")) == 0


def test_nproc_xpu_without_devices_is_a_clear_error() -> None:
    if count_xpus() > 0:
        pytest.skip("this machine has an Intel XPU")
    with pytest.raises(ConfigError, match="'xpu' asks for one worker per Intel XPU"):
        parse_nproc("xpu")


def test_unknown_flag_messages() -> None:
    p = build_parser()
    msg = unknown_flags_message(["--local-rank=0"], p)
    assert msg.startswith("--local-rank: not an elastrun flag") and "LOCAL_RANK" in msg
    assert "did you mean --nproc-per-node? (flags are not abbreviated)" in (
        unknown_flags_message(["--nproc=2"], p)
    )
    assert "did you mean --rdzv_endpoint?" in unknown_flags_message(["--rdzv_endpiont=x"], p)
    assert unknown_flags_message(["--zzz"], p) == "unrecognized arguments: --zzz"


def test_parser_takes_no_abbreviation_but_the_redirect_spelling(tmp_path: Path) -> None:
    script = tmp_path / "t.py"
    script.write_text("")
    with pytest.raises(ConfigError, match=r"^--local-rank: not an elastrun flag"):
        parse(["--local-rank=0", str(script)])
    plan, _ = parse(["--redirect=3", str(script)])
    assert plan.workers.logs.redirects == {-1: Std.ALL}
    plan, _ = parse(["--logs_specs=default", str(script)])
    with pytest.raises(ConfigError, match=r"no torchrun\.logs_specs plugins"):
        parse(["--logs-specs=mine", str(script)])


def test_local_rank_spelling_from_the_source(tmp_path: Path) -> None:
    def flag(source: str, style: LocalRankStyle = LocalRankStyle.AUTO) -> str:
        path = tmp_path / "s.py"
        path.write_text(source)
        return local_rank_flag(Command(script=str(path), args=()), style)

    assert flag('p.add_argument("--local_rank")') == "--local_rank"
    assert flag('p.add_argument("--local-rank", type=int)') == "--local-rank"
    assert flag('p.add_argument("--local-rank", "--local_rank")') == "--local_rank"
    assert flag("import os") == "--local_rank"  # e.g. a dataclass field parser
    assert flag('p.add_argument("--local_rank")', LocalRankStyle.DASH) == "--local-rank"
    assert local_rank_flag(Command(script="missing.py", args=())) == "--local_rank"


def test_legacy_parse_inserts_the_argument_after_the_script(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("")
    _, cmd, flag = parse_legacy(["--nproc_per_node=2", str(script), "--lr", "1"])
    assert flag == "--local_rank" and cmd.args == ("--local_rank=${local_rank}", "--lr", "1")
    plan, _, _ = parse_legacy(["--local-rank-style=dash", str(script)])
    assert (
        plan.workers.command.command_line()[-1] == "--local-rank=${local_rank}"
    )  # what each worker gets
    _, cmd, flag = parse_legacy(["--use_env", str(script), "--lr", "1"])
    assert flag is None and cmd.args == ("--lr", "1")
    with pytest.raises(ConfigError, match="--no-python: needs --use-env"):
        parse_legacy(["--no-python", "true"])


# ----------------------------------------------------------------- waiting line
S = RendezvousSettings(
    run_id=RunId("j"), min_nodes=1, max_nodes=2, join_timeout=600, last_call_timeout=1
)


def test_a_closing_round_keeps_its_last_call_not_the_join_timeout() -> None:
    ctx = Context(min_nodes=1, max_nodes=2, round=0, count=1, min_reached_at=99.0)
    rules = Rules(ctx, State.DECIDING)
    # the last call fired (its timer is gone): the decider is closing the round
    st = waiting_status(rules, {Timer.JOIN: 700.0}, View(), S, 100.5)
    assert st is not None and st.deadline == "last_call", st
    assert "join timeout" not in describe(st, st.seconds_left)


def test_waiting_line_plural() -> None:
    one = WaitingStatus(0, "joining", 1, 1, 2, "last_call", 1.0)
    assert "round 0: 1 node joined (min 1, max 2)" in describe(one, 1.0)
    two = WaitingStatus(0, "joining", 2, 1, 3, "last_call", 1.0)
    assert "2 nodes joined" in describe(two, 1.0)
    none = WaitingStatus(0, "joining", 0, 1, 1, "join_timeout", 9.0)
    assert "0 of min 1 node joined (max 1)" in describe(none, 9.0)


# ----------------------------------------------------------------- status
ROUND = RoundRecord(
    2, RoundState.CLOSED, restarts=1, last_failure=FailureRecord(rank=1, exitcode=5)
)


def summary(round_rec: RoundRecord) -> Summary:
    member = MemberRecord("a", "h", "1.2.3.4", 1, 0)
    return summarize(
        "job",
        config=ConfigRecord(AgreedSettings(1, 2, 3, 600.0, 30.0)),
        round_rec=round_rec,
        result=ResultRecord(2, (member,), "1.2.3.4", 5, closed_at=100.0),
        prev_result=None,
        joins={},
        dones=set(),
        nodes={"a"},
        waiting={},
        revision=7,
        now=110.0,
    )


def test_closed_round_has_no_restart_pending() -> None:
    pending = FailureRecord(rank=1, exitcode=5)
    closed = summary(dataclasses.replace(ROUND, pending_failure=pending))
    assert closed.restart_pending is False and closed.restarts == 1
    prev = (PrevMember("a", 0),)
    opened = summary(
        dataclasses.replace(ROUND, state=RoundState.OPEN, pending_failure=pending, prev=prev)
    )
    assert opened.restart_pending is True and opened.state == "restarting"


def test_the_status_table_says_the_last_failure_as_every_node_does() -> None:
    text = render_table(summary(ROUND), "h:1")
    assert "\nlast failure: rank 1 on ? exited with code 5\n" in text + "\n"
    failure = FailureRecord(rank=1, host="b", exitcode=5, time=0.0, message="ValueError: x")
    text = render_table(summary(dataclasses.replace(ROUND, last_failure=failure)), "h:1")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(0.0))
    assert f"last failure: {failure.describe()} at {when}: ValueError: x" in text


def test_watch_on_a_file_prints_only_what_changed() -> None:
    out = io.StringIO()
    show = Printer(argparse.Namespace(json=False, watch=True), "h:1", out, tty=False)
    first = summary(ROUND)
    show(first)
    show(dataclasses.replace(first, revision=9, state_for_s=30.0))  # nothing a reader cares about
    show(dataclasses.replace(first, revision=11, restarts=2))
    text = out.getvalue()
    assert text.startswith(render_table(first, "h:1"))
    changes = text[len(render_table(first, "h:1")) + 1 :].splitlines()
    assert changes[0].startswith("--- ") and "(revision 11)" in changes[0]
    assert changes[1:] == ["- restarts  1 of 3", "+ restarts  2 of 3"]


def test_watch_on_a_terminal_redraws_in_place() -> None:
    out = io.StringIO()
    show = Printer(argparse.Namespace(json=False, watch=True), "h:1", out, tty=True)
    s = summary(ROUND)
    show(s)
    first = out.getvalue()
    rows = len(render_table(s, "h:1").splitlines())
    assert "\x1b[2J" not in first and "\x1b[F" not in first
    show(dataclasses.replace(s, restarts=2))
    second = out.getvalue()[len(first) :]
    assert second.startswith(f"\x1b[{rows}F\x1b[2K") and second.endswith("\x1b[J")
    assert "restarts  2 of 3" in second
    before = out.getvalue()
    time.sleep(0.01)
    show.tick()  # durations keep counting between changes
    assert out.getvalue() != before


def test_watch_json_is_one_object_per_line() -> None:
    out = io.StringIO()
    show = Printer(argparse.Namespace(json=True, watch=True), "h:1", out, tty=True)
    show(summary(ROUND))
    show(summary(ROUND))
    assert [json.loads(line)["round"] for line in out.getvalue().splitlines()] == [2, 2]
    assert not show.ticks


# ----------------------------------------------------------------- timeline
def test_axis_ticks_are_round_steps_far_enough_apart() -> None:
    assert axis_ticks(4.3, 900) == [0.0, 1.0, 2.0, 3.0, 4.0]
    ticks = axis_ticks(3600, 900)
    step = ticks[1] - ticks[0]
    assert step == 300 and ticks[-1] == 3600
    assert all(900 * step / 3600 >= 70 for _ in ticks)
    assert fmt_offset(0) == "0s" and fmt_offset(150) == "2m30s" and fmt_offset(3600) == "1h"


def test_place_labels_never_overlap() -> None:
    labels = [(100.0, "round 1"), (101.0, "round 2"), (102.0, "round 3"), (103.0, "round 4")]
    placed = place_labels(labels, 3, right=1000)
    assert [(row, text) for _, row, text in placed] == [
        (0, "round 1"),
        (1, "round 2"),
        (2, "round 3"),
    ]  # the fourth fits nowhere: left to its tooltip
    assert place_labels([(995.0, "round 9")], 3, right=1000) == []


def test_timeline_has_an_axis_and_separate_labels_at_a_restart() -> None:
    t = 1_700_000_000.0
    events = [
        logged(t, opened(0), "n1", "a"),
        logged(t + 0.1, started(0, 2), "n1", "a"),
        logged(t + 20.0, restart(0, 1), "n1", "a"),
        logged(t + 20.01, opened(1), "n1", "a"),
        logged(t + 20.02, opened(2), "n1", "a"),
        logged(t + 20.1, started(2, 2, restarts=1), "n1", "a"),
        logged(t + 40.0, finished(), "n1", "a"),
    ]
    page = render_html(events)
    svg = ElementTree.fromstring(page[page.index("<svg") : page.index("</svg>") + 6])
    texts = [
        (float(e.get("x", 0)), float(e.get("y", 0)), e.text or "")
        for e in svg.iter()
        if e.tag.endswith("text")
    ]
    rounds = [(x, y) for x, y, s in texts if s.startswith("round ")]
    assert len(rounds) == 3 and len({y for _, y in rounds[1:]}) == 2  # stacked, not on top
    ticks = [s for _, _, s in texts if s.endswith("s") and s[:-1].isdigit()]
    assert ticks[0] == "0s" and ticks[-1] == "40s"
    assert "1 restart," in page and "1 node<" in page and "3 rounds" in page


def test_the_local_rank_spelling_is_read_from_the_file_the_workers_run_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from elastrun.launcher.legacy import local_rank_flag

    dash = 'p.add_argument("--local-rank", type=int)\n'
    (tmp_path / "script.py").write_text(dash)
    (tmp_path / "mod.py").write_text(dash)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__main__.py").write_text(dash)
    monkeypatch.chdir(tmp_path)
    for cmd in (
        Command("script.py", ()),
        Command("mod", (), module=True),  # -m mod: ./mod.py
        Command("pkg", (), module=True),  # -m pkg: ./pkg/__main__.py
        Command("script.py", (), no_python=True, run_path=True),
    ):
        assert local_rank_flag(cmd) == "--local-rank", cmd
    for cmd in (
        Command("absent", (), module=True),  # not found without importing: the default
        Command("script.py", (), no_python=True),  # a program, not Python
    ):
        assert local_rank_flag(cmd) == "--local_rank", cmd
