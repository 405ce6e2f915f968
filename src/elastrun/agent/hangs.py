"""A declared hang, across nodes: every rank's stack in one failure summary.

The node whose watchdog declared the hang (agent/workers.py) has its local
ranks' stacks. The others learn of the restart from the store (a round
opened by a failure whose record says ``hang``) and, before they stop their
workers, collect their ranks' stacks too. Each node leaves them as the job
note ``stacks_{round}_{group rank}``; the declaring node waits (at most
``GATHER_TIMEOUT``) for the other members' notes and prints all of them, the
hung rank first. ``elastrun status`` reads the same notes.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from elastrun.agent.stacks import RankStacks, report
from elastrun.agent.workers import WorkerGroup
from elastrun.rendezvous.api import Rendezvous, RoundResult

__all__ = ["GATHER_TIMEOUT", "gather", "local_stacks", "note_name", "share"]

GATHER_TIMEOUT = 4.0  # s the declaring node waits for the other nodes' stacks
NOTE_BUDGET = 128 * 1024  # bytes of one node's stacks note (under the note limit)


def note_name(round_: int, group_rank: int) -> str:
    return f"stacks_{round_}_{group_rank}"


def local_stacks(group: WorkerGroup, host: str) -> list[RankStacks]:
    return [
        RankStacks.of(w.rank, host, w.stacks, w.main_thread, hung=w.hang is not None)
        for w in group.workers
        if w.stacks is not None
    ]


def _note(stacks: list[RankStacks], round_: int) -> dict[str, Any]:
    ranks = [s.to_json() for s in stacks]
    note: dict[str, Any] = {"round": round_, "ranks": ranks}
    if len(json.dumps(note)) > NOTE_BUDGET:  # many ranks: the top frames only
        cut = [replace(s, frames=s.frames[: 10 if s.hung else 1]) for s in stacks]
        note["ranks"] = [s.to_json() for s in cut]
    return note


async def share(rendezvous: Rendezvous, result: RoundResult, stacks: list[RankStacks]) -> None:
    """Leave this node's stacks for the others (and for ``elastrun status``)."""
    if stacks:
        await rendezvous.write_note(
            note_name(result.round, result.group_rank), _note(stacks, result.round)
        )


async def gather(
    rendezvous: Rendezvous, result: RoundResult, own: list[RankStacks]
) -> list[RankStacks]:
    """``own`` and the other members' stacks of this round (bounded wait)."""
    names = [
        note_name(result.round, m.group_rank)
        for m in result.members
        if m.group_rank != result.group_rank
    ]
    notes = await rendezvous.gather_notes(names, GATHER_TIMEOUT) if names else {}
    out = list(own)
    for note in notes.values():
        for raw in note.get("ranks") or ():
            s = RankStacks.from_json(raw)
            if s is not None:
                out.append(s)
    return out


def summary(stacks: list[RankStacks], attempt_dir: str | None) -> str:
    """The stacks section of the failure summary ("" when there are none)."""
    where = f"{attempt_dir}/<local_rank>/stacks.txt" if attempt_dir else None
    return report(stacks, where)
