"""Per-rank step times, shared through the store, and stragglers named.

While a group runs, every ``PUBLISH_EVERY`` seconds each agent reads its
ranks' progress files (written by the worker runner: worker/_progress.py; the
step time is the median of the rank's recent optimizer step intervals) and
leaves them as the job note ``progress_{group rank}``. It reads the other
members' notes of the same round and compares each of its ranks' *own time*
(its step time outside backward passes: under DDP every rank's step lasts as
long as the slowest's, the others waiting in the backward pass's all-reduce)
with the median own time of all ranks: a rank more than ``SLOW_RATIO`` times the
median for ``SUSTAIN`` reports in a row (``SUSTAIN * PUBLISH_EVERY`` seconds)
is a straggler: flagged in its note (so ``elastrun status`` shows it) and
announced once with a ``straggler`` event. Nothing is done about it.

The rule is pure (:class:`StragglerRule`), tested without I/O; the loop is
its thin driver.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from elastrun.agent.watchdog import read_beat
from elastrun.agent.workers import WorkerGroup
from elastrun.events import EventSink
from elastrun.rendezvous.api import Rendezvous, RoundResult

__all__ = ["PUBLISH_EVERY", "SLOW_RATIO", "SUSTAIN", "StragglerRule", "note_name", "publish_loop"]

PUBLISH_EVERY = 5.0
SLOW_RATIO = 1.2  # slower than the median by more than 20%
SUSTAIN = 3  # reports in a row


def note_name(group_rank: int) -> str:
    return f"progress_{group_rank}"


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
        median = statistics.median(times)
        for rank, t in mine.items():
            slow = t > self.ratio * median
            self.slow_for[rank] = self.slow_for.get(rank, 0) + 1 if slow else 0
        return {r for r, n in self.slow_for.items() if n >= self.sustain and r in mine}


def local_progress(group: WorkerGroup) -> list[dict[str, Any]]:
    """Each local rank's last progress, as the note carries it."""
    out = []
    now = time.monotonic()
    for w in group.workers:
        beat = read_beat(w.heartbeat_file) if w.heartbeat_file else None
        if beat is None:
            continue
        out.append(
            {
                "rank": w.rank,
                "step": beat.step,
                "steps": beat.steps,
                "step_time": beat.step_time,
                "own_time": beat.own_time,
                "idle_s": round(max(0.0, now - beat.monotonic), 3),
                "phase": beat.phase,
            }
        )
    return out


async def publish_loop(
    rendezvous: Rendezvous,
    group: WorkerGroup,
    result: RoundResult,
    host: str,
    events: EventSink,
    *,
    every: float = PUBLISH_EVERY,
) -> None:
    """Publish this node's step times until cancelled; flag stragglers."""
    rule = StragglerRule()
    announced: set[int] = set()
    names = [note_name(m.group_rank) for m in result.members]
    while True:
        await asyncio.sleep(every)
        ranks = local_progress(group)
        if not ranks:
            continue  # no worker reports progress (yet, or ever: --no-python)
        notes = await rendezvous.gather_notes(names, 0.0)
        everyone = [
            float(r["own_time"])
            for name, note in notes.items()
            if note.get("round") == result.round and name != note_name(result.group_rank)
            for r in note.get("ranks") or ()
            if isinstance(r, dict) and isinstance(r.get("own_time"), int | float)
        ]
        mine = {r["rank"]: float(r["own_time"]) for r in ranks if r["own_time"] is not None}
        slow = rule.observe(mine, [*everyone, *mine.values()])
        for r in ranks:
            r["straggler"] = r["rank"] in slow
        for rank in sorted(slow - announced):
            announced.add(rank)
            median = statistics.median([*everyone, *mine.values()])
            events.emit(
                "straggler",
                rank=rank,
                own_time_s=round(mine[rank], 4),
                median_s=round(median, 4),
                round=result.round,
            )
        await rendezvous.write_note(
            note_name(result.group_rank),
            {
                "round": result.round,
                "host": host,
                "at": round(time.time(), 3),
                "ranks": ranks,
            },
        )
