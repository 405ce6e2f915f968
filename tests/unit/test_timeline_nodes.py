"""``elastrun timeline`` on multi-node jobs, read from the drawn page: a
SIGKILLed node's workers' bar ends where the node was lost, and its "node
lost" mark sits on its own lane; agents stopped by a signal are not drawn as
failures; a node whose ranks failed after another node's crash is not drawn
as a root cause."""

from __future__ import annotations

from typing import Any
from xml.etree import ElementTree

from elastrun.status.timeline import LEFT, RIGHT, WIDTH, LoggedEvent, render_html

T = 1_700_000_000.0
RED, ORANGE, PURPLE, GREY = "#d62728", "#ff7f0e", "#9467bd", "#7f7f7f"


def page(raw: list[dict[str, Any]]) -> tuple[str, ElementTree.Element]:
    events = [LoggedEvent.from_json(e) for e in sorted(raw, key=lambda e: e["ts"])]
    html = render_html([e for e in events if e is not None])
    return html, ElementTree.fromstring(html[html.index("<svg") : html.index("</svg>") + 6])


def lanes(svg: ElementTree.Element) -> dict[str, float]:
    """Each lane's label -> its y (the label's baseline)."""
    return {
        (e.text or "").split()[0]: float(e.get("y", 0))
        for e in svg.iter()
        if e.tag.endswith("text") and float(e.get("x", 0)) == 10 and (e.text or "").startswith("h")
    }


def on_lane(y: float, lane_y: float) -> bool:
    return lane_y - 20 < y < lane_y + 10


def bars(svg: ElementTree.Element, lane_y: float) -> list[tuple[float, float]]:
    return [
        (float(r.get("x", 0)), float(r.get("x", 0)) + float(r.get("width", 0)))
        for r in svg.iter()
        if r.tag.endswith("rect")
        and r.get("fill") == "#9ecae1"
        and on_lane(float(r.get("y", 0)), lane_y)
    ]


def dots(svg: ElementTree.Element, color: str) -> list[tuple[float, float]]:
    return [
        (float(c.get("cx", 0)), float(c.get("cy", 0)))
        for c in svg.iter()
        if c.tag.endswith("circle") and c.get("fill") == color
    ]


def x_of(ts: float, t0: float, t1: float) -> float:
    return LEFT + (ts - t0) / (t1 - t0) * (WIDTH - LEFT - RIGHT)


def two_nodes() -> list[dict[str, Any]]:
    return [
        {"ts": T, "kind": "round_opened", "round": 0, "node_id": "n1", "host": "h1"},
        {"ts": T + 0.1, "kind": "workers_started", "round": 0, "world_size": 2}
        | {"node_id": "n1", "host": "h1"},
        {"ts": T + 0.1, "kind": "workers_started", "round": 0, "world_size": 2}
        | {"node_id": "n2", "host": "h2"},
    ]


def test_a_killed_nodes_bar_ends_where_it_was_lost_and_the_mark_is_on_its_lane() -> None:
    lost = T + 30.0
    raw = [
        *two_nodes(),
        {"ts": T + 0.2, "kind": "round_joined", "node_id": "n2", "host": "h2"},
        # n2 is SIGKILLed: no more events of its own; n1 sees it lost
        {
            "ts": lost,
            "kind": "node_lost",
            "round": 0,
            "detail": "node h2 (n2) lost: lease expired or revoked",
            "by": "n1",
            "node_id": "n1",
            "host": "h1",
        },
        {"ts": lost + 0.1, "kind": "restart", "reason": "member_lost", "node_id": "n1"},
        {"ts": lost + 1, "kind": "workers_started", "round": 1, "world_size": 1, "node_id": "n1"},
        {"ts": T + 100.0, "kind": "job_finished", "source": "agent", "node_id": "n1"},
    ]
    _, svg = page(raw)
    y = lanes(svg)
    ((_, end),) = bars(svg, y["h2"])
    assert abs(end - x_of(lost, T, T + 100)) < 1.5, (end, x_of(lost, T, T + 100))
    (_, cy), *more = dots(svg, PURPLE)
    assert not more and on_lane(cy, y["h2"]) and not on_lane(cy, y["h1"])


def test_agents_stopped_by_a_signal_are_not_failures() -> None:
    raw = [
        *two_nodes(),
        {"ts": T + 5, "kind": "job_failed", "source": "agent", "reason": "signal SIGTERM"}
        | {"node_id": "n1", "host": "h1"},
        {"ts": T + 5, "kind": "job_failed", "source": "agent", "reason": "signal SIGTERM"}
        | {"node_id": "n2", "host": "h2"},
    ]
    html, svg = page(raw)
    assert not dots(svg, RED)
    assert len(dots(svg, GREY)) == 2
    assert "<h3>failures</h3><ul><li>none</li>" in html


def test_a_node_whose_ranks_failed_after_another_nodes_is_not_the_root_cause() -> None:
    crash = {"kind": "worker_exited", "round": 0, "cause": "root_cause", "exitcode": 1}
    raw = [
        *two_nodes(),
        {"ts": T + 10.0, "rank": 1, "node_id": "n2", "host": "h2"} | crash,
        {"ts": T + 10.2, "rank": 0, "node_id": "n1", "host": "h1"} | crash,
        {"ts": T + 11.0, "kind": "root_cause_elsewhere", "round": 0, "node_id": "n1"},
        {"ts": T + 12.0, "kind": "job_finished", "source": "agent", "node_id": "n1"},
    ]
    html, svg = page(raw)
    y = lanes(svg)
    (red,) = dots(svg, RED)
    assert on_lane(red[1], y["h2"])
    (orange,) = dots(svg, ORANGE)
    assert on_lane(orange[1], y["h1"])
    failures = html.split("<h3>failures</h3>", 1)[1]
    assert "rank 1 on h2" in failures and "rank 0 on h1" not in failures


def test_a_restart_reported_by_every_failing_node_is_one_restart() -> None:
    restart = {"kind": "restart", "reason": "worker_failed", "counted": True, "count": 1}
    raw = [
        *two_nodes(),
        {"ts": T + 10.0, "round": 0, "node_id": "n1", "host": "h1"} | restart,
        {"ts": T + 10.1, "round": 0, "node_id": "n2", "host": "h2"} | restart,
        {"ts": T + 12.0, "kind": "job_finished", "source": "agent", "node_id": "n1"},
    ]
    html, svg = page(raw)
    assert "1 restart," in html
    assert sum(1 for e in svg.iter() if e.get("stroke-dasharray")) == 1
