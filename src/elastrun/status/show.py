"""What ``elastrun status`` shows: a job's :class:`~elastrun.status.model.Summary`
as a table (:func:`render_table`: the round, members, ranks, restarts, last
failure, hang stacks; every string from the store escaped and bounded), and the
:class:`Printer` that writes it once, as JSON lines, or for ``--watch`` redrawn
in place on a terminal or as the lines that changed into a file or pipe.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import json
import math
import shutil
import sys
import time
from collections.abc import Sequence
from typing import TextIO

from elastrun.clock import duration_text
from elastrun.rendezvous.fault_history import HealthFailure, JudgedFault
from elastrun.status.model import HangStacks, RankRow, Summary
from elastrun.untrusted import printable

__all__ = ["MAX_FIELD", "Printer", "render_table"]

MAX_FIELD = 500  # characters of one string of the summary shown in the table


def _p(value: object) -> str:
    """``value`` made safe for a terminal (one line, control characters
    escaped, at most ``MAX_FIELD`` characters): the summary holds what other
    nodes, or anyone who reached the store, wrote."""
    return printable(value, limit=MAX_FIELD)


def _opt(value: object, none: str = "?") -> str:
    return none if value is None else _p(value)


def render_table(summary: Summary, where: str) -> str:
    """The summary as a human-readable block of text (every string from the
    store escaped for the terminal)."""
    s = summary
    out = [f"job {_p(s.run_id)}  (store {printable(where)}, {_revision(s)})"]
    rnd = _opt(s.round, "-")
    why = f" (opened: {_p(s.round_reason)}" if s.round_reason else ""
    if why:
        why += f": {_p(s.round_detail)})" if s.round_detail else ")"
    for_ = f" for {duration_text(s.state_for_s)}" if s.state_for_s is not None else ""
    out.append(f"state     {s.state}{for_}, round {rnd}{why}")
    out.append(f"restarts  {s.restarts} of {_opt(s.max_restarts)}")
    if s.goodput is not None:
        out.append(f"goodput   {s.goodput.status_text()}")
    if s.store_hosts is not None:
        out.append(printable(f"store     {s.store_hosts.describe()}"))
    unit = f", node unit {s.node_unit}" if s.node_unit > 1 else ""
    spares = f", {len(s.spares)} spare{'' if len(s.spares) == 1 else 's'}" if s.spares else ""
    out.append(
        f"nodes     {len(s.members)} in the group (min {_opt(s.min_nodes, 'None')}, "
        f"max {_opt(s.max_nodes, 'None')}{unit}), {s.nodes_present} present{spares}; "
        f"world size {s.world_size}"
    )
    if s.master:
        out.append(f"master    {_p(s.master)}")
    if s.members:
        label = "members" if s.members_round == s.round else "members of the last round"
        out.append(f"\n{label} (round {s.members_round}):")
        rows = [("GROUP_RANK", "HOST", "ADDR", "NPROC", "ROLE", "STATUS", "NODE")]
        rows += [
            (
                str(m.group_rank),
                _p(m.host),
                _p(m.addr),
                str(m.nproc),
                _p(m.role or "-"),
                m.status,
                _p(m.node_id),
            )
            for m in s.members
        ]
        out.extend(_table(rows))
    if s.joined:
        joined = ", ".join(f"{_p(j.host)} ({_p(j.node_id)})" for j in s.joined)
        out.append(f"\njoined round {rnd}: {joined}")
    if s.spares:
        out.append("spares: " + ", ".join(f"{_p(w.host)} ({_p(w.node_id)})" for w in s.spares))
    elif s.waiting:
        out.append("waiting: " + ", ".join(f"{_p(w.host)} ({_p(w.node_id)})" for w in s.waiting))
    out.extend(_ranks_block(s.ranks))
    failure = s.last_failure
    # The one wording of a failure (FailureRecord.describe), with its time and message.
    line = printable(failure.describe(detailed=True), limit=2 * MAX_FIELD) if failure else "none"
    out.append("\nlast failure: " + line)
    if s.fault_stopped:
        out.append("stopped:  " + printable(s.fault_stopped, limit=2 * MAX_FIELD))
    for v in s.verdicts:
        out.append(_verdict_line(v))
    for h in s.health_failures:
        out.append(_health_line(h))
    for q in s.quarantined:
        until = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(q.until))
        kept = "quarantined until" if q.active(time.time()) else "quarantine expired at"
        reason = printable(q.reason, limit=2 * MAX_FIELD)
        out.append(f"node {_p(q.host)} {kept} {until}: {reason}")
    out.extend(_stacks_block(s.hang_stacks))
    return "\n".join(out)


def _verdict_line(v: JudgedFault) -> str:
    """A verdict kept in the fault history (its text from the store: escaped)."""
    outcome = f"; {printable(v.outcome, limit=MAX_FIELD)}" if v.outcome else ""
    return f"verdict   round {v.round}: {printable(v.summary, limit=2 * MAX_FIELD)}{outcome}"


def _health_line(h: HealthFailure) -> str:
    """A node's failed health check kept in the fault history (escaped)."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h.at))
    where = "before joining" if h.when == "before_round" else "while training"
    rnd = "" if h.round is None else f", round {h.round}"
    lines = [ln for ln in h.output.splitlines() if ln.strip()]
    tail = f": {printable(lines[-1], limit=MAX_FIELD)}" if lines else ""
    return (
        f"health    node {_p(h.host)} failed its health check {where} at {when}{rnd}: "
        f"{printable(h.reason, limit=MAX_FIELD)}{tail}"
    )


def _table(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"


def _revision(s: Summary) -> str:
    """The store revision read at; with candidate hosts, of which term: each
    host's store counts its own revisions, so they start again after a takeover."""
    if s.store_hosts is None:
        return f"revision {s.revision}"
    return f"term {s.store_hosts.term}, revision {s.revision}"


def _ranks_block(ranks: Sequence[RankRow]) -> list[str]:
    """Per-rank step times (reported every few seconds by each agent)."""
    if not ranks:
        return []
    # After an in-process restart (some rank's process kept): which processes were kept.
    process = any(r.kept or r.standby for r in ranks)
    head = ("RANK", "HOST", *(("PROCESS",) if process else ()), "STEP", "STEP_TIME", "OWN_TIME")
    rows = [(*head, "IDLE", "")]
    for r in ranks:
        note = "STRAGGLER" if r.straggler else (f"in {_p(r.phase)}" if r.phase else "")
        rows.append(
            (
                str(r.rank),
                _p(r.host or "?"),
                *((process_text(r),) if process else ()),
                step_text(r),
                _ms(r.step_time_s),
                _ms(r.own_time_s),
                "-" if r.idle_s is None else duration_text(r.idle_s),
                note,
            )
        )
    kept = (
        "; PROCESS: whether the rank's process was kept in the last restart (in-process), "
        "served by a standby set up ahead of time, or replaced by a new one"
        if process
        else ""
    )
    counted = (
        "; a STEP ending in * is no training step: the script reports none, so it is the "
        "optimizer steps this worker process took since it started (a restarted rank counts "
        "from 0 again, ranks started apart differ)"
        if any(r.reported is False and r.step is not None for r in ranks)
        else ""
    )
    title = (
        "\nranks (STEP: the training step the script reports, elastrun.train.heartbeat(step)"
        f"{counted}. STEP_TIME, OWN_TIME: medians "
        "of the recent optimizer steps; own time: outside backward passes, where DDP waits "
        f"for the slowest rank{kept}):"
    )
    return [title, *_table(rows)]


def step_text(r: RankRow) -> str:
    """A rank's STEP cell: the script's step, or its process's optimizer
    steps marked ``*`` (the script reports no step of its own)."""
    if r.step is None:
        return "-"
    return f"{r.step}*" if r.reported is False else str(r.step)


def process_text(r: RankRow) -> str:
    """A rank's process after an in-process restart: kept, a standby's or
    replaced (and its pid)."""
    what = "?" if r.kept is None else "kept" if r.kept else "replaced"
    if r.standby:
        what = "standby"
    return what if r.pid is None else f"{what} (pid {r.pid})"


def _stacks_block(stacks: HangStacks | None) -> list[str]:
    """Where each rank sat when the last hang was declared."""
    if stacks is None or not stacks.ranks:
        return []
    out = [f"\nstacks at the last hang (round {stacks.round}), stuck ranks first:"]
    for r in stacks.ranks:
        role = "waiting in torch" if r.in_torch else "stuck in its own code"
        where = _p(r.frames[0]) if r.frames else "(no Python frame)"
        out.append(f"  rank {r.rank} on {_p(r.host or '?')} [{role}] sits in {where}")
    return out


class Printer:
    """Prints summaries: once, or for ``--watch`` each change.

    ``--json``: one object per line. A table on a terminal is redrawn in place
    (cursor moved back over the previous drawing, each line rewritten), and
    refreshed each second so that durations keep counting; a table into a
    file or pipe is printed once in full, then only the lines that changed,
    under a time stamp (``+`` new, ``-`` gone)."""

    def __init__(
        self,
        args: argparse.Namespace,
        where: str,
        stream: TextIO | None = None,
        tty: bool | None = None,
    ) -> None:
        self.json = bool(args.json)
        self.watch = bool(args.watch)
        self.where = where
        self.stream = stream if stream is not None else sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self._drawn_rows = 0
        self._last_lines: list[str] | None = None
        self._last: Summary | None = None
        self._last_at = 0.0

    @property
    def ticks(self) -> bool:
        """Whether the display wants a refresh each second (a live table)."""
        return self.watch and self.tty and not self.json

    def __call__(self, summary: Summary) -> None:
        self._last, self._last_at = summary, time.monotonic()
        if self.json:
            self._write(json.dumps(summary.to_json(), sort_keys=True) + "\n")
        elif not self.watch:
            self._write(render_table(summary, self.where) + "\n")
        elif self.tty:
            self._redraw(render_table(summary, self.where))
        else:
            self._changes(summary)

    def tick(self) -> None:
        """Redraw the last summary with its durations advanced (terminal only)."""
        if not self.ticks or self._last is None:
            return
        since = self._last.state_for_s
        if since is not None:
            aged = dataclasses.replace(
                self._last, state_for_s=since + time.monotonic() - self._last_at
            )
            self._redraw(render_table(aged, self.where))

    def _redraw(self, text: str) -> None:
        cols, rows = shutil.get_terminal_size((80, 24))
        lines = text.splitlines()
        height = sum(max(1, math.ceil(len(ln) / max(cols, 1))) for ln in lines)
        out = ""
        if self._drawn_rows and self._drawn_rows < rows:
            out = f"\x1b[{self._drawn_rows}F"  # back to the start of the drawing
        elif self._drawn_rows:
            out = "\x1b[H\x1b[2J"  # taller than the screen: start over at the top
        out += "".join(f"\x1b[2K{ln}\n" for ln in lines) + "\x1b[J"
        self._drawn_rows = height
        self._write(out)

    def _changes(self, summary: Summary) -> None:
        # Compared without what changes by itself (durations, the revision).
        lines = render_table(summary.quiet(), self.where)
        now = lines.splitlines()
        before, self._last_lines = self._last_lines, now
        if before is None:
            self._write(render_table(summary, self.where) + "\n")
            return
        diff = [
            ln[0] + " " + ln[2:]
            for ln in difflib.ndiff(before, now)
            if ln[:1] in "+-" and ln[2:].strip()
        ]
        if not diff:
            return
        stamp = time.strftime("%H:%M:%S")
        self._write(f"--- {stamp} ({_revision(summary)})\n" + "\n".join(diff) + "\n")

    def _write(self, text: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.stream.write(text)
            self.stream.flush()
