"""Per-rank step times, shared through the store, and stragglers named.

While a group runs, every ``PUBLISH_EVERY`` seconds each agent reads its
ranks' progress files (written by the worker runner: worker/_progress.py; the
step time is the median of the rank's recent optimizer step intervals) and
replaces its note ``progress_{group rank}``
(:class:`~elastrun.rendezvous.notes.ProgressNote`), tied to its lease so that
it vanishes with the node.

The verdicts are made in one place: group rank 0's agent reads the round
members' progress notes (the notes of this round from the member at that
group rank, with that member's ranks; anything else is dropped), compares
each rank's *own time* (its step time outside backward passes: under DDP
every rank's step lasts as long as the slowest's, the others waiting in the
backward pass's all-reduce) with the median own time of all ranks, and writes
one bounded ``stragglers`` note
(:class:`~elastrun.rendezvous.notes.StragglersNote`, on its lease). A rank
more than ``SLOW_RATIO`` times the median for ``SUSTAIN`` reports in a row
(``SUSTAIN * PUBLISH_EVERY`` seconds) is a straggler. Every other agent reads
that one note and announces its own ranks once with a ``straggler`` event;
``elastrun status`` shows them. Nothing is done about a straggler.

Why one aggregator rather than every agent reading every note: with N nodes
each reading N notes per interval, the job's reads grow with N squared (64
nodes: 4096 note reads every 5 s); now each agent writes one note and reads
one, and group rank 0 reads N: O(N) in all, and a constant amount for every
agent but one. A store watch on the notes would deliver every node's note to
every agent: the same N squared, pushed instead of pulled. Group rank 0 is
the natural aggregator: every member knows it from the round's result (no
election), it exists in every round, and when it leaves the round ends.

The rule is pure (:class:`StragglerRule`), tested without I/O; the loop is
its thin driver.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from elastrun.agent.straggler_replacement import Replacement
from elastrun.agent.watchdog import read_beat
from elastrun.event_kinds import Straggler
from elastrun.events import EventSink
from elastrun.rendezvous import notes as N
from elastrun.rendezvous.api import Rendezvous, RoundResult, whole

__all__ = [
    "PUBLISH_EVERY",
    "SLOW_RATIO",
    "SUSTAIN",
    "RankFile",
    "StragglerRule",
    "local_progress",
    "publish_loop",
]

PUBLISH_EVERY = 5.0
SLOW_RATIO = N.SLOW_RATIO  # slower than the median by more than 20%
SUSTAIN = 3  # reports in a row


@dataclass
class StragglerRule:
    """Which ranks are persistently slower than the median of all ranks."""

    ratio: float = SLOW_RATIO
    sustain: int = SUSTAIN
    slow_for: dict[int, int] = field(default_factory=dict)

    def observe(self, mine: Mapping[int, float], everyone: Iterable[float]) -> set[int]:
        """One report: ``mine`` (rank -> step time) among ``everyone``'s step
        times (all ranks of the job, mine included). Returns my stragglers."""
        times = [t for t in everyone if t > 0]
        if len(times) < 2:
            self.slow_for.clear()
            return set()
        median = _median(times)
        for rank, t in mine.items():
            slow = t > self.ratio * median
            self.slow_for[rank] = self.slow_for.get(rank, 0) + 1 if slow else 0
        return {r for r, n in self.slow_for.items() if n >= self.sustain and r in mine}


def _median(values: list[float]) -> float:
    import statistics  # here: with decimal and fractions, 4 ms of every agent's start

    return statistics.median(values)


class RankFile(NamedTuple):
    """A local rank's progress file, and its process (``kept``: kept from an
    earlier round by an in-process restart; ``elastrun status`` shows it)."""

    rank: int
    path: str
    pid: int | None = None
    kept: bool | None = None
    standby: bool | None = None  # its process was a standby's


def local_progress(files: Sequence[RankFile]) -> list[N.RankProgress]:
    """Each local rank's last progress (``files``: its rank, progress file
    and process), as the note carries it."""
    out = []
    now = time.monotonic()
    for rank, path, pid, kept, standby in files:
        beat = read_beat(path)
        if beat is None:
            continue
        out.append(
            N.RankProgress(
                rank=rank,
                step=beat.step,
                reported=beat.reported,
                steps=beat.steps,
                step_time=beat.step_time,
                own_time=beat.own_time,
                idle_s=round(max(0.0, now - beat.monotonic), 3),
                phase=beat.phase[: N.MAX_PHASE] if beat.phase else None,
                pid=pid,
                kept=kept,
                standby=standby,
            )
        )
    return out


async def members_progress(rendezvous: Rendezvous, result: RoundResult) -> list[N.ProgressNote]:
    """The progress notes of ``result``'s round from its members (others dropped)."""
    seats = N.seats((m.node_id, m.group_rank, m.nproc) for m in result.members)
    found = await rendezvous.gather_notes(N.ProgressNote, result.round, list(seats.values()), 0.0)
    return [n for _, n in sorted(found.items()) if isinstance(n, N.ProgressNote)]


@dataclass
class Aggregator:
    """Group rank 0's part: every member's step times -> the stragglers note."""

    rule: StragglerRule = field(default_factory=StragglerRule)

    def judge(self, round_: int, notes: list[N.ProgressNote]) -> N.StragglersNote:
        times = {r.rank: r.own_time for n in notes for r in n.ranks if r.own_time is not None}
        slow = self.rule.observe(times, times.values())
        positive = [t for t in times.values() if t > 0]
        median = _median(positive) if positive else None
        found = tuple(N.Straggler(r, times[r]) for r in sorted(slow))
        return N.StragglersNote(round_, round(time.time(), 3), median, found[: N.MAX_STRAGGLERS])


async def _verdict(
    rendezvous: Rendezvous,
    result: RoundResult,
    aggregator: Aggregator | None,
    replacement: Replacement | None,
) -> N.StragglersNote | None:
    """This interval's stragglers note: judged here (group rank 0), else read.
    Group rank 0 then decides on a persistent straggler's replacement."""
    if aggregator is not None:
        notes = await members_progress(rendezvous, result)
        verdict = aggregator.judge(result.round, notes)
        await rendezvous.write_note(verdict)
        if replacement is not None:
            await replacement.consider(result, verdict, notes)
        return verdict
    return await rendezvous.read_note(N.StragglersNote, result.round)


async def publish_loop(
    rendezvous: Rendezvous,
    files: Sequence[RankFile],
    result: RoundResult,
    host: str,
    events: EventSink,
    *,
    every: float = PUBLISH_EVERY,
    replacement: Replacement | None = None,
) -> None:
    """Publish this node's step times (``files``: each local rank's rank,
    progress file and process) every ``every`` seconds until cancelled; group
    rank 0 judges the stragglers, every node announces its own. With
    ``replacement`` (``--replace-stragglers``): group rank 0 decides on a
    persistent straggler's replacement, and a node whose ranks are named
    looks whether it was replaced (agent/straggler_replacement.py)."""
    aggregator = Aggregator() if result.group_rank == 0 else None
    node_id = result.me.node_id
    mine = range(result.rank_offset, result.rank_offset + result.me.nproc)
    announced: set[int] = set()
    if replacement is not None and not replacement.enabled:
        replacement = None
    if replacement is not None:
        await replacement.look()  # replaced while the last round ended
    while True:
        await asyncio.sleep(every)
        ranks = local_progress(files)
        if ranks:
            note = N.ProgressNote(
                result.round,
                result.group_rank,
                node_id,
                host[: N.MAX_TEXT],
                round(time.time(), 3),
                tuple(ranks[: N.MAX_RANKS]),
            )
            await rendezvous.write_note(note)
        elif aggregator is None:
            continue  # no worker reports progress (yet, or ever: --no-python)
        if aggregator is not None and not result.complete:
            # Group rank 0 judges every member's notes: read them all (once).
            result = await whole(rendezvous, result)
        verdict = await _verdict(rendezvous, result, aggregator, replacement)
        if verdict is None:
            continue
        if replacement is not None and any(s.rank in mine for s in verdict.stragglers):
            await replacement.look()
        median = None if verdict.median is None else round(verdict.median, 4)
        for s in verdict.stragglers:
            if s.rank in mine and s.rank not in announced:
                announced.add(s.rank)
                events.emit(
                    Straggler(
                        rank=s.rank,
                        own_time_s=round(s.own_time, 4),
                        median_s=median,
                        round=result.round,
                    )
                )
