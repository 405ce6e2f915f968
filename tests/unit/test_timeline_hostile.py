"""``elastrun timeline`` on a hostile event log: markup in every string field
of every event it draws, fields of the wrong type, an integer time stamp too
large for a float, huge, too long and deeply nested lines. The page is drawn
(no crash), every tag in it is one the timeline writes, what an event holds
is bounded whatever its line, and the bad lines are named in a bounded
number of notes."""

from __future__ import annotations

import dataclasses
import io
import json
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from elastrun.event_kinds import (
    Event,
    JobMarkedFailed,
    NodeJoined,
    RootCauseElsewhere,
    StragglerReplacement,
    WorkersSucceeded,
)
from elastrun.failure import FailureRecord
from elastrun.status.timeline import (
    DRAWN,
    MAX_EVENT_TEXT,
    MAX_ITEMS,
    MAX_LINE_BYTES,
    MAX_NOTES,
    load_events,
    main,
    render_html,
)
from tests.unit.timeline_events import line

EVIL = "\"'><script>alert(1)</script><img src=x onerror=alert(2)>&amp;\x1b]0;t\x07"
OUR_TAGS = {"html", "head", "meta", "title", "body", "h2", "h3", "p", "ul", "li"} | {
    "svg",
    "rect",
    "text",
    "line",
    "polyline",
    "circle",
}


class Tags(HTMLParser):
    """Every start tag and attribute of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, list[tuple[str, str | None]]]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, attrs))

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def drawn_events() -> list[Event]:
    """One event of each kind the page draws."""
    from tests.unit import timeline_events as te

    record = FailureRecord(host="h", rank=1, message="m", stderr_tail=("x",) * 40)
    return [
        te.opened(0),
        te.started(0, 2),
        te.exited(0, 1),
        te.restart(0, 1),
        te.elsewhere(0),
        te.lost(0, "node h (n) lost: lease expired or revoked", "n"),
        te.promoted(1, "n", 0, "m"),
        te.kept(1, [0, 1], [11, 12], [2]),
        te.standby_used(1, 2, 404),
        te.took_over(2, "127.0.0.2:1"),
        te.host_lost(1, "127.0.0.1:1"),
        te.failed("worker_failed"),
        te.finished(),
        JobMarkedFailed(round=1, reason="x"),
        NodeJoined(round=2, node="n", host="h"),
        WorkersSucceeded(round=2, attempt=0),
        RootCauseElsewhere(0, 0, record, record),
        te.verdict(1, "script fault: ValueError"),
        te.quarantined("h", 1_700_000_600.0, "node fault"),
        te.refused("h", 1_700_000_600.0),
        te.health_failed("false", "before_round", "exited with code 1"),
        StragglerReplacement(
            round=1,
            node="h",
            node_id="n",
            ranks=[1],
            intervals=2,
            replaced=True,
            why="replaced by a waiting spare",
            until=1_700_000_600.0,
        ),
    ]


def evil(value: Any, name: str) -> Any:
    """``value`` with every string in it markup (nested ones too)."""
    if isinstance(value, str):
        return EVIL + name
    if isinstance(value, list):
        return [evil(v, name) for v in value]
    if isinstance(value, dict):
        return {k: evil(v, k) for k, v in value.items()}
    return value


def hostile_log() -> list[str]:
    """Every event drawn, every string in it a string of markup; then lines
    that are no event of ours."""
    lines = []
    for i, event in enumerate(drawn_events()):
        raw = line(1_700_000_000.0 + i, event, f"node-{i % 2}")
        raw = {k: v if k in ("kind", "ts", "cause") else evil(v, k) for k, v in raw.items()}
        lines.append(json.dumps(raw))
    lines.append(json.dumps({"kind": EVIL, "ts": 1_700_000_000.5, "node_id": EVIL}))  # not drawn
    # Bad lines, each skipped with a note: fields of the wrong type, a number
    # out of bounds, a time stamp too large for a float (it crashed the
    # page), NaN, nesting past the bound, a list, a line too long.
    wrong = {name: [EVIL, {"x": EVIL}] for name in line(0, drawn_events()[1])}
    lines.append(json.dumps(wrong | {"kind": "workers_started", "ts": 1_700_000_010.5}))
    lines.append(json.dumps(line(1_700_000_011, drawn_events()[0]) | {"round": 10**300}))
    lines.append('{"kind": "restart", "ts": ' + "9" * 400 + "}")
    lines.append('{"kind": "restart", "ts": NaN}')
    lines.append('{"ts": 1700000001, "x": ' + "[" * 50_000 + "]" * 50_000 + "}")
    lines.append("[1, 2, 3]")
    lines.append(json.dumps({"ts": 1700000001, "x": "y" * (MAX_LINE_BYTES + 10)}))
    # A huge line (under the 1 MiB bound): a host of 600 KB, 2000 other
    # fields, 5000 pids: kept, bounded.
    huge = line(1_700_000_012.0, drawn_events()[1], "big") | {f"f{i}": EVIL for i in range(2_000)}
    huge["host"] = "<b>" * 200_000
    huge["pids"] = list(range(5000))
    lines.append(json.dumps(huge))
    return lines


def held(value: object) -> tuple[int, int]:
    """(characters of the strings in ``value``, its longest list)."""
    if isinstance(value, str):
        return len(value), 0
    if isinstance(value, list | tuple):
        parts = [held(v) for v in value]
        return sum(c for c, _ in parts), max([len(value), *(n for _, n in parts)])
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        parts = [held(getattr(value, f.name)) for f in dataclasses.fields(value)]
        return sum(c for c, _ in parts), max(n for _, n in parts)
    return 0, 0


def test_a_hostile_event_log_is_drawn_escaped_and_bounded(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    log.write_text("\n".join(hostile_log() * 2) + "\n")
    notes = io.StringIO()
    events = load_events([str(log)], notes)
    assert len(events) == 2 * (len(drawn_events()) + 1)  # every event drawn, and the huge line
    said = notes.getvalue().splitlines()
    assert len(said) == MAX_NOTES + 1 and "skipped 4 more lines like these" in said[-1], said
    assert all("<" not in s for s in said[:MAX_NOTES])  # names the problem, not the line
    for e in events:  # what an event holds is bounded, whatever its line
        chars, longest = held((e.node_id, e.host, e.run_id, e.event))
        assert chars <= MAX_EVENT_TEXT and longest <= MAX_ITEMS, (e.kind, chars, longest)
    page = render_html(events, title=EVIL)
    parsed = Tags()
    parsed.feed(page)
    parsed.close()
    assert {tag for tag, _ in parsed.tags} <= OUR_TAGS
    for tag, attrs in parsed.tags:
        assert all(not name.startswith("on") for name, _ in attrs), tag
        assert all("<" not in (value or "") and "alert" not in (value or "") for _, value in attrs)
    text = "".join(parsed.text)
    assert "<script>alert(1)</script>" in text  # shown as text, escaped in the page
    assert "<script" not in page and "<img" not in page and "\x1b" not in page
    assert "\\x1b]0;t\\x07" in page  # control characters shown as escapes

    out = tmp_path / "timeline.html"
    assert main([str(log), "--out", str(out)]) == 0
    assert out.read_text() == render_html(events)


def test_every_kind_drawn_is_in_the_hostile_log() -> None:
    assert {type(e) for e in drawn_events()} == set(DRAWN)
