"""A declared hang, across nodes: every rank's stack in one failure summary.

The node whose watchdog declared the hang (agent/hang_group.py) has its
local ranks' stacks. The others learn of the restart from the store (a round
opened by a failure whose record says ``hang``) and, before they stop their
workers, collect their ranks' stacks too. Each node leaves them as the job
note ``stacks_{round}_{group rank}`` (:class:`~elastrun.rendezvous.notes.StacksNote`,
at most its share of the hang's byte budget: the top frames only beyond it);
the declaring node waits (at most ``GATHER_TIMEOUT``) for the other members'
notes and prints all of them, the hung rank first. ``elastrun status`` reads
the same notes.

A note is another node's bytes, or anyone's who reaches the store: the
declaring node takes only notes that decode within the note limits, match the
schema, are about this round and come from the member at that group rank
with that member's ranks. For a member whose note is missing or refused, the
summary says so (and why) instead; every string is escaped for the terminal.
"""

from __future__ import annotations

import json
from dataclasses import replace

from elastrun.agent.stacks import RankStacks, report
from elastrun.frozen import frozen
from elastrun.rendezvous import notes as N
from elastrun.rendezvous.api import Rendezvous, RoundResult, whole
from elastrun.untrusted import printable

__all__ = ["GATHER_TIMEOUT", "Gathered", "gather", "share", "summary"]

GATHER_TIMEOUT = 4.0  # s the declaring node waits for the other nodes' stacks


def _untyped(s: N.RankStack) -> RankStacks:
    return RankStacks(rank=s.rank, host=s.host, frames=s.frames, in_torch=s.in_torch, hung=s.hung)


def note_of(stacks: list[RankStacks], result: RoundResult) -> N.StacksNote:
    """This node's stacks note, within its share of the hang's byte budget:
    the top frames only (10 of a hung rank, 1 of the others) beyond it, then
    as many ranks as fit."""
    budget = N.stacks_budget(result.group_world_size)
    node_id = result.me.node_id
    ranks: list[N.RankStack] = list(stacks)

    def make(rs: list[N.RankStack]) -> N.StacksNote:
        return N.StacksNote(result.round, result.group_rank, node_id, tuple(rs))

    def size(note: N.StacksNote) -> int:
        return len(json.dumps(note.to_json()))

    note = make(ranks)
    if size(note) > budget:
        note = make([replace(r, frames=r.frames[: 10 if r.hung else 1]) for r in ranks])
    while note.ranks and size(note) > budget:
        note = make(list(note.ranks[: len(note.ranks) // 2]))
    return note


async def share(rendezvous: Rendezvous, result: RoundResult, stacks: list[RankStacks]) -> None:
    """Leave this node's stacks for the others (and for ``elastrun status``)."""
    if stacks:
        note = note_of(stacks, result)
        await rendezvous.write_note(note)


@frozen
class Gathered:
    """Every rank's stacks found, and a line for each member without a usable note."""

    stacks: list[RankStacks]
    missing: list[str]


async def gather(rendezvous: Rendezvous, result: RoundResult, own: list[RankStacks]) -> Gathered:
    """``own`` and the other members' stacks of this round (bounded wait)."""
    result = await whole(rendezvous, result)
    seats = N.seats((m.node_id, m.group_rank, m.nproc) for m in result.members)
    others = [m for m in result.members if m.group_rank != result.group_rank]
    wanted = [seats[m.group_rank] for m in others]
    notes = (
        await rendezvous.gather_notes(N.StacksNote, result.round, wanted, GATHER_TIMEOUT)
        if wanted
        else {}
    )
    out, missing = list(own), []
    for m in others:
        who = f"{printable(m.host, limit=N.MAX_TEXT)} (group rank {m.group_rank})"
        note = notes.get(m.group_rank)
        if note is None:
            missing.append(
                f"  {who}: no readable stacks note within {GATHER_TIMEOUT:g} s "
                "(absent, or not JSON within the note limits)"
            )
        elif isinstance(note, N.Refused):
            missing.append(f"  {who}: its stacks note was refused: {printable(note.why)}")
        else:
            out.extend(_untyped(s) for s in note.ranks)
    return Gathered(out, missing)


def _escaped(s: RankStacks) -> RankStacks:
    """``s`` with what another node wrote made safe for the terminal (one line each)."""
    return replace(
        s,
        host=printable(s.host, limit=N.MAX_TEXT),
        frames=tuple(printable(f, limit=N.MAX_TEXT) for f in s.frames),
    )


def summary(gathered: Gathered, attempt_dir: str | None) -> str:
    """The stacks section of the failure summary ("" when there are none)."""
    where = f"{attempt_dir}/<local_rank>/stacks.txt" if attempt_dir else None
    text = report([_escaped(s) for s in gathered.stacks], where)
    if gathered.missing and text:
        text += "\nno stacks from:\n" + "\n".join(gathered.missing)
    return text
