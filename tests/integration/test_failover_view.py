"""The operator's view of a job that lives through a worker crash, its store
host's loss and a spare's promotion (docs/events.md, docs/failover.md).

Three agents on one machine, candidate hosts 127.0.0.1/.2/.3, ``--nnodes=2:3
--node-unit=2``: two train, the third waits as a spare. ``elastrun status
--watch`` is started before any agent: it waits for the store and the job.
Rank 1 crashes (one restart); then the store host's agent is SIGKILLed: the
second candidate takes over (term 2) and the spare takes the lost node's
place. The watch follows the job to its new host until it finishes. The event
logs are drawn by ``elastrun timeline``, and the page is rendered by a real
browser (headless Chromium): no console error, and the rows and marks of the
crash, the takeover, the lost host and the promotion are there, and painted.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import pytest

from tests.helpers import port_on_every, stop_groups, wait_for
from tests.integration.browser import CHROMIUM, SKIP_REASON, colors, render
from tests.integration.elastic_harness import BOUND, ELASTRUN, Job, job, steps_after
from tests.integration.test_spares import kinds

HOUR = 3600
RUN_ID = "view-job"
RED, ORANGE, PURPLE, GREY = "#d62728", "#ff7f0e", "#9467bd", "#7f7f7f"
CYAN, BROWN, BAR = "#17becf", "#8c564b", "#9ecae1"


def flags(port: int, me: int, j: Job) -> list[str]:
    return [
        "--nnodes=2:3",
        "--node-unit=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port},127.0.0.2:{port},127.0.0.3:{port}",
        f"--local-addr=127.0.0.{me}",
        f"--rdzv-id={RUN_ID}",
        "--max-restarts=3",
        f"--rdzv-conf=last_call_timeout=1,lease_ttl={HOUR},join_timeout=120,"
        f"read_timeout={HOUR},failover_timeout=60",
        "--shutdown-timeout=5",
        f"--events-file={j.dir / f'events-n{me}.jsonl'}",
    ]


def run_job(j: Job, port: int) -> str:
    """The scenario, watched from before its start; the watch's output."""
    endpoint = f"127.0.0.1:{port},127.0.0.2:{port},127.0.0.3:{port}"
    watch_out = j.dir / "watch.out"
    watch_cmd = [*ELASTRUN, "status", "--rdzv-endpoint", endpoint, "--rdzv-id", RUN_ID]
    with open(watch_out, "wb") as out:
        watch = subprocess.Popen(
            [*watch_cmd, "--watch", "--json"],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_for(lambda: "waiting for the store" in watch_out.read_text(), BOUND, "the watch")
        a = j.start_agent("n1", flags(port, 1, j))
        b = j.start_agent("n2", flags(port, 2, j))
        wait_for(lambda: any(s["world"] == 2 for s in j.steps()), BOUND, "training at world 2")
        s = j.start_agent("n3", flags(port, 3, j))
        wait_for(lambda: kinds(j, "n3", "node_waiting"), BOUND, "the third node waits")
        mark = len(j.steps())
        j.touch("crash_rank_1")
        wait_for(
            lambda: steps_after(j, mark, lambda st: st["restart"] == 1 and st["world"] == 2),
            BOUND,
            "training at world 2 after the crash",
        )
        mark = len(j.steps())
        a.kill_group()
        wait_for(
            lambda: (
                {"n2", "n3"}
                <= {st["node"] for st in steps_after(j, mark, lambda st: st["world"] == 2)}
            ),
            BOUND,
            "the survivor and the spare training at world 2",
        )
        # The watch sees the store's loss after seconds of refused connections;
        # a job that ends sooner takes its store with it: let the watch reach
        # the new host before the job ends.
        wait_for(lambda: _terms(watch_out.read_text())[-1:] == [2], BOUND, "the watch at term 2")
        j.touch("finish")
        for agent in (b, s):
            assert agent.wait(BOUND) == 0, agent.output()[-3000:]
        assert watch.wait(BOUND) == 0, watch_out.read_text()[-3000:]
    finally:
        stop_groups(watch)
    return watch_out.read_text()


def _terms(said: str) -> list[int]:
    """The store terms of the summaries the watch printed, in order (whole
    lines only: the watch may be writing the last)."""
    whole = said[: said.rfind("\n") + 1]
    shown = [json.loads(ln) for ln in whole.splitlines() if ln.startswith("{")]
    return [s["store_hosts"]["term"] for s in shown]


def check_watch(said: str, port: int) -> None:
    """The watch waited for the store, then followed the job across the
    takeover to its end, never naming the host among the others."""
    shown = [json.loads(ln) for ln in said.splitlines() if ln.startswith("{")]
    notes = [ln for ln in said.splitlines() if not ln.startswith("{")]
    assert any("waiting for the store" in n for n in notes), notes
    assert any("looking for the new host" in n for n in notes), notes
    assert not any("error" in n for n in notes), notes
    terms = [s["store_hosts"]["term"] for s in shown]
    assert terms[0] == 1 and terms[-1] == 2 and terms == sorted(terms), terms
    assert shown[-1]["state"] == "finished", shown[-1]
    assert shown[-1]["store_hosts"]["host"] == f"127.0.0.2:{port}"
    for s in shown:
        hosts = s["store_hosts"]
        assert not any(o.startswith(hosts["host"] + " ") for o in hosts["others"]), hosts
        assert hosts["host"] not in hosts["standbys"], hosts


def draw(j: Job) -> tuple[Path, list[dict[str, Any]]]:
    logs = [j.dir / f"events-n{n}.jsonl" for n in (1, 2, 3)]
    page = j.dir / "timeline.html"
    proc = subprocess.run(
        [*ELASTRUN, "timeline", *map(str, logs), "--out", str(page)],
        capture_output=True,
        text=True,
        timeout=BOUND,
        check=False,
    )
    assert proc.returncode == 0 and "skipping" not in proc.stderr, proc.stderr
    events = [json.loads(ln) for log in logs for ln in log.read_text().splitlines() if ln]
    return page, events


def lane_of(svg: ElementTree.Element, node_id: str) -> float:
    """The y of the lane of ``node_id`` (its label ends with the id's last 6)."""
    for e in svg.iter():
        if e.tag.endswith("text") and (e.text or "").endswith(" " + node_id[-6:]):
            return float(e.get("y", 0))
    raise AssertionError(f"no lane for {node_id}")


def dots_on(svg: ElementTree.Element, color: str, lane_y: float) -> int:
    return sum(
        1
        for c in svg.iter()
        if c.tag.endswith("circle")
        and c.get("fill") == color
        and lane_y - 20 < float(c.get("cy", 0)) < lane_y + 10
    )


def check_restarts(events: list[dict[str, Any]]) -> None:
    """Every node's ``restart`` event says what the rendezvous charged: the
    crash's restart counted (restart 1), the host loss's not (still 1), even
    where a survivor's collective broke before its agent saw the host go (its
    restart is then a worker failure, collateral, not charged)."""
    restarts = sorted({e["round"] for e in events if e["kind"] == "restart"})
    assert len(restarts) == 2, events
    said = {(e["round"], e["counted"], e["count"]) for e in events if e["kind"] == "restart"}
    assert said == {(restarts[0], True, 1), (restarts[1], False, 1)}, said


def check_page(page: Path, events: list[dict[str, Any]]) -> None:
    """The page as Chromium parsed and painted it."""
    shown = render(page)
    assert shown.console == [], shown.console  # no error, nothing said at all
    dom = shown.dom
    head = dom[dom.index("<h2>") : dom.index("</h2>")]
    rounds = {e["round"] for e in events if e["kind"] == "workers_started"}
    restarts = {e["round"] for e in events if e["kind"] == "restart"}
    # The crash's restart is charged; the host loss's is not: the rounds'
    # restart counts say so. The page tells the charge, even where a survivor's
    # collective broke before its agent saw the host go (its agent announced
    # that restart counted, before the next round was charged).
    charged = {e["restart_count"] for e in events if e["kind"] == "workers_started"}
    assert len(restarts) == 2 and charged == {0, 1}, events
    want = f"{len(rounds)} rounds, 2 restarts (1 counted), 3 nodes"
    assert want in head, (want, head)
    svg = ElementTree.fromstring(dom[dom.index("<svg") : dom.index("</svg>") + 6])
    promoted = next(e for e in events if e["kind"] == "spare_promoted")
    lost_host, spare = promoted["replaces"], promoted["node_id"]
    taker = next(e["node_id"] for e in events if e["kind"] == "store_takeover" and e["term"] == 2)
    assert lost_host != taker
    assert dots_on(svg, PURPLE, lane_of(svg, lost_host)) == 1  # the killed host, lost
    assert dots_on(svg, BROWN, lane_of(svg, lost_host)) == 1  # it took the store at term 1
    assert dots_on(svg, BROWN, lane_of(svg, taker)) == 1  # the takeover, term 2
    assert dots_on(svg, CYAN, lane_of(svg, spare)) == 1  # the promotion
    # The crash's root cause, red, alone (in the race above, the survivor's
    # failure is drawn as not counted: orange).
    assert sum(dots_on(svg, RED, lane_of(svg, n)) for n in (lost_host, taker, spare)) == 1
    legend = dom[dom.index("</svg>") :]
    assert "Cyan: a spare promoted" in legend and "Brown:" in legend
    assert "hosts the store from term 2" in legend  # the store hosts' list
    painted = colors(shown.png)
    for color in (PURPLE, BROWN, CYAN, RED, BAR):
        assert painted[color] > 20, (color, painted.most_common(12))


def test_a_crash_a_takeover_and_a_promotion_as_the_operator_sees_them(tmp_path: Path) -> None:
    port = port_on_every()
    with job(tmp_path) as j:
        said = run_job(j, port)
    check_watch(said, port)
    page, events = draw(j)
    check_restarts(events)
    if CHROMIUM is None:  # the job and the watch were checked; the page needs a browser
        pytest.skip(SKIP_REASON)
    check_page(page, events)
