"""``elastrun timeline EVENTS.jsonl... --out timeline.html``: the job's history
as one self-contained HTML page (inline SVG, no scripts, no dependencies).

Drawn from the agents' event logs (docs/events.md): one lane per node with its
workers' running spans, the rounds (with why each was opened), the world size
over time, worker failures (root causes) and restarts, over a time axis (ticks
at round steps from the first event). Labels that would overlap (rounds opened
milliseconds apart at a restart) are placed on further rows, or left to the
tooltips.

Event logs may hold what other nodes or workers wrote (host names, failure
messages, round details), or anything at all: every string drawn is escaped
for HTML and its control characters shown as escapes (``\\x1b``); a line that
is not JSON within the bounds (``MAX_LINE_BYTES``, nesting depth) is skipped.
Of a line, only the fields the page draws are kept (``FIELDS``), and only
scalars within bounds: a string cut at ``MAX_FIELD`` characters, an integer
within ``MAX_INT``, a finite number; a field of another type or out of bounds
reads as absent. So an event held costs at most a few KiB, whatever its line.
"""

from __future__ import annotations

import argparse
import html
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from elastrun.event_kinds import (
    FaultVerdict,
    JobFailed,
    JobFinished,
    NodeHealthFailed,
    NodeLost,
    NodeQuarantined,
    QuarantineRefused,
    Restart,
    RootCauseElsewhere,
    RoundOpened,
    SparePromoted,
    WorkerExited,
    WorkersStarted,
    WorkersSucceeded,
)
from elastrun.failure import FailureRecord
from elastrun.rendezvous.plan import lost_node
from elastrun.untrusted import UntrustedData, loads, printable

__all__ = [
    "LoggedEvent",
    "axis_ticks",
    "fmt_offset",
    "load_events",
    "main",
    "place_labels",
    "render_html",
]

WIDTH = 1100
MAX_LINE_BYTES = 1024 * 1024  # one event (a failure record with its traceback is ~10 KiB)
MAX_TEXT = 500  # characters of one string drawn
MAX_FIELD = 1000  # characters of one string field kept (drawn cut to MAX_TEXT)
MAX_INT = 2**53  # an integer field beyond +-MAX_INT reads as absent
# The fields the page reads; the others of a line are not kept.
FIELDS = frozenset(
    {"kind", "ts", "run_id", "node_id", "host", "round", "reason", "world_size", "cause"}
    | {"counted", "count", "detail", "replaces", "group_rank", "source", "rank", "exitcode"}
    | {"signal"}
    | {"summary", "until", "command", "when"}  # fault attribution
)
MAX_TS = 1e11  # an event's time stamp (wall clock, s): beyond it, not an event of ours
LEFT = 170
RIGHT = 30
LANE_H = 26
WORLD_H = 90
LABEL_TOP = 4
LABEL_ROWS = 3  # rows for round labels above the plot
LABEL_ROW_H = 12
CHAR_W = 6.2  # estimated width of a character at font-size 11
MIN_TICK_PX = 70  # ticks at least this far apart
# Tick steps in seconds: 1 2 5 10 15 30 s, 1 2 5 10 15 30 min, 1 2 3 6 12 h, days.
STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200)


@dataclass
class _Lane:
    label: str
    spans: list[tuple[float, float, int]] = field(default_factory=list)  # start, end, round
    started: tuple[float, int] | None = None
    marks: list[tuple[float, str, str]] = field(default_factory=list)  # ts, color, title


@dataclass(frozen=True)
class LoggedEvent:
    """One line of an agent's event log (docs/events.md): its kind, its
    wall-clock time stamp, and its other fields as written. The fields may
    hold anything (other nodes' and workers' words): read them through the
    accessors, which read a field of the wrong type as absent."""

    kind: str
    ts: float
    fields: Mapping[str, object] = field(default_factory=dict)

    @classmethod
    def from_json(cls, raw: object) -> LoggedEvent | None:
        """The event in a decoded line; None when it is not one (not a JSON
        object, or no time stamp from 0 to ``MAX_TS``). Only the fields of
        ``FIELDS`` are kept, and of them only the scalars within bounds."""
        if not isinstance(raw, Mapping):
            return None
        ts = _number(raw.get("ts"))
        if ts is None or not 0 <= ts <= MAX_TS:
            return None
        kept = {name: _scalar(raw[name]) for name in FIELDS if name in raw}
        fields = {name: value for name, value in kept.items() if value is not None}
        kind = fields.get("kind")
        return cls(kind if isinstance(kind, str) else "", ts, fields)

    def text(self, name: str, default: str = "") -> str:
        """A field as text (``default`` when absent or null)."""
        value = self.fields.get(name)
        return default if value is None else str(value)

    def integer(self, name: str, default: int) -> int:
        value = self.optional_integer(name)
        return default if value is None else value

    def optional_integer(self, name: str) -> int | None:
        value = self.fields.get(name)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def flag(self, name: str) -> bool:
        return self.fields.get(name) is True

    def failure_title(self) -> str:
        """A ``worker_exited`` event as the one failure line of
        :meth:`FailureRecord.describe` (``rank 1 on host-a exited with code 1``)."""
        signal = self.fields.get("signal")
        record = FailureRecord(
            host=self.text("host", "?"),
            rank=self.optional_integer("rank"),
            exitcode=self.optional_integer("exitcode"),
            signal=signal if isinstance(signal, str) else None,
        )
        return f"{_fmt(self.ts)} {record.describe()} (root cause)"


def load_events(paths: Sequence[str]) -> list[LoggedEvent]:
    """Every event of the files, in time order (unreadable lines are skipped
    with a warning: an agent killed mid-write leaves a partial last line)."""
    events: list[LoggedEvent] = []
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = loads(line, max_bytes=MAX_LINE_BYTES, what="the line")
                except UntrustedData as exc:
                    print(
                        f"elastrun timeline: skipping {printable(path)}:{n}: {exc}",
                        file=sys.stderr,
                    )
                    continue
                event = LoggedEvent.from_json(obj)
                if event is not None:
                    events.append(event)
    events.sort(key=lambda e: e.ts)
    return events


def _text(value: object) -> str:
    """A string from an event, safe inside HTML (and on a terminal)."""
    return html.escape(printable(value, limit=MAX_TEXT))


def _number(value: object) -> float | None:
    """A finite number as a float (None: not one; an integer too large for a
    float, as JSON allows, is not one)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, int):
        return float(value) if -MAX_INT <= value <= MAX_INT else None
    return value if math.isfinite(value) else None


def _scalar(value: object) -> str | int | float | bool | None:
    """A field's value as kept: a string cut at ``MAX_FIELD`` characters, a
    bool, an integer within ``MAX_INT``, a finite float; None for anything else."""
    if isinstance(value, str):
        return value[:MAX_FIELD]
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value if -MAX_INT <= value <= MAX_INT else None
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    return None


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def axis_ticks(span: float, width: float) -> list[float]:
    """Offsets (seconds from the start) of the axis ticks: a round step that
    keeps them at least MIN_TICK_PX apart on ``width`` pixels for ``span`` s."""
    if span <= 0 or width <= 0:
        return [0.0]
    wanted = span * MIN_TICK_PX / width
    step = next((float(s) for s in STEPS if s >= wanted), None)
    if step is None:
        step = 86400.0 * max(1, math.ceil(wanted / 86400))
    count = int(span // step)
    return [i * step for i in range(count + 1)]


def fmt_offset(seconds: float) -> str:
    """``0s``, ``45s``, ``2m``, ``2m30s``, ``1h``, ``1h05m``, ``2d``."""
    n = round(seconds)
    if n < 60:
        return f"{n}s"
    if n < 3600:
        m, s = divmod(n, 60)
        return f"{m}m{s:02d}s" if s else f"{m}m"
    if n < 86400:
        h, m = divmod(n // 60, 60)
        return f"{h}h{m:02d}m" if m else f"{h}h"
    d, h = divmod(n // 3600, 24)
    return f"{d}d{h:02d}h" if h else f"{d}d"


def place_labels(
    labels: Sequence[tuple[float, str]], rows: int, *, right: float, gap: float = 4.0
) -> list[tuple[float, int, str]]:
    """Place text labels (x, text) on ``rows`` rows so that none overlaps
    another: each goes on the first row where it fits after the labels
    already there; one that fits nowhere (or would cross ``right``) is left
    out. Returns (x, row, text) of the placed ones."""
    ends = [-math.inf] * rows
    placed: list[tuple[float, int, str]] = []
    for lx, text in sorted(labels, key=lambda item: item[0]):
        w = len(text) * CHAR_W
        if lx + w > right:
            continue
        for row in range(rows):
            if lx >= ends[row] + gap:
                ends[row] = lx + w
                placed.append((lx, row, text))
                break
    return placed


def _fmt(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts))


@dataclass
class _History:
    """What the page draws, gathered from the events in one pass."""

    t0: float
    t1: float
    lanes: dict[str, _Lane] = field(default_factory=dict)  # by node id
    rounds: list[tuple[float, int, str]] = field(default_factory=list)  # ts, round, reason
    world: list[tuple[float, int]] = field(default_factory=list)  # ts, world size
    restarts: list[tuple[float, str]] = field(default_factory=list)  # ts, title
    seen_world: set[int] = field(default_factory=set)  # rounds whose world is recorded
    # (node id, round) whose failures came after another node's root cause
    # (root_cause_elsewhere): their own "root cause" ranks are not the job's.
    elsewhere: set[tuple[str, int]] = field(default_factory=set)
    restarted: set[int] = field(default_factory=set)  # rounds that ended in a counted restart

    def add(self, e: LoggedEvent) -> None:
        key = e.text("node_id")
        if not key:  # before the agent joined the rendezvous (agent_started): no lane
            if e.kind not in {RoundOpened.KIND, WorkersStarted.KIND}:
                return
            key = e.text("host") or "?"
        lane = self.lanes.setdefault(key, _Lane(f"{e.text('host', '?')} {key[-6:]}"))
        self._spans(lane, e)
        self._marks(lane, e)

    def _spans(self, lane: _Lane, e: LoggedEvent) -> None:
        """Rounds, world size, and the lane's running spans."""
        kind, ts = e.kind, e.ts
        if kind == RoundOpened.KIND:
            self.rounds.append((ts, e.integer("round", -1), e.text("reason")))
            if e.integer("round", 0) > 0:
                self.world.append((ts, 0))
        elif kind == WorkersStarted.KIND:
            r = e.integer("round", -1)
            lane.started = (ts, r)
            if r not in self.seen_world:
                self.seen_world.add(r)
                self.world.append((ts, max(0, e.integer("world_size", 0))))
        elif kind in (Restart.KIND, WorkersSucceeded.KIND, JobFailed.KIND) and lane.started:
            lane.spans.append((lane.started[0], ts, lane.started[1]))
            lane.started = None

    def _marks(self, lane: _Lane, e: LoggedEvent) -> None:
        """Failures, counted restarts, lost nodes, promoted spares and finished agents."""
        kind, ts = e.kind, e.ts
        if _root_cause(e, self.elsewhere):
            lane.marks.append((ts, RED, e.failure_title()))
        elif _root_cause(e, set()):  # this node's, after another node's root cause
            title = e.failure_title().replace("(root cause)", "(after another node's failure)")
            lane.marks.append((ts, ORANGE, title))
        elif kind == Restart.KIND and e.flag("counted") and e.text("reason") == "worker_failed":
            # Every node whose ranks failed says so: one restart per round.
            r = e.integer("round", -1)
            if r not in self.restarted:
                self.restarted.add(r)
                self.restarts.append((ts, f"{_fmt(ts)} restart {e.text('count')} (worker failed)"))
        elif kind == NodeLost.KIND:
            self._lost(lane, e)
        elif kind == SparePromoted.KIND:
            took = e.text("replaces") or "a new rank"
            what = f"promoted: group rank {e.text('group_rank')}, in place of {took}"
            lane.marks.append((ts, "#17becf", f"{_fmt(ts)} {what}"))
        elif kind in (JobFinished.KIND, JobFailed.KIND) and e.text("source") == "agent":
            lane.marks.append(_agent_end(e))
        elif kind in _FAULT_MARKS:
            lane.marks.append((ts, BROWN, f"{_fmt(ts)} {_FAULT_MARKS[kind](e)}"))

    def _lost(self, lane: _Lane, e: LoggedEvent) -> None:
        """A node lost, drawn on the lost node's lane (the event is the
        survivor's), whose workers' bar ends there."""
        detail = e.text("detail", "node lost")
        lost = self.lanes.get(lost_node(detail) or "")
        target = lost if lost is not None else lane
        target.marks.append((e.ts, PURPLE, f"{_fmt(e.ts)} {detail}"))
        if lost is not None and lost.started:
            lost.spans.append((lost.started[0], e.ts, lost.started[1]))
            lost.started = None


RED, ORANGE, PURPLE, GREEN, GREY = "#d62728", "#ff7f0e", "#9467bd", "#2ca02c", "#7f7f7f"
BROWN = "#8c564b"  # fault attribution: verdicts, quarantines, failed health checks

# Fault attribution's events, each drawn on its node's lane with one line.
_FAULT_MARKS: dict[str, Callable[[LoggedEvent], str]] = {
    FaultVerdict.KIND: lambda e: e.text("summary", "fault verdict"),
    NodeQuarantined.KIND: lambda e: (
        f"quarantined until {_fmt(_number(e.fields.get('until')) or 0.0)}: {e.text('reason')}"
    ),
    QuarantineRefused.KIND: lambda e: "refused: this node is quarantined",
    NodeHealthFailed.KIND: lambda e: (
        f"health check failed ({e.text('when')}): {e.text('command')} {e.text('reason')}"
    ),
}


def _agent_end(e: LoggedEvent) -> tuple[float, str, str]:
    """An agent's end: green when it finished; grey when stopped by a signal
    (the operator's doing, not a failure); red when the job failed."""
    reason = e.text("reason")
    if e.kind == JobFinished.KIND:
        color = GREEN
    elif reason.startswith("signal"):
        color = GREY
    else:
        color = RED
    return e.ts, color, f"{_fmt(e.ts)} {e.kind} ({reason})"


def _root_cause(e: LoggedEvent, elsewhere: set[tuple[str, int]]) -> bool:
    """A worker that was the job's root cause (not one of a node whose
    failure came after another node's, in ``elsewhere``)."""
    if e.kind != WorkerExited.KIND or e.text("cause") != "root_cause":
        return False
    return (e.text("node_id"), e.integer("round", -1)) not in elsewhere


def _elsewhere(events: Sequence[LoggedEvent]) -> set[tuple[str, int]]:
    return {
        (e.text("node_id"), e.integer("round", -1))
        for e in events
        if e.kind == RootCauseElsewhere.KIND
    }


def _history(events: Sequence[LoggedEvent]) -> _History:
    t0, t1 = events[0].ts, events[-1].ts
    h = _History(t0, t1, world=[(t0, 0)], elsewhere=_elsewhere(events))
    for e in events:
        h.add(e)
    h.world.append((t1, 0))
    for lane in h.lanes.values():
        if lane.started:
            lane.spans.append((lane.started[0], t1, lane.started[1]))
    return h


@dataclass
class _Svg:
    """The drawing: its geometry, and the SVG text written so far."""

    h: _History
    top: float
    lane_top: float
    axis_y: float
    out: list[str] = field(default_factory=list)

    @property
    def span(self) -> float:
        return max(self.h.t1 - self.h.t0, 1e-3)

    def x(self, ts: float) -> float:
        return LEFT + (ts - self.h.t0) / self.span * (WIDTH - LEFT - RIGHT)

    def add(self, text: str) -> None:
        self.out.append(text)

    def rounds(self) -> None:
        """Alternating bands; their labels placed where they do not overlap (a
        restart opens rounds milliseconds apart: a label that finds no free
        place is left to the band's tooltip)."""
        x, add, rounds = self.x, self.add, self.h.rounds
        labels: list[tuple[float, str]] = []
        for i, (ts, r, reason) in enumerate(rounds):
            end = rounds[i + 1][0] if i + 1 < len(rounds) else self.h.t1
            fill = "#f4f4f4" if i % 2 else "#e8eef7"
            w = max(x(end) - x(ts), 1.0)
            add(
                f'<rect x="{x(ts):.1f}" y="{self.top - 4}" width="{w:.1f}" '
                f'height="{self.axis_y - self.top + 4}" '
            )
            tip = f"round {r}: {_text(reason)} at {_fmt(ts)}"
            add(f'fill="{fill}"><title>{tip}</title></rect>')
            labels.append((x(ts) + 2, f"round {r}"))
        for lx, row, text in place_labels(labels, LABEL_ROWS, right=WIDTH - 2):
            ly = LABEL_TOP + (row + 1) * LABEL_ROW_H - 2
            add(f'<text x="{lx:.1f}" y="{ly}">{_text(text)}</text>')

    def axis(self) -> None:
        """Ticks at round steps from the first event, with a grid."""
        add, top, axis_y = self.add, self.top, self.axis_y
        add(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{axis_y}" y2="{axis_y}" stroke="#555"/>')
        for tick in axis_ticks(self.span, WIDTH - LEFT - RIGHT):
            tx = self.x(self.h.t0 + tick)
            add(f'<line x1="{tx:.1f}" x2="{tx:.1f}" y1="{top}" y2="{axis_y}" stroke="#ddd"/>')
            add(
                f'<line x1="{tx:.1f}" x2="{tx:.1f}" y1="{axis_y}" y2="{axis_y + 5}" stroke="#555"/>'
            )
            add(f'<text x="{tx:.1f}" y="{axis_y + 17}" text-anchor="middle">')
            add(f"{html.escape(fmt_offset(tick))}</text>")
        add(f'<text x="10" y="{axis_y + 17}">time from {_fmt(self.h.t0)}</text>')

    def world(self) -> None:
        """World size over time (a step line), its values placed without overlaps."""
        x, add, top, world = self.x, self.add, self.top, self.h.world
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
        values = [(x(ts) + 2, str(w)) for ts, w in world[1:-1] if w]
        for vx, row, text in place_labels(values, 2, right=WIDTH - 2):
            vy = top + 10 + row * LABEL_ROW_H
            add(f'<text x="{vx:.1f}" y="{vy}" fill="#1f77b4">{text}</text>')

    def restarts(self) -> None:
        """Dashed lines across the plot."""
        for ts, label in self.h.restarts:
            self.add(f'<line x1="{self.x(ts):.1f}" x2="{self.x(ts):.1f}" y1="{self.top}" ')
            self.add(f'y2="{self.axis_y}" ')
            self.add('stroke="#ff7f0e" stroke-dasharray="4 3">')
            self.add(f"<title>{_text(label)}</title></line>")

    def lanes(self) -> None:
        """One lane per node: worker spans and marks."""
        x, add = self.x, self.add
        for i, lane in enumerate(self.h.lanes.values()):
            y = self.lane_top + i * LANE_H
            add(f'<text x="10" y="{y + 15}">{_text(lane.label)}</text>')
            for start, end, r in lane.spans:
                w = max(x(end) - x(start), 1.0)
                add(f'<rect x="{x(start):.1f}" y="{y + 4}" width="{w:.1f}" height="{LANE_H - 8}" ')
                add(f'fill="#9ecae1"><title>workers, round {r}: {_fmt(start)}-{_fmt(end)}</title>')
                add("</rect>")
            for ts, color, label in lane.marks:
                add(f'<circle cx="{x(ts):.1f}" cy="{y + LANE_H / 2}" r="5" fill="{color}">')
                add(f"<title>{_text(label)}</title></circle>")


def _svg(h: _History) -> str:
    top = LABEL_TOP + LABEL_ROWS * LABEL_ROW_H + 6
    lane_top = top + WORLD_H + 30
    axis_y = lane_top + LANE_H * len(h.lanes) + 8
    svg = _Svg(h, top, lane_top, axis_y)
    svg.add(f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{axis_y + 34}" ')
    svg.add('font-family="sans-serif" font-size="11">')
    svg.rounds()
    svg.axis()
    svg.world()
    svg.restarts()
    svg.lanes()
    svg.add("</svg>")
    return "".join(svg.out)


def render_html(events: Sequence[LoggedEvent], title: str = "") -> str:
    """The timeline page for ``events`` (in time order)."""
    if not events:
        return "<!doctype html><meta charset=utf-8><title>elastrun timeline</title><p>no events"
    h = _history(events)
    failures = [e.failure_title() for e in events if _root_cause(e, h.elsewhere)]
    legend = (
        "<p>Bands: rounds. Blue line: world size. Blue bars: a node's workers running. "
        "Red dot: a root-cause worker failure (orange: a node's ranks that failed after "
        "another node's). Orange dashes: a counted restart. Purple: a node lost, on its own "
        "lane. Green: an agent finished; grey: stopped by a signal; red: its job failed. "
        "The axis: time from the first event. Hover for details.</p>"
    )
    items = "".join(f"<li>{_text(f)}</li>" for f in failures) or "<li>none</li>"
    name = _text(title or events[0].text("run_id"))
    return (
        f"<!doctype html><html><head><meta charset=utf-8><title>elastrun timeline {name}"
        f"</title></head><body><h2>job {name}: {_count(len(h.rounds), 'round')}, "
        f"{_count(len(h.restarts), 'restart')}, {_count(len(h.lanes), 'node')}</h2>"
        f"{_svg(h)}{legend}<h3>failures</h3><ul>{items}</ul>"
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
    for flag, path in [("--out", args.out), *(("EVENTS.jsonl", f) for f in args.files)]:
        if not path.strip():
            print(f"elastrun timeline: error: {flag}: an empty file name", file=sys.stderr)
            return 2
    try:
        events = load_events(args.files)
        page = render_html(events, args.title)
    except OSError as exc:
        print(f"elastrun timeline: error: {printable(exc)}", file=sys.stderr)
        return 1
    try:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(page)
    except OSError as exc:
        print(f"elastrun timeline: error: --out: {printable(exc)}", file=sys.stderr)
        return 1
    print(f"elastrun timeline: {_count(len(events), 'event')} -> {args.out}")
    return 0
