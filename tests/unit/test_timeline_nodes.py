"""``elastrun timeline`` on multi-node jobs, read from the drawn page: a
SIGKILLed node's workers' bar ends where the node was lost, and its "node
lost" mark sits on its own lane; agents stopped by a signal are not drawn as
failures; a node whose ranks failed after another node's crash is not drawn
as a root cause; a store failover is drawn with its rounds, its restarts, the
lost host's end, the takeover and the spare's promotion."""

from __future__ import annotations

from xml.etree import ElementTree

from elastrun.event_kinds import NodeJoined
from elastrun.status.timeline import LEFT, RIGHT, WIDTH, LoggedEvent, render_html
from tests.unit.timeline_events import (
    elsewhere,
    exited,
    failed,
    finished,
    host_lost,
    logged,
    lost,
    opened,
    promoted,
    restart,
    started,
    took_over,
)

T = 1_700_000_000.0
RED, ORANGE, PURPLE, GREY = "#d62728", "#ff7f0e", "#9467bd", "#7f7f7f"
CYAN, BROWN = "#17becf", "#8c564b"


def joined(r: int, node: str) -> NodeJoined:
    return NodeJoined(round=r, node=node, host="h")


def page(events: list[LoggedEvent]) -> tuple[str, ElementTree.Element]:
    html = render_html(sorted(events, key=lambda e: e.ts))
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


def two_nodes() -> list[LoggedEvent]:
    return [
        logged(T, opened(0), "n1", "h1"),
        logged(T + 0.1, started(0, 2), "n1", "h1"),
        logged(T + 0.1, started(0, 2), "n2", "h2"),
    ]


def test_a_killed_nodes_bar_ends_where_it_was_lost_and_the_mark_is_on_its_lane() -> None:
    t_lost = T + 30.0
    events = [
        *two_nodes(),
        # n2 is SIGKILLed: no more events of its own; n1 sees it lost
        logged(t_lost, lost(0, "node h2 (n2) lost: lease expired or revoked", "n1"), "n1", "h1"),
        logged(t_lost + 0.1, restart(0, 0, "member_lost", counted=False), "n1", "h1"),
        logged(t_lost + 1, started(1, 1), "n1", "h1"),
        logged(T + 100.0, finished(), "n1", "h1"),
    ]
    _, svg = page(events)
    y = lanes(svg)
    ((_, end),) = bars(svg, y["h2"])
    assert abs(end - x_of(t_lost, T, T + 100)) < 1.5, (end, x_of(t_lost, T, T + 100))
    (_, cy), *more = dots(svg, PURPLE)
    assert not more and on_lane(cy, y["h2"]) and not on_lane(cy, y["h1"])


def test_agents_stopped_by_a_signal_are_not_failures() -> None:
    events = [
        *two_nodes(),
        logged(T + 5, failed("signal SIGTERM"), "n1", "h1"),
        logged(T + 5, failed("signal SIGTERM"), "n2", "h2"),
    ]
    html, svg = page(events)
    assert not dots(svg, RED)
    assert len(dots(svg, GREY)) == 2
    assert "<h3>failures</h3><ul><li>none</li>" in html


def test_a_node_whose_ranks_failed_after_another_nodes_is_not_the_root_cause() -> None:
    events = [
        *two_nodes(),
        logged(T + 10.0, exited(0, 1), "n2", "h2"),
        logged(T + 10.2, exited(0, 0), "n1", "h1"),
        logged(T + 11.0, elsewhere(0), "n1", "h1"),
        logged(T + 12.0, finished(), "n1", "h1"),
    ]
    html, svg = page(events)
    y = lanes(svg)
    (red,) = dots(svg, RED)
    assert on_lane(red[1], y["h2"])
    (orange,) = dots(svg, ORANGE)
    assert on_lane(orange[1], y["h1"])
    failures = html.split("<h3>failures</h3>", 1)[1]
    assert "rank 1 on h2" in failures and "rank 0 on h1" not in failures


def test_a_restart_reported_by_every_failing_node_is_one_restart() -> None:
    events = [
        *two_nodes(),
        logged(T + 10.0, restart(0, 1), "n1", "h1"),
        logged(T + 10.1, restart(0, 1), "n2", "h2"),
        logged(T + 12.0, finished(), "n1", "h1"),
    ]
    html, svg = page(events)
    assert "1 restart," in html
    assert sum(1 for e in svg.iter() if e.get("stroke-dasharray")) == 1


def test_a_store_failover_is_drawn_with_its_rounds_restarts_loss_takeover_and_spare() -> None:
    """The store's host (n1, which took the store at term 1) is SIGKILLed
    after a crash: n2 takes over (term 2), the spare n3 takes n1's place in a
    round that no round_opened announces (it was opened on the new host)."""
    a1, a2 = "127.0.0.1:29400", "127.0.0.2:29400"
    t_kill = T + 40.0
    events = [
        logged(T - 1, took_over(1, a1), "n1", "h1"),
        *two_nodes(),
        logged(T + 20.0, exited(0, 1), "n2", "h2"),
        logged(T + 20.1, restart(0, 1), "n2", "h2"),
        logged(T + 20.1, restart(0, 1), "n1", "h1"),
        logged(T + 20.2, opened(1, "restart_requested"), "n2", "h2"),
        logged(T + 21.0, started(1, 2, restarts=1), "n1", "h1"),
        logged(T + 21.0, started(1, 2, restarts=1), "n2", "h2"),
        logged(t_kill, restart(1, 1, "store_host_lost", counted=False), "n2", "h2"),
        logged(t_kill, host_lost(1, a1), "n2", "h2"),
        logged(t_kill + 0.1, host_lost(1, a1), "n3", "h3"),
        logged(t_kill + 0.5, took_over(2, a2), "n2", "h2"),
        logged(t_kill + 0.6, joined(2, "n2"), "n2", "h2"),
        logged(t_kill + 0.7, promoted(2, "n3", 0, "n1"), "n3", "h3"),
        logged(t_kill + 0.8, started(2, 2, restarts=1), "n2", "h2"),
        logged(t_kill + 0.8, started(2, 2, restarts=1), "n3", "h3"),
        logged(T + 60.0, finished(), "n2", "h2"),
        logged(T + 60.0, finished(), "n3", "h3"),
    ]
    html, svg = page(events)
    head = html[html.index("<h2>") : html.index("</h2>")]
    assert "3 rounds, 2 restarts (1 counted), 3 nodes" in head, head
    y = lanes(svg)
    t0, t1 = T - 1, T + 60.0
    # the killed host's bar ends where it was lost, with the lost mark on its lane
    end = max(e for _, e in bars(svg, y["h1"]))
    assert abs(end - x_of(t_kill, t0, t1)) < 1.5, (end, x_of(t_kill, t0, t1))
    (purple,) = dots(svg, PURPLE)
    assert on_lane(purple[1], y["h1"]) and abs(purple[0] - x_of(t_kill, t0, t1)) < 1.5
    # the takeovers on their new hosts' lanes, and listed
    takers = sorted(dots(svg, BROWN))
    assert [on_lane(cy, y["h1"]) for _, cy in takers] == [True, False]
    assert on_lane(takers[1][1], y["h2"])
    assert f"{a2} hosts the store from term 2" in html.split("<h3>store hosts</h3>", 1)[1]
    # the spare's promotion on its lane, and in the legend
    (cyan,) = dots(svg, CYAN)
    assert on_lane(cyan[1], y["h3"])
    legend = html[html.index("</svg>") :]
    assert "Cyan: a spare promoted" in legend and "Brown:" in legend
    # the uncounted restart is a grey dash, the counted one orange
    dashes = sorted(e.get("stroke", "") for e in svg.iter() if e.get("stroke-dasharray"))
    assert dashes == sorted([ORANGE, GREY]), dashes


def test_a_restart_announced_counted_that_the_rendezvous_did_not_charge_is_not_counted() -> None:
    """A survivor's collective broke when the store's host died, before its
    agent saw the host go: its agent announced a counted restart for its
    failure. The next round started with the same restart count (a lost node
    is never charged): the page says so, and the failure is no root cause."""
    events = [
        *two_nodes(),
        logged(T + 10.0, exited(0, 1), "n2", "h2"),
        logged(T + 10.1, restart(0, 1), "n2", "h2"),
        logged(T + 11.0, started(1, 2, restarts=1), "n1", "h1"),
        logged(T + 11.0, started(1, 2, restarts=1), "n2", "h2"),
        logged(T + 20.0, exited(1, 0), "n1", "h1"),  # collateral to the host's loss
        logged(T + 20.1, restart(1, 2), "n1", "h1"),  # announced counted
        logged(T + 21.0, started(2, 2, restarts=1), "n1", "h1"),  # not charged
        logged(T + 30.0, finished(), "n1", "h1"),
    ]
    html, svg = page(events)
    head = html[html.index("<h2>") : html.index("</h2>")]
    assert "2 restarts (1 counted)" in head, head
    dashes = sorted(e.get("stroke", "") for e in svg.iter() if e.get("stroke-dasharray"))
    assert dashes == sorted([ORANGE, GREY]), dashes
    y = lanes(svg)
    (red,) = dots(svg, RED)
    assert on_lane(red[1], y["h2"])  # the crash, the root cause
    (orange,) = dots(svg, ORANGE)
    assert on_lane(orange[1], y["h1"])
    failures = html.split("<h3>failures</h3>", 1)[1]
    assert "rank 1 on h2" in failures and "rank 0 on h1" not in failures
