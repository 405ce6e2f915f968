"""``elastrun timeline`` draws fault attribution: a verdict, a quarantine and a
failed health check each as a mark on its node's lane, with its line."""

from __future__ import annotations

from xml.etree import ElementTree

from tests.unit.test_timeline_nodes import T, dots, lanes, on_lane, page, two_nodes

BROWN = "#8c564b"


def titles(svg: ElementTree.Element, color: str) -> list[tuple[float, str]]:
    return [
        (float(c.get("cy", 0)), "".join(t.text or "" for t in c))
        for c in svg.iter()
        if c.tag.endswith("circle") and c.get("fill") == color
    ]


def test_verdicts_quarantines_and_health_failures_are_marked_on_their_lanes() -> None:
    summary = "node fault: node h2 failed 2 times in a row (RuntimeError: CUDA error)"
    raw = [
        *two_nodes(),
        {"ts": T + 3, "kind": "fault_verdict", "summary": summary, "node_id": "n1", "host": "h1"},
        {"ts": T + 3, "kind": "node_quarantined", "until": T + 603, "reason": summary}
        | {"node_id": "n2", "host": "h2", "quarantined_host": "h2"},
        {"ts": T + 4, "kind": "node_health_failed", "when": "before_round", "command": "false"}
        | {"reason": "exited with code 1", "node_id": "n3", "host": "h3"},
    ]
    _, svg = page(raw)
    marks = titles(svg, BROWN)
    assert len(marks) == 3 and len(dots(svg, BROWN)) == 3
    by_lane = lanes(svg)
    (verdict,) = [t for y, t in marks if on_lane(y, by_lane["h1"])]
    assert summary in verdict
    (quarantine,) = [t for y, t in marks if on_lane(y, by_lane["h2"])]
    assert "quarantined until" in quarantine and summary in quarantine
    (health,) = [t for y, t in marks if on_lane(y, by_lane["h3"])]
    assert "health check failed (before_round): false exited with code 1" in health
