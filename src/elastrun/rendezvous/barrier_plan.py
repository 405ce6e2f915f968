"""The exit barrier's set-up, step by step (pure; part of the planner, :mod:`.plan`).

After its done key, a member counts the done keys; then it finds whom to
watch: the first member in rank order whose presence key exists (the
barrier's watcher), checking on the way that each member before it that is
gone put its done key (else it is lost). :func:`barrier_step` says the next
step from what is known so far; the driver (:mod:`.dynamic`) reads one key per
step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from elastrun.frozen import frozen
from elastrun.rendezvous.protocol import BarrierDone
from elastrun.rendezvous.records import MemberRecord

__all__ = [
    "BarrierSeen",
    "BarrierStep",
    "BeWatcher",
    "CheckDone",
    "CheckPresence",
    "LostAtBarrier",
    "WatchWatcher",
    "barrier_step",
]


@frozen
class BarrierSeen:
    """What a member's done txn read at its revision, as good as reads made
    then: the done keys' count (its own counted) and whether the presence
    keys of the first members exist (group rank 0's, unless it is this node)."""

    round: int
    revision: int
    count: int
    present: Mapping[str, bool]


@frozen
class CheckPresence:
    """Read this member's presence key, then ask again."""

    node_id: str


@frozen
class CheckDone:
    """Read whether this member put its done key, then ask again."""

    node_id: str


@frozen
class WatchWatcher:
    """Watch this member's presence key: it is the barrier's watcher."""

    node_id: str


@frozen
class LostAtBarrier:
    """This member is gone without a done key: it is lost."""

    member: MemberRecord


@frozen
class BeWatcher:
    """This node is the barrier's watcher: read and watch the done keys and
    ``nodes/``."""


BarrierStep = BarrierDone | CheckPresence | CheckDone | WatchWatcher | LostAtBarrier | BeWatcher


def barrier_step(
    members: Sequence[MemberRecord],
    me: str,
    done_count: int,
    present: Mapping[str, bool],
    done: Mapping[str, bool],
    *,
    size: int | None = None,
) -> BarrierStep:
    """The next step of setting up the exit barrier, after this node's done
    key, from the count of done keys and what is known so far of the members
    before this node (``members``: the first ones in rank order, of ``size``
    in all, every one by default; ``present``: presence key exists; ``done``:
    done key exists). Every member counted: done. Else the watcher is the
    first member in rank order whose presence key exists; a member before it
    that is gone must have a done key, else it is lost; none before this node:
    this node watches (:class:`BeWatcher` past the members known: read them
    all, then ask again)."""
    size = len(members) if size is None else size
    if size and done_count >= size:
        return BarrierDone()
    for m in members:
        nid = m.node_id
        if nid == me:
            break
        if nid not in present:
            return CheckPresence(nid)
        if present[nid]:
            return WatchWatcher(nid)
        if nid not in done:
            return CheckDone(nid)
        if not done[nid]:
            return LostAtBarrier(m)
    return BeWatcher()
