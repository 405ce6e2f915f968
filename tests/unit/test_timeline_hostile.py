"""``elastrun timeline`` on a hostile event log: markup in every string field
of every event it draws, fields of the wrong type, an integer time stamp too
large for a float, huge and deeply nested lines. The page is drawn (no
crash), every tag in it is one the timeline writes, and what an event holds
is bounded whatever its line."""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from elastrun.status.timeline import FIELDS, MAX_FIELD, load_events, main, render_html

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


def hostile_log() -> list[str]:
    """One event of each kind the page draws, every field a string of markup."""
    kinds: list[tuple[str, dict[str, Any]]] = [
        ("round_opened", {}),
        ("workers_started", {}),
        ("worker_exited", {"cause": "root_cause"}),
        ("restart", {"counted": True, "reason": "worker_failed"}),
        ("node_lost", {}),
        ("spare_promoted", {}),
        ("job_failed", {"source": "agent"}),
        ("job_finished", {"source": "agent"}),
        (EVIL, {}),
    ]
    lines = []
    for i, (kind, fixed) in enumerate(kinds):
        event: dict[str, Any] = {name: EVIL + name for name in FIELDS}
        event |= {"kind": kind, "ts": 1_700_000_000.0 + i, **fixed}
        event["node_id"] = f"node-{i % 2}{EVIL}"
        lines.append(json.dumps(event))
    # Fields of the wrong type, alongside sane ones.
    wrong: dict[str, Any] = {name: [EVIL, {"x": EVIL}] for name in FIELDS}
    lines.append(json.dumps(wrong | {"kind": "workers_started", "ts": 1_700_000_010.5}))
    lines.append(json.dumps({"kind": "round_opened", "ts": 1_700_000_011, "round": 10**300}))
    # Lines no event may come from: a time stamp too large for a float (it
    # crashed the page), NaN, nesting past the bound, a list.
    lines.append('{"kind": "restart", "ts": ' + "9" * 400 + "}")
    lines.append('{"kind": "restart", "ts": NaN}')
    lines.append('{"ts": 1700000001, "x": ' + "[" * 50_000 + "]" * 50_000 + "}")
    lines.append("[1, 2, 3]")
    # A huge line (under the 1 MiB bound): a host of 600 KB, and 2000 other fields.
    huge: dict[str, Any] = {f"f{i}": EVIL for i in range(2_000)}
    huge |= {"kind": "workers_started", "ts": 1_700_000_012.0, "node_id": "big"}
    huge["host"] = "<b>" * 200_000
    lines.append(json.dumps(huge))
    return lines


def test_a_hostile_event_log_is_drawn_escaped_and_bounded(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    log.write_text("\n".join(hostile_log()) + "\n")
    events = load_events([str(log)])
    assert len(events) == 12  # the 9 events, the wrong types, the round, the huge line
    for e in events:  # what an event holds is bounded, whatever its line
        assert set(e.fields) <= FIELDS
        assert all(isinstance(v, str | int | float | bool) for v in e.fields.values())
        assert sum(len(str(v)) for v in e.fields.values()) <= len(FIELDS) * MAX_FIELD
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
