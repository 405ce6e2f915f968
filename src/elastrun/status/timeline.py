"""``elastrun timeline EVENTS.jsonl... --out timeline.html``: the job's history
as one self-contained HTML page (inline SVG, no scripts, no dependencies).

Drawn from the agents' event logs (docs/events.md): one lane per node with its
workers' running spans, the rounds (with why each was opened), the world size
over time, worker failures (root causes) and restarts, over a time axis (ticks
at round steps from the first event). Labels that would overlap (rounds opened
milliseconds apart at a restart) are placed on further rows, or left to the
tooltips.

The events are read through the typed catalogue (:mod:`elastrun.event_kinds`,
``parse_event``): of each line, only the kinds the page draws (``DRAWN``) are
kept, as their classes. Event logs may hold what other nodes or workers wrote
(host names, failure messages, round details), or anything at all: a line that
is not an event of the catalogue within the bounds (``MAX_LINE_BYTES``,
nesting depth, a plausible time stamp, numbers within ``MAX_INT``) is skipped,
the first ``MAX_NOTES`` of them named on stderr; what an event keeps is cut to
bounds (``MAX_FIELD``, ``MAX_EVENT_TEXT``, ``MAX_ITEMS``), so an event held
costs a few KiB at most, whatever its line. Every string drawn is escaped for
HTML and its control characters shown as escapes (``\\x1b``).
"""

from __future__ import annotations

import argparse
import dataclasses
import html
import math
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TextIO, TypeVar, cast

from elastrun.event_kinds import (
    Event,
    FaultVerdict,
    JobFailed,
    JobFinished,
    JobMarkedFailed,
    NodeHealthFailed,
    NodeJoined,
    NodeLost,
    NodeQuarantined,
    QuarantineRefused,
    RanksKept,
    Restart,
    RootCauseElsewhere,
    RoundOpened,
    SparePromoted,
    StandbyUsed,
    StoreHostLost,
    StoreTakeover,
    StragglerReplacement,
    WorkerExited,
    WorkersStarted,
    WorkersSucceeded,
    parse_event,
)
from elastrun.failure import FailureRecord
from elastrun.frozen import frozen
from elastrun.rendezvous.plan import lost_node
from elastrun.untrusted import UntrustedData, loads, printable

__all__ = [
    "LoggedEvent",
    "axis_ticks",
    "fmt_offset",
    "load_events",
    "main",
    "place_labels",
    "read_line",
    "render_html",
]

_T = TypeVar("_T")

WIDTH = 1100
MAX_LINE_BYTES = 1024 * 1024  # one event (a failure record with its traceback is ~10 KiB)
MAX_TEXT = 500  # characters of one string drawn
MAX_FIELD = 1000  # characters of one string kept (drawn cut to MAX_TEXT)
MAX_EVENT_TEXT = 4000  # characters of all the strings of one event kept
MAX_ITEMS = 16  # items of one list kept (pids, ranks, a failure's workers)
MAX_INT = 2**53  # an integer beyond +-MAX_INT: not a line of ours
MAX_NOTES = 10  # bad lines named on stderr; the rest counted in one line
# The kinds of event the page draws (the catalogue's classes); lines of other
# kinds are not kept.
DRAWN: tuple[type[Event], ...] = (
    RoundOpened,
    NodeJoined,
    WorkersStarted,
    WorkerExited,
    WorkersSucceeded,
    Restart,
    RootCauseElsewhere,
    NodeLost,
    SparePromoted,
    RanksKept,
    StandbyUsed,
    StoreHostLost,
    StoreTakeover,
    JobFinished,
    JobFailed,
    JobMarkedFailed,
    FaultVerdict,
    NodeQuarantined,
    QuarantineRefused,
    NodeHealthFailed,
    StragglerReplacement,
)
DRAWN_KINDS = frozenset(cls.KIND for cls in DRAWN)
COMMON = ("node_id", "host", "run_id")  # the sink's fields the page reads
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


@frozen
class LoggedEvent:
    """One line of an agent's event log (docs/events.md): its wall-clock time
    stamp, the sink's fields the page reads (the writing node's id and host,
    the run id), and the event itself, typed by the catalogue
    (:mod:`elastrun.event_kinds`). Everything in it is within bounds
    (:func:`read_line`)."""

    ts: float
    event: Event
    node_id: str = ""
    host: str = ""
    run_id: str = ""

    @property
    def kind(self) -> str:
        return self.event.KIND

    def failure_title(self) -> str:
        """A ``worker_exited`` event as the one failure line of
        :meth:`FailureRecord.describe` (``rank 1 on host-a exited with code 1``)."""
        e = self.event
        if not isinstance(e, WorkerExited):
            return f"{_fmt(self.ts)} {e.KIND}"
        record = FailureRecord(
            host=self.host or "?", rank=e.rank, exitcode=e.exitcode, signal=e.signal
        )
        return f"{_fmt(self.ts)} {record.describe()} (root cause)"


def read_line(raw: object) -> LoggedEvent | None:
    """The event a decoded line holds, when the page draws its kind (``DRAWN``);
    None for a line of another kind (a kind of a newer version included).
    Raises :class:`UntrustedData`, naming the problem, for a line that is not
    an event of the catalogue: not a JSON object, no time stamp from 0 to
    ``MAX_TS``, a field missing or of the wrong type, a number out of bounds.

    What is kept is bounded whatever the line: of its fields only the
    catalogue's for its kind and the sink's ``COMMON``; every string cut at
    ``MAX_FIELD`` characters, and all of an event's at ``MAX_EVENT_TEXT``
    together; every list at ``MAX_ITEMS`` items."""
    if not isinstance(raw, Mapping):
        raise UntrustedData("not a JSON object")
    ts = _number(raw.get("ts"))
    if ts is None or not 0 <= ts <= MAX_TS:
        raise UntrustedData(f"no time stamp from 0 to {MAX_TS:g} (ts)")
    kind = raw.get("kind")
    if kind not in DRAWN_KINDS:
        return None
    event = parse_event(raw)
    if event is None:
        raise UntrustedData(f"not a {kind} event of the catalogue (a field missing or mistyped)")
    if not isinstance(event, DRAWN):  # the kind's other class (the rendezvous' job_finished)
        return None
    budget = _Budget()
    common = [raw.get(name) for name in COMMON]
    node_id, host, run_id = (budget.cut(v) if isinstance(v, str) else "" for v in common)
    return LoggedEvent(ts, budget.bound(event), node_id, host, run_id)


@dataclass
class _Budget:
    """Bounds what one event keeps: strings, lists, numbers (see :func:`read_line`)."""

    left: int = MAX_EVENT_TEXT

    def cut(self, text: str) -> str:
        kept = text[: min(MAX_FIELD, self.left)]
        self.left -= len(kept)
        return kept

    def bound(self, value: _T) -> _T:
        """``value`` (an event, a failure record, a field) within bounds;
        UntrustedData for a number out of them."""
        out: object
        if isinstance(value, str):
            out = self.cut(value)
        elif isinstance(value, bool) or value is None:
            out = value
        elif isinstance(value, int | float):
            if _number(value) is None:
                raise UntrustedData("a number out of bounds (beyond 2**53, or not finite)")
            out = value
        elif isinstance(value, list | tuple):
            out = type(value)(self.bound(v) for v in value[:MAX_ITEMS])
        elif isinstance(value, dict):
            out = {self.bound(k): self.bound(v) for k, v in list(value.items())[:MAX_ITEMS]}
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            fields = dataclasses.fields(value)
            out = dataclasses.replace(
                value, **{f.name: self.bound(getattr(value, f.name)) for f in fields}
            )
        else:  # not a value parse_event builds
            raise UntrustedData(f"an unexpected value ({type(value).__name__})")
        return cast("_T", out)


def load_events(paths: Sequence[str], err: TextIO | None = None) -> list[LoggedEvent]:
    """Every event the page draws of the files, in time order. A line that is
    not one (an agent killed mid-write leaves a partial last line; a hostile
    writer, anything) is skipped: the first ``MAX_NOTES`` are named on
    ``err`` (default stderr), the others counted in one last line."""
    out = sys.stderr if err is None else err
    events: list[LoggedEvent] = []
    skipped = 0
    for path in paths:
        mine: list[LoggedEvent] = []
        with open(path, encoding="utf-8", errors="replace") as f:
            for n, line in _lines(f):
                try:
                    obj = loads(line, max_bytes=MAX_LINE_BYTES, what="the line")
                    event = read_line(obj)
                except UntrustedData as exc:
                    skipped += 1
                    if skipped <= MAX_NOTES:
                        where = f"{printable(path, limit=MAX_TEXT)}:{n}"
                        print(f"elastrun timeline: skipping {where}: {exc}", file=out)
                    continue
                if event is not None:
                    mine.append(event)
        events += _one_node(mine)
    if skipped > MAX_NOTES:
        more = skipped - MAX_NOTES
        print(f"elastrun timeline: skipped {_count(more, 'more line')} like these", file=out)
    events.sort(key=lambda e: e.ts)
    return events


def _one_node(events: list[LoggedEvent]) -> list[LoggedEvent]:
    """A file's events; when it is one agent's (one node id in it), its events
    written before the agent joined (no node id: its store takeover) are its node's."""
    ids = {e.node_id for e in events} - {""}
    if len(ids) != 1:
        return events
    (node_id,) = ids
    return [e if e.node_id else dataclasses.replace(e, node_id=node_id) for e in events]


def _lines(f: TextIO) -> Iterator[tuple[int, str]]:
    """(line number, line) of the non-blank lines of ``f``; a line longer than
    ``MAX_LINE_BYTES`` characters is given cut there (and is refused as too
    long), never held whole."""
    n = 0
    while line := f.readline(MAX_LINE_BYTES + 1):
        n += 1
        if len(line) > MAX_LINE_BYTES and not line.endswith("\n"):
            while (rest := f.readline(MAX_LINE_BYTES)) and not rest.endswith("\n"):
                pass
        if line.strip():
            yield n, line


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
    rounds: dict[int, tuple[float, str]] = field(default_factory=dict)  # round -> ts, why
    world: list[tuple[float, int]] = field(default_factory=list)  # ts, world size
    restarts: dict[int, tuple[float, str, bool]] = field(default_factory=dict)  # round -> ts,
    # title, counted (every node whose ranks stopped says so: one restart per round)
    seen_world: set[int] = field(default_factory=set)  # rounds whose world is recorded
    # (node id, round) whose failures came after another node's root cause
    # (root_cause_elsewhere): their own "root cause" ranks are not the job's.
    elsewhere: set[tuple[str, int]] = field(default_factory=set)
    # round -> the restarts the job had used when its workers started
    # (workers_started's restart_count): what the rendezvous charged (_charged).
    charges: dict[int, int] = field(default_factory=dict)
    hosts: dict[str, str] = field(default_factory=dict)  # store address -> the node hosting it
    takeovers: list[tuple[float, str]] = field(default_factory=list)  # ts, line
    lost_terms: set[int] = field(default_factory=set)  # terms whose host's loss is drawn

    def add(self, e: LoggedEvent) -> None:
        key = e.node_id
        if not key:  # before the agent joined the rendezvous (agent_started): no lane
            self._store(None, e)
            if not isinstance(e.event, RoundOpened | WorkersStarted):
                return
            key = e.host or "?"
        lane = self.lanes.setdefault(key, _Lane(f"{e.host or '?'} {key[-6:]}"))
        self._spans(lane, e)
        self._marks(lane, e)
        self._store(lane, e)

    def _round(self, r: int, ts: float, why: str) -> None:
        if r not in self.rounds or ts < self.rounds[r][0]:
            self.rounds[r] = (ts, why)

    def _spans(self, lane: _Lane, e: LoggedEvent) -> None:
        """Rounds, world size, and the lane's running spans."""
        ev, ts = e.event, e.ts
        if isinstance(ev, RoundOpened):
            self._round(ev.round, ts, ev.reason)
            if ev.round > 0:
                self.world.append((ts, 0))
        elif isinstance(ev, NodeJoined):  # a round opened on a new store host has no
            if ev.round not in self.rounds:  # round_opened: its first join opens it here
                self._round(
                    ev.round, ts, "a node joined (its round_opened is in none of these logs)"
                )
        elif isinstance(ev, WorkersStarted):
            lane.started = (ts, ev.round)
            self._round(ev.round, ts, "workers started")
            if ev.round not in self.seen_world:
                self.seen_world.add(ev.round)
                self.world.append((ts, max(0, ev.world_size)))
        elif isinstance(ev, Restart | WorkersSucceeded | JobFailed | JobMarkedFailed):
            _end(lane, ts)

    def _marks(self, lane: _Lane, e: LoggedEvent) -> None:
        """Failures, restarts, lost nodes, promoted spares, finished agents and
        fault attribution (verdicts, quarantines, failed health checks)."""
        ev, ts = e.event, e.ts
        if _root_cause(e, self.elsewhere, self.charges):
            lane.marks.append((ts, RED, e.failure_title()))
        elif _root_cause(e, set(), {}):  # this node's, after another node's root cause
            after = (
                "after another node's failure"
                if (e.node_id, cast(WorkerExited, ev).round) in self.elsewhere
                else "not counted: a node or the store's host was lost"
            )
            title = e.failure_title().replace("(root cause)", f"({after})")
            lane.marks.append((ts, ORANGE, title))
        elif isinstance(ev, Restart) and ev.round not in self.restarts:
            what = "worker failed" if ev.reason == "worker_failed" else ev.reason
            # What the rendezvous charged, once the next round started (an agent
            # announces its restart before: a failure collateral to a lost node
            # is announced counted, and is not charged).
            count, counted = ev.count, ev.counted
            charged = _charged(self.charges, ev.round)
            if charged is not None:
                count, counted = self.charges[ev.round] + charged, charged > 0
            said = f"restart {count}" if counted else "a restart not counted"
            self.restarts[ev.round] = (ts, f"{_fmt(ts)} {said} ({what})", counted)
        elif isinstance(ev, NodeLost):
            self._lost(lane, ts, ev.detail, lost_node(ev.detail))
        elif isinstance(ev, SparePromoted):
            took = ev.replaces or "a new rank"
            what = f"spare promoted: group rank {ev.group_rank}, in place of {took}"
            lane.marks.append((ts, CYAN, f"{_fmt(ts)} {what}"))
            if ev.replaces is not None and ev.replaces in self.lanes:  # gone, if not said yet
                _end(self.lanes[ev.replaces], ts)
        elif isinstance(ev, RanksKept):
            lane.marks.append((ts, TEAL, f"{_fmt(ts)} {kept_line(ev)}"))
        elif isinstance(ev, StandbyUsed):
            what = f"rank {ev.rank} served by a standby (pid {ev.pid})"
            lane.marks.append(
                (ts, TEAL, f"{_fmt(ts)} in-process restart, round {ev.round}: {what}")
            )
        elif isinstance(ev, JobFinished | JobFailed):
            lane.marks.append(_agent_end(ts, ev))
        elif (line := _fault_line(ev)) is not None:
            lane.marks.append((ts, BROWN, f"{_fmt(ts)} {line}"))

    def _store(self, lane: _Lane | None, e: LoggedEvent) -> None:
        """The store's hosts: a takeover (its new host's mark), the host's loss
        (the lost host's mark, its workers' bar ended)."""
        ev, ts = e.event, e.ts
        if isinstance(ev, StoreTakeover):
            self.takeovers.append((ts, f"{_fmt(ts)} {ev.detail}"))
            if lane is not None:
                self.hosts[ev.candidate] = e.node_id
                lane.marks.append((ts, BROWN, f"{_fmt(ts)} {ev.detail}"))
        elif isinstance(ev, StoreHostLost) and lane is not None and ev.term not in self.lost_terms:
            self.lost_terms.add(ev.term)
            line = f"the store's host {ev.host} (term {ev.term}) lost: {ev.cause}"
            self._lost(lane, ts, line, self.hosts.get(ev.host))

    def _lost(self, lane: _Lane, ts: float, line: str, node: str | None) -> None:
        """A node lost, drawn on the lost node's lane (the event is the
        survivor's), whose workers' bar ends there."""
        lost = self.lanes.get(node or "")
        target = lost if lost is not None else lane
        target.marks.append((ts, PURPLE, f"{_fmt(ts)} {line}"))
        if lost is not None:
            _end(lost, ts)


RED, ORANGE, PURPLE, GREEN, GREY = "#d62728", "#ff7f0e", "#9467bd", "#2ca02c", "#7f7f7f"
CYAN, BROWN, TEAL = "#17becf", "#8c564b", "#1b9e77"


def kept_line(ev: RanksKept) -> str:
    """An in-process restart on one node: the ranks whose processes were kept
    (and their pids), and those replaced by new processes."""
    pids = ", ".join(f"{r} (pid {p})" for r, p in zip(ev.kept, ev.kept_pids, strict=False))
    replaced = ", ".join(map(str, ev.started)) or "none"
    return f"in-process restart, round {ev.round}: ranks kept {pids}; replaced {replaced}"


def _fault_line(ev: Event) -> str | None:
    """Fault attribution's events (verdicts, quarantines, failed health
    checks, stragglers replaced), each one line on its node's lane (brown);
    None for another event."""
    if isinstance(ev, FaultVerdict):
        return ev.summary or "fault verdict"
    if isinstance(ev, NodeQuarantined):
        return f"quarantined until {_wall(ev.until)}: {ev.reason}"
    if isinstance(ev, QuarantineRefused):
        return f"refused: this node is quarantined until {_wall(ev.until)}"
    if isinstance(ev, NodeHealthFailed):
        return f"health check failed ({ev.when}): {ev.command} {ev.reason}"
    if isinstance(ev, StragglerReplacement):
        done = "replaced by a spare" if ev.replaced else ev.why
        return f"straggler {ev.node} ({ev.intervals} intervals in a row): {done}"
    return None


def _wall(t: float) -> str:
    """A wall-clock time an event names (a quarantine's end), as a date and
    time; one beyond any plausible time stamp (``MAX_TS``) as a number."""
    if 0 <= t <= MAX_TS:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    return f"{t:g} (not a time)"


def _end(lane: _Lane, ts: float) -> None:
    """The lane's workers stopped at ``ts``: their running bar ends there."""
    if lane.started:
        lane.spans.append((lane.started[0], ts, lane.started[1]))
        lane.started = None


def _agent_end(ts: float, ev: JobFinished | JobFailed) -> tuple[float, str, str]:
    """An agent's end: green when it finished; grey when stopped by a signal
    (the operator's doing, not a failure); red when the job failed."""
    if isinstance(ev, JobFinished):
        color = GREEN
    elif ev.reason.startswith("signal"):
        color = GREY
    else:
        color = RED
    return ts, color, f"{_fmt(ts)} {ev.KIND} ({ev.reason})"


def _root_cause(
    e: LoggedEvent, elsewhere: set[tuple[str, int]], charges: Mapping[int, int]
) -> bool:
    """A worker that was the job's root cause: not one of a node whose
    failure came after another node's (in ``elsewhere``), nor of a round whose
    restart the rendezvous did not charge (a node or the store's host was lost:
    the failure was collateral; :func:`_charged` of ``charges``)."""
    ev = e.event
    if not isinstance(ev, WorkerExited) or ev.cause != "root_cause":
        return False
    return (e.node_id, ev.round) not in elsewhere and _charged(charges, ev.round) != 0


def _charges(events: Sequence[LoggedEvent]) -> dict[int, int]:
    """Round -> the job's restarts used when its workers started."""
    out: dict[int, int] = {}
    for e in events:
        if isinstance(e.event, WorkersStarted):
            out.setdefault(e.event.round, e.event.restart_count)
    return out


def _charged(charges: Mapping[int, int], r: int) -> int | None:
    """The restarts the rendezvous charged for round ``r``'s end: the next
    round that started workers, less ``r``'s count; None when unknown (no
    later round, or ``r`` not seen)."""
    if r not in charges:
        return None
    later = [k for k in charges if k > r]
    return charges[min(later)] - charges[r] if later else None


def _elsewhere(events: Sequence[LoggedEvent]) -> set[tuple[str, int]]:
    return {(e.node_id, e.event.round) for e in events if isinstance(e.event, RootCauseElsewhere)}


def _history(events: Sequence[LoggedEvent]) -> _History:
    t0, t1 = events[0].ts, events[-1].ts
    h = _History(t0, t1, world=[(t0, 0)], elsewhere=_elsewhere(events), charges=_charges(events))
    for e in events:
        h.add(e)
    h.world.append((t1, 0))
    for lane in h.lanes.values():
        _end(lane, t1)
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
        x, add = self.x, self.add
        rounds = sorted(((ts, r, why) for r, (ts, why) in self.h.rounds.items()))
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
        """Dashed lines across the plot: orange, counted against
        ``--max-restarts``; grey, not counted (a node lost, the store's host lost)."""
        for ts, label, counted in self.h.restarts.values():
            self.add(f'<line x1="{self.x(ts):.1f}" x2="{self.x(ts):.1f}" y1="{self.top}" ')
            self.add(f'y2="{self.axis_y}" ')
            self.add(f'stroke="{ORANGE if counted else GREY}" stroke-dasharray="4 3">')
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
    failures = [e.failure_title() for e in events if _root_cause(e, h.elsewhere, h.charges)]
    legend = (
        "<p>Bands: rounds. Blue line: world size. Blue bars: a node's workers running. "
        "Red dot: a root-cause worker failure (orange: a node's ranks that failed after "
        "another node's, or in a round ended by a lost node, not counted). Dashes: a restart "
        "(orange: counted against --max-restarts; grey: "
        "not counted, after a node or the store's host was lost). Purple: a node lost, or the "
        "store's host lost, on its own lane. Cyan: a spare promoted into the world. Teal: an "
        "in-process restart on that node (hover: the ranks whose processes were kept, and "
        "those replaced), or a rank served by a standby. Brown: "
        "this node's agent took the store's hosting (a new term). Green: an agent finished; "
        "grey: stopped by a signal; red: its job failed. "
        "The axis: time from the first event. Hover for details.</p>"
    )
    items = "".join(f"<li>{_text(f)}</li>" for f in failures) or "<li>none</li>"
    hosts = "".join(f"<li>{_text(line)}</li>" for _, line in h.takeovers)
    if hosts:
        hosts = f"<h3>store hosts</h3><ul>{hosts}</ul>"
    counted = sum(1 for _, _, c in h.restarts.values() if c)
    restarts = _count(len(h.restarts), "restart")
    if counted != len(h.restarts):
        restarts += f" ({counted} counted)"
    name = _text(title or events[0].run_id)
    return (
        f"<!doctype html><html><head><meta charset=utf-8><title>elastrun timeline {name}"
        f"</title></head><body><h2>job {name}: {_count(len(h.rounds), 'round')}, "
        f"{restarts}, {_count(len(h.lanes), 'node')}</h2>"
        f"{_svg(h)}{legend}<h3>failures</h3><ul>{items}</ul>{hosts}"
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
