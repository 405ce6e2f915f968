"""``elastrun timeline`` draws fault attribution: a verdict, a quarantine, a
refused quarantined node and a failed health check each as a mark on its
node's lane, with its line; a quarantine's end that is no plausible time does
not break the page."""

from __future__ import annotations

import json
from pathlib import Path
from xml.etree import ElementTree

from elastrun.event_kinds import StragglerReplacement
from elastrun.status.timeline import load_events
from tests.unit.test_timeline_nodes import T, dots, lanes, on_lane, page, two_nodes
from tests.unit.timeline_events import (
    health_failed,
    line,
    logged,
    quarantined,
    refused,
    verdict,
)

BROWN = "#8c564b"


def titles(svg: ElementTree.Element, color: str) -> list[tuple[float, str]]:
    return [
        (float(c.get("cy", 0)), "".join(t.text or "" for t in c))
        for c in svg.iter()
        if c.tag.endswith("circle") and c.get("fill") == color
    ]


def test_verdicts_quarantines_and_health_failures_are_marked_on_their_lanes() -> None:
    summary = "node fault: node h2 failed 2 times in a row (RuntimeError: CUDA error)"
    events = [
        *two_nodes(),
        logged(T + 3, verdict(0, summary, "h2"), "n1", "h1"),
        logged(T + 3, quarantined("h2", T + 603, summary), "n2", "h2"),
        logged(T + 4, health_failed("false", "before_round", "exited with code 1"), "n3", "h3"),
        logged(T + 5, refused("h4", T + 603), "n4", "h4"),
    ]
    _, svg = page(events)
    marks = titles(svg, BROWN)
    assert len(marks) == 4 and len(dots(svg, BROWN)) == 4
    by_lane = lanes(svg)
    (said,) = [t for y, t in marks if on_lane(y, by_lane["h1"])]
    assert summary in said
    (quarantine,) = [t for y, t in marks if on_lane(y, by_lane["h2"])]
    assert "quarantined until" in quarantine and summary in quarantine
    (health,) = [t for y, t in marks if on_lane(y, by_lane["h3"])]
    assert "health check failed (before_round): false exited with code 1" in health
    (refusal,) = [t for y, t in marks if on_lane(y, by_lane["h4"])]
    assert "refused: this node is quarantined until" in refusal


def test_a_quarantine_ending_at_no_plausible_time_is_drawn(tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    raw = [line(T, e.event, e.node_id, e.host) for e in two_nodes()]
    raw.append(line(T + 3, quarantined("h2", 1e300, "node fault"), "n2", "h2"))
    raw.append(line(T + 4, refused("h2", -1e300), "n2", "h2"))
    log.write_text("".join(json.dumps(r) + "\n" for r in raw))
    _, svg = page(load_events([str(log)]))
    lines = [t for _, t in titles(svg, BROWN)]
    assert any("quarantined until 1e+300 (not a time)" in t for t in lines), lines
    assert any("quarantined until -1e+300 (not a time)" in t for t in lines), lines


def test_a_straggler_replaced_is_marked_on_the_deciding_node_s_lane() -> None:
    decided = StragglerReplacement(
        round=0,
        node="h2",
        node_id="n2",
        ranks=[1],
        intervals=2,
        replaced=True,
        why="replaced by a waiting spare",
        until=T + 603,
    )
    _, svg = page([*two_nodes(), logged(T + 3, decided, "n1", "h1")])
    (mark,) = [t for y, t in titles(svg, BROWN) if on_lane(y, lanes(svg)["h1"])]
    assert "straggler h2 (2 intervals in a row): replaced by a spare" in mark
