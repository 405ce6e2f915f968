"""Which ranks kept their process in an in-process restart, as ``elastrun
status`` and ``elastrun timeline`` show it: the agent's progress note carries
each rank's pid and whether its process was kept (typed, checked when read);
the table gains a PROCESS column once a rank's process was kept; the timeline
marks a node's ``ranks_kept`` on its lane."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, cast
from xml.etree import ElementTree

import pytest

from elastrun.agent.process import Worker
from elastrun.agent.stragglers import RankFile, local_progress
from elastrun.rendezvous import notes as N
from elastrun.status.cli import render_table
from elastrun.status.summary import summarize
from elastrun.status.timeline import read_line, render_html
from tests.unit.test_notes import progress, result, shown_notes
from tests.unit.timeline_events import kept, line, logged, opened, restart, started

T = 1_700_000_000.0
TEAL = "#1b9e77"


def table(ranks: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The status table and --json of round 4 whose one member's note holds ``ranks``."""
    shown = result(4, ("a", 0, len(ranks)))
    note = {**progress(0, "a"), "ranks": ranks}
    notes = shown_notes({"progress_0": note}, shown)
    s = summarize(
        "job",
        config=None,
        round_rec=None,
        result=shown,
        prev_result=None,
        joins={},
        dones=set(),
        nodes={"a"},
        waiting={},
        revision=3,
        now=0.0,
        notes=notes,
    )
    return render_table(s, "store"), json.loads(json.dumps(s.to_json()))


def rank(r: int, pid: int, kept: bool) -> dict[str, Any]:
    return {"rank": r, "step": 10, "step_time": 0.1, "own_time": 0.05, "pid": pid, "kept": kept}


def test_status_shows_which_ranks_kept_their_process_in_the_last_restart() -> None:
    text, out = table([rank(0, 101, True), rank(1, 102, True), rank(2, 303, False)])
    assert "PROCESS" in text
    rows = {ln.split()[0]: ln for ln in text.splitlines() if ln.strip()[:1].isdigit()}
    assert "kept (pid 101)" in rows["0"] and "kept (pid 102)" in rows["1"]
    assert "replaced (pid 303)" in rows["2"]
    assert [(r["rank"], r["pid"], r["kept"]) for r in out["ranks"]] == [
        (0, 101, True),
        (1, 102, True),
        (2, 303, False),
    ]


def test_status_has_no_process_column_when_no_process_was_kept() -> None:
    text, out = table([rank(0, 101, False), {"rank": 1, "step": 3}])  # 1: an older agent's
    assert "PROCESS" not in text and "replaced" not in text
    assert [r["kept"] for r in out["ranks"]] == [False, None]


@pytest.mark.parametrize("bad", [{"kept": "yes"}, {"kept": 1}, {"pid": -1}, {"pid": "12"}])
def test_a_progress_note_with_a_bad_process_field_is_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        N.RankProgress.from_json({"rank": 0, **bad})


def test_the_agent_s_note_carries_each_rank_s_pid_and_whether_it_was_kept(tmp_path: Path) -> None:
    files = []
    for r, was_kept in ((0, True), (1, False)):
        path = tmp_path / f"beat{r}"
        path.write_text(json.dumps({"v": 1, "monotonic": time.monotonic(), "step": 5}))
        files.append(RankFile(r, str(path), 1000 + r, was_kept))
    ranks = local_progress(files)
    assert [(p.rank, p.pid, p.kept) for p in ranks] == [(0, 1000, True), (1, 1001, False)]
    again = [N.RankProgress.from_json(p.to_json()) for p in ranks]  # as status reads it
    assert again == ranks


def test_a_process_taken_over_by_the_next_round_counts_as_kept() -> None:
    routes = cast(Any, (None, None))
    w = Worker(0, 0, "f", "f/error.json", routes, round=3)
    assert not w.taken_over  # started for its round
    w.take_over(rank=2, round_=4)
    assert (w.taken_over, w.rank, w.round) == (True, 2, 4)


def test_the_timeline_marks_kept_and_replaced_ranks_on_the_node_s_lane() -> None:
    event = kept(1, [0, 1], [11, 12], [2])
    read = read_line(line(T + 10.2, event, "n1", "h1"))
    assert read is not None and read.event == event  # a drawn kind, typed
    events = [
        logged(T, opened(0), "n1", "h1"),
        logged(T + 0.1, started(0, 3), "n1", "h1"),
        logged(T + 10, restart(0, 1), "n1", "h1"),
        logged(T + 10.1, started(1, 3), "n1", "h1"),
        read,
        logged(T + 20, restart(1, 2), "n1", "h1"),
    ]
    html = render_html(events)
    svg = ElementTree.fromstring(html[html.index("<svg") : html.index("</svg>") + 6])
    (mark,) = [c for c in svg.iter() if c.tag.endswith("circle") and c.get("fill") == TEAL]
    title = "".join(t.text or "" for t in mark.iter() if t.tag.endswith("title"))
    assert "in-process restart, round 1" in title
    assert "ranks kept 0 (pid 11), 1 (pid 12); replaced 2" in title
    assert "Teal: an in-process restart" in html
