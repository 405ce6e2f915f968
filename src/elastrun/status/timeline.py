"""``elastrun timeline EVENTS.jsonl... --out timeline.html``: the job's history
as one self-contained HTML page (inline SVG, no scripts, no dependencies).

Drawn from the agents' event logs (docs/events.md): one lane per node with its
workers' running spans, the rounds (with why each was opened), the world size
over time, worker failures (root causes) and restarts.
"""

from __future__ import annotations

import argparse
import html
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["load_events", "main", "render_html"]

WIDTH = 1100
LEFT = 170
RIGHT = 30
LANE_H = 26
WORLD_H = 90


@dataclass
class _Lane:
    label: str
    spans: list[tuple[float, float, int]] = field(default_factory=list)  # start, end, round
    started: tuple[float, int] | None = None
    marks: list[tuple[float, str, str]] = field(default_factory=list)  # ts, color, title


def load_events(paths: Sequence[str]) -> list[dict[str, Any]]:
    """Every event of the files, in time order (unreadable lines are skipped
    with a warning: an agent killed mid-write leaves a partial last line)."""
    events: list[dict[str, Any]] = []
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except ValueError:
                    print(f"elastrun timeline: skipping {path}:{n}: not JSON", file=sys.stderr)
                    continue
                if isinstance(obj, dict) and isinstance(obj.get("ts"), (int, float)):
                    events.append(obj)
    events.sort(key=lambda e: float(e["ts"]))
    return events


def _fmt(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts))


def _failure_title(e: dict[str, Any]) -> str:
    how = f"signal {e['signal']}" if e.get("signal") else f"exit code {e.get('exitcode')}"
    return f"{_fmt(e['ts'])} rank {e.get('rank')} on {e.get('host')}: {how} (root cause)"


def render_html(events: list[dict[str, Any]], title: str = "") -> str:
    """The timeline page for ``events`` (in time order)."""
    if not events:
        return "<!doctype html><meta charset=utf-8><title>elastrun timeline</title><p>no events"
    t0, t1 = float(events[0]["ts"]), float(events[-1]["ts"])
    span = max(t1 - t0, 1e-3)
    plot_w = WIDTH - LEFT - RIGHT

    def x(ts: float) -> float:
        return LEFT + (ts - t0) / span * plot_w

    lanes: dict[str, _Lane] = {}
    rounds: list[tuple[float, int, str]] = []  # ts, round, reason
    world: list[tuple[float, int]] = [(t0, 0)]
    seen_world: set[int] = set()
    restarts: list[tuple[float, str]] = []
    for e in events:
        kind, ts = e.get("kind"), float(e["ts"])
        key = str(e.get("node_id") or "")
        if not key:  # before the agent joined the rendezvous (agent_started): no lane
            if kind in {"round_opened", "workers_started"}:
                key = str(e.get("host") or "?")
            else:
                continue
        lane = lanes.setdefault(key, _Lane(f"{e.get('host', '?')} {key[-6:]}"))
        if kind == "round_opened":
            rounds.append((ts, int(e.get("round", -1)), str(e.get("reason", ""))))
            if int(e.get("round", 0)) > 0:
                world.append((ts, 0))
        elif kind == "workers_started":
            lane.started = (ts, int(e.get("round", -1)))
            r = int(e.get("round", -1))
            if r not in seen_world:
                seen_world.add(r)
                world.append((ts, int(e.get("world_size", 0))))
        elif kind in ("restart", "workers_succeeded", "job_failed") and lane.started:
            lane.spans.append((lane.started[0], ts, lane.started[1]))
            lane.started = None
        if kind == "worker_exited" and e.get("cause") == "root_cause":
            lane.marks.append((ts, "#d62728", _failure_title(e)))
        elif kind == "restart" and e.get("counted") and e.get("reason") == "worker_failed":
            restarts.append((ts, f"{_fmt(ts)} restart {e.get('count')} (worker failed)"))
        elif kind == "node_lost":
            lane.marks.append((ts, "#9467bd", f"{_fmt(ts)} {e.get('detail', 'node lost')}"))
        elif kind in ("job_finished", "job_failed") and e.get("source") == "agent":
            color = "#2ca02c" if kind == "job_finished" else "#d62728"
            lane.marks.append((ts, color, f"{_fmt(ts)} {kind} ({e.get('reason', '')})"))
    world.append((t1, 0))
    for lane in lanes.values():
        if lane.started:
            lane.spans.append((lane.started[0], t1, lane.started[1]))

    top = 40
    lane_top = top + WORLD_H + 30
    height = lane_top + LANE_H * len(lanes) + 40
    out: list[str] = []
    add = out.append
    add(f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" ')
    add('font-family="sans-serif" font-size="11">')
    # Rounds: alternating bands with their number and reason.
    for i, (ts, r, reason) in enumerate(rounds):
        end = rounds[i + 1][0] if i + 1 < len(rounds) else t1
        fill = "#f4f4f4" if i % 2 else "#e8eef7"
        w = max(x(end) - x(ts), 1.0)
        add(f'<rect x="{x(ts):.1f}" y="{top - 20}" width="{w:.1f}" height="{height - top}" ')
        add(f'fill="{fill}"><title>round {r}: {html.escape(reason)} at {_fmt(ts)}</title></rect>')
        add(f'<text x="{x(ts) + 3:.1f}" y="{top - 8}">round {r}</text>')
    # World size over time (a step line).
    max_world = max((w for _, w in world), default=1) or 1
    pts: list[str] = []
    prev = 0
    for ts, w in world:
        y_prev = top + WORLD_H - prev / max_world * WORLD_H
        y_new = top + WORLD_H - w / max_world * WORLD_H
        pts += [f"{x(ts):.1f},{y_prev:.1f}", f"{x(ts):.1f},{y_new:.1f}"]
        prev = w
    add(f'<text x="10" y="{top + WORLD_H / 2:.0f}">world size (max {max_world})</text>')
    add(f'<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="{" ".join(pts)}"/>')
    for ts, w in world[1:-1]:
        y = top + WORLD_H - w / max_world * WORLD_H
        add(f'<text x="{x(ts) + 2:.1f}" y="{y - 3:.1f}" fill="#1f77b4">{w}</text>')
    # Restarts: dashed lines across the plot.
    for ts, label in restarts:
        add(f'<line x1="{x(ts):.1f}" x2="{x(ts):.1f}" y1="{top}" y2="{height - 30}" ')
        add(f'stroke="#ff7f0e" stroke-dasharray="4 3"><title>{html.escape(label)}</title></line>')
    # One lane per node: worker spans and marks.
    for i, lane in enumerate(lanes.values()):
        y = lane_top + i * LANE_H
        add(f'<text x="10" y="{y + 15}">{html.escape(lane.label)}</text>')
        for start, end, r in lane.spans:
            w = max(x(end) - x(start), 1.0)
            add(f'<rect x="{x(start):.1f}" y="{y + 4}" width="{w:.1f}" height="{LANE_H - 8}" ')
            add(f'fill="#9ecae1"><title>workers, round {r}: {_fmt(start)}-{_fmt(end)}</title>')
            add("</rect>")
        for ts, color, label in lane.marks:
            add(f'<circle cx="{x(ts):.1f}" cy="{y + LANE_H / 2}" r="5" fill="{color}">')
            add(f"<title>{html.escape(label)}</title></circle>")
    add(f'<text x="{LEFT}" y="{height - 10}">{_fmt(t0)}</text>')
    add(f'<text x="{WIDTH - RIGHT}" y="{height - 10}" text-anchor="end">{_fmt(t1)}</text>')
    add("</svg>")
    failures = [
        _failure_title(e)
        for e in events
        if e.get("kind") == "worker_exited" and e.get("cause") == "root_cause"
    ]
    legend = (
        "<p>Bands: rounds. Blue line: world size. Blue bars: a node's workers running. "
        "Red dot: a root-cause worker failure. Orange dashes: a counted restart. "
        "Purple: a node lost. Green: an agent finished. Hover for details.</p>"
    )
    items = "".join(f"<li>{html.escape(f)}</li>" for f in failures) or "<li>none</li>"
    name = html.escape(title or str(events[0].get("run_id", "")))
    return (
        f"<!doctype html><html><head><meta charset=utf-8><title>elastrun timeline {name}"
        f"</title></head><body><h2>job {name}: {len(rounds)} rounds, {len(restarts)} restarts"
        f", {len(lanes)} nodes</h2>{''.join(out)}{legend}<h3>failures</h3><ul>{items}</ul>"
        "</body></html>\n"
    )


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="elastrun timeline",
        description="Draw a job's history from its agents' event logs as one HTML page.",
    )
    parser.add_argument("files", nargs="+", metavar="EVENTS.jsonl")
    parser.add_argument("--out", "-o", default="timeline.html", help="(default timeline.html)")
    parser.add_argument("--title", default="", help="page title (default: the run id)")
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    try:
        events = load_events(args.files)
        page = render_html(events, args.title)
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(page)
    except OSError as exc:
        print(f"elastrun timeline: error: {exc}", file=sys.stderr)
        return 1
    print(f"elastrun timeline: {len(events)} events -> {args.out}")
    return 0
