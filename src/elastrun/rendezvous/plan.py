"""The rendezvous planner: pure decisions over what a node read (no I/O).

The rules (:mod:`.rules`) say what to do on an event; this module says what
to read and watch, who decides, who watches the exit barrier, and which events
the store's state and its watch events mean. The driver (:mod:`.dynamic`,
:mod:`.node_io`) does the reads, watches and writes these functions ask for,
fills a :class:`View` with what it got, and feeds the events back to the
rules. Everything here is a function of its arguments and is tested without
a store (tests/unit/test_rdzv_plan.py).

What each phase reads, then watches (:func:`plan_phase`):

=========== ================================================================
phase       reads, then watches
=========== ================================================================
seek        ``round`` (creating round 0 if absent)
join        ``round``; the round's joins: the decider (:func:`join_role`)
            the joins prefix and ``nodes/``, a follower only its
            predecessor's join key (read alone where this node's own join
            is the newest up to its revision: :func:`follower_of_newest`)
wait        ``round``, ``nodes/``
member      ``round``, ``waiting/``; then :func:`barrier_step` without done
            keys: the round's watcher (the first member present in rank
            order) reads and watches ``nodes/``, every other member only the
            watcher's presence key
complete    ``round``; the count of the round's done keys (O(1) bytes); then
            :func:`barrier_step`: the barrier's watcher reads and watches the
            done keys and ``nodes/``, every other member only the watcher's
            presence key
=========== ================================================================

(:func:`barrier_step`, the exit barrier's set-up, is :mod:`.barrier_plan`'s.)

A closed round's result is read as this node's head (the header and its own
shard: O(1) bytes, :mod:`.results`) where the phase reads no ``nodes/``, and
whole where it does (:func:`result_needed`, :func:`whole_needed`): a member
without a presence key is lost. So ``seek``, ``join`` (but the decider's),
``member`` and ``complete`` (but the round watcher's) cost each node O(1)
bytes; ``wait`` O(n) (a node waiting beside the round).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from elastrun.frozen import frozen
from elastrun.rendezvous import keys as K
from elastrun.rendezvous.damage import agreed
from elastrun.rendezvous.keys import Memo
from elastrun.rendezvous.protocol import (
    BarrierDone,
    Event,
    JoinersChanged,
    MemberLost,
    NodeWaiting,
    RoundClosed,
    RoundFailed,
    RoundFinished,
    RoundOpen,
    State,
)
from elastrun.rendezvous.records import (
    TAKEOVER_REASON,
    MemberRecord,
    ResultRecord,
    RoundRecord,
    RoundState,
    WaitingRecord,
)
from elastrun.rendezvous.results import Head
from elastrun.rendezvous.sizes import WorldSizes
from elastrun.store.base import KeyValue, WatchEvent

__all__ = [
    "Decider",
    "Follower",
    "GoneMember",
    "JoinRole",
    "Phase",
    "PhasePlan",
    "Reaction",
    "Resnap",
    "RoundChanged",
    "View",
    "Watched",
    "absent_members",
    "all_done",
    "decode_round",
    "follower_of_newest",
    "join_role",
    "joiners_event",
    "lost_event",
    "lost_node",
    "plan_phase",
    "react",
    "result_needed",
    "round_event",
    "waiting_event",
    "whole_needed",
]

LOST_LEASE = "lease expired or revoked"


# -- phases: what each reads and watches ---------------------------------------------
class Phase(enum.Enum):
    SEEK = "seek"
    JOIN = "join"
    WAIT = "wait"
    MEMBER = "member"
    COMPLETE = "complete"


@frozen
class PhasePlan:
    """What one phase reads and watches, besides ``round`` (every phase)."""

    phase: Phase
    round: int
    joins: bool = False  # the round's joins (see join_role, follower_of_newest)
    nodes: bool = False  # read and watch nodes/
    waiting: bool = False  # read and watch waiting/
    barrier: bool = False  # count the done keys, then barrier_step
    watch_members: bool = False  # barrier_step without done keys: the members' loss watch


_PHASES = {
    State.SEEKING: Phase.SEEK,
    State.JOINING: Phase.JOIN,
    State.DECIDING: Phase.JOIN,
    State.WAITING: Phase.WAIT,
    State.MEMBER: Phase.MEMBER,
    State.COMPLETING: Phase.COMPLETE,
}


def plan_phase(state: State, round: int) -> PhasePlan | None:
    """The phase of the machine's state in ``round``; None where none waits."""
    phase = _PHASES.get(state)
    if phase is None:
        return None
    return PhasePlan(
        phase,
        round,
        joins=phase is Phase.JOIN,
        nodes=phase is Phase.WAIT,
        waiting=phase is Phase.MEMBER,
        barrier=phase is Phase.COMPLETE,
        watch_members=phase is Phase.MEMBER,
    )


class Watched(enum.Enum):
    """What one of a phase's watches is on."""

    ROUND = "round"  # the job's round record
    JOINS = "joins"  # the round's joins (the decider)
    PREDECESSOR = "predecessor"  # one join key (a follower's predecessor)
    NODES = "nodes"  # every presence key
    WAITING = "waiting"  # every waiting key
    DONE = "done"  # the round's done keys (the barrier's watcher)
    WATCHER = "watcher"  # the barrier watcher's presence key (the other members)


decode_round = Memo(agreed(RoundRecord.decode, "round record"))  # damaged: RecordDamaged


# -- the snapshot ------------------------------------------------------------------
@dataclass
class View:
    """What this node knows of the store in the current phase: what it read,
    updated by the phase's watch events (:func:`react`)."""

    round_kv: KeyValue | None = None
    round: RoundRecord | None = None
    round_rev: int = 0  # the store revision round_kv is known at
    # Closed rounds' results (immutable once written): the head (the header
    # and this node's place) of each read, and every member where needed
    # (see result_needed).
    heads: dict[int, Head] = field(default_factory=dict)
    results: dict[int, ResultRecord] = field(default_factory=dict)
    joiners: dict[str, KeyValue] = field(default_factory=dict)
    nodes: dict[str, KeyValue] = field(default_factory=dict)
    nodes_loaded: bool = False
    waiting: dict[str, KeyValue] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)  # members known to have put a done key
    predecessor: str | None = None
    # The exit barrier's watcher whose presence this node watches (None: this
    # node is the watcher, or not at the barrier).
    watcher: str | None = None
    decider: bool = False
    # How many joined, where only a follower's predecessor was read (not
    # every join): see follower_of_newest.
    joined_count: int | None = None

    def set_round(self, kv: KeyValue | None, revision: int | None = None) -> None:
        """``round`` as it is at store ``revision`` (None: absent; the
        revision: its own by default)."""
        self.round_kv = kv
        self.round = None if kv is None else decode_round(kv.key, kv.value)
        self.round_rev = revision if revision is not None else kv.mod_revision if kv else 0

    def members(self, r: int) -> tuple[MemberRecord, ...]:
        """The members of closed round ``r`` in rank order (as read; empty
        where only its head was read)."""
        result = self.results.get(r)
        return result.members if result else ()

    def size(self, r: int) -> int:
        """The member count of closed round ``r`` (0: not read)."""
        head = self.heads.get(r)
        return head.header.size if head else len(self.members(r))

    def has_member(self, r: int, node_id: str) -> bool:
        """Whether ``node_id`` is a member of closed round ``r`` (as read)."""
        head = self.heads.get(r)
        if head is not None and head.mine is not None and head.mine.member.node_id == node_id:
            return True
        return any(m.node_id == node_id for m in self.members(r))

    def known(self, r: int) -> tuple[MemberRecord, ...]:
        """Round ``r``'s members known in rank order from the first: every
        member, or group rank 0 alone where only the head was read."""
        if r in self.results:
            return self.results[r].members
        head = self.heads.get(r)
        return (head.header.first,) if head else ()


# -- the decider ----------------------------------------------------------------------
@frozen
class Decider:
    """This node decides the round: it watches every join and ``nodes/``."""


@frozen
class Follower:
    """This node watches only its predecessor's join key; when it goes, the
    phase is read again (this node may be the decider then)."""

    predecessor: str


JoinRole = Decider | Follower


def join_role(me: str, joins: Iterable[KeyValue]) -> JoinRole | None:
    """The decider is the live joiner with the smallest join revision; every
    other joiner follows the joiner just before it. None: not joined."""
    ids = [K.node_id_of(kv.key) for kv in sorted(joins, key=lambda kv: kv.create_revision)]
    if ids and ids[0] == me:
        return Decider()
    if me in ids:
        return Follower(ids[ids.index(me) - 1])
    return None


def follower_of_newest(me: str, newest: Sequence[KeyValue]) -> Follower | None:
    """The role read from the (up to) two newest joins created up to this
    node's own join, newest first: a follower of the second where the first is
    this node's. None where that does not tell (this node's join is not the
    newest there, or it is alone: read every join)."""
    ids = [K.node_id_of(kv.key) for kv in newest]
    if len(ids) < 2 or ids[0] != me:
        return None
    return Follower(ids[1])


# -- the exit barrier (its set-up steps: .barrier_plan) ------------------------------
def all_done(view: View, r: int) -> bool:
    """Every member of round ``r`` put its done key (checked member by member
    only once there are as many done keys as members: the watcher asks at
    each of n done keys)."""
    members = view.members(r)
    if not members or len(view.done) < len(members):
        return False
    return all(m.node_id in view.done for m in members)


# -- store state -> events --------------------------------------------------------------
def result_needed(view: View) -> int | None:
    """The round whose result :func:`round_event` needs and the view lacks:
    its head, or every member where this phase watches ``nodes/`` (a member
    gone is lost: :func:`whole_needed`)."""
    rec = view.round
    if rec is None or rec.state is not RoundState.CLOSED:
        return None
    r = rec.round
    if r in view.results or (r in view.heads and not whole_needed(view)):
        return None
    return r


def whole_needed(view: View) -> bool:
    """Whether this phase needs every member of the closed round (it reads
    ``nodes/``: members without a presence key are lost)."""
    return view.nodes_loaded


def round_event(
    view: View, me: str, host: str, max_nodes: int, *, unit: int = 1, now: float = 0.0
) -> Event | None:
    """The event of the round record (a closed round's result must be in the
    view: :func:`result_needed`). A node outside a closed round has room when
    it makes a larger allowed world with the members (``--node-unit``
    ``unit``: :class:`.sizes.WorldSizes`)."""
    rec = view.round
    if rec is None:
        return None
    r, state = rec.round, rec.state
    if state is RoundState.OPEN:
        return RoundOpen(r, now)
    if state is RoundState.FINISHED:
        return RoundFinished(r)
    if state is RoundState.FAILED:
        return RoundFailed(r)
    lost = ""
    if view.nodes_loaded:
        gone = [m.node_id for m in view.members(r) if m.node_id not in view.nodes]
        lost = f"node {gone[0]} lost (no presence in the store)" if gone else ""
    return RoundClosed(
        r,
        member=view.has_member(r, me),
        room=WorldSizes(1, max_nodes, unit).room(view.size(r), 1),
        lost=lost,
        detail=f"node {host} ({me}) waits to join",
    )


def joiners_event(view: View, now: float) -> JoinersChanged:
    """The joiners of the open round, as the decider (or a follower) sees them."""
    prev = view.round.prev if view.round is not None else ()
    # Each check below scans only once the counts allow it (the decider asks
    # at each of n joins: O(n) per join would be O(n^2) per round).
    all_joined = (
        bool(prev)
        and view.nodes_loaded
        and len(view.joiners) >= len(view.nodes)
        and all(nid in view.joiners for nid in view.nodes)
        and not view.waiting
    )
    count = len(view.joiners) if view.joined_count is None else view.joined_count
    # Only read by the rules at max nodes joined, never fewer than prev's.
    pending = (
        view.nodes_loaded
        and count >= len(prev)
        and any(p.node_id in view.nodes and p.node_id not in view.joiners for p in prev)
    )
    if view.round is not None and view.round.reason == TAKEOVER_REASON:
        # A new host's store: the others may not have registered yet.
        all_joined = all_joined and count >= len(prev) - 1
    return JoinersChanged(
        now, count, decider=view.decider, all_joined=all_joined, members_pending=pending
    )


def absent_members(view: View, r: int) -> list[MemberRecord]:
    """Members of round ``r`` without a presence key nor a known done key:
    each is lost unless it put its done key (the driver checks)."""
    return [
        m for m in view.members(r) if m.node_id not in view.nodes and m.node_id not in view.done
    ]


def lost_event(member: MemberRecord, how: str = LOST_LEASE, *, left: bool = False) -> MemberLost:
    """A member gone: lost (``how``), or ``left`` the job on purpose (its
    agent stopped and said so before it revoked its lease)."""
    who = f"node {member.host} ({member.node_id})"
    return MemberLost(f"{who} left the job (its agent stopped)" if left else f"{who} lost: {how}")


_LOST = re.compile(r"node .* \(([A-Za-z0-9._-]{1,128})\) (?:lost: |left the job)")


def lost_node(detail: str) -> str | None:
    """The node id in a :func:`lost_event`'s line (the ``node_lost`` event's
    ``detail``), or None when the line is not one."""
    m = _LOST.match(detail)
    return m.group(1) if m else None


def waiting_event(
    view: View, r: int, node_id: str, max_nodes: int, *, unit: int = 1
) -> NodeWaiting:
    """A node waits beside round ``r``: room when the waiting nodes (this one
    among them) make a larger allowed world with the members; spares below
    the next multiple of ``unit`` wait on."""
    waiting = max(1, len(view.waiting))
    room = WorldSizes(1, max_nodes, unit).room(view.size(r), waiting)
    kv = view.waiting.get(node_id)
    host = WaitingRecord.decode(kv.key, kv.value).host if kv else node_id
    return NodeWaiting(room, f"node {host} ({node_id}) waits to join")


# -- watch events -> reactions ------------------------------------------------------------
@frozen
class Resnap:
    """Set the phase up again: read, then watch (the predecessor or the
    barrier's watcher left)."""


@frozen
class RoundChanged:
    """The round record changed (in the view): its event is
    :func:`round_event`, once any result it needs is read."""


@frozen
class GoneMember:
    """A member's presence went: :func:`lost_event` unless it put its done
    key; if it did and ``resnap`` (it was the barrier's watcher), set the
    phase up again."""

    member: MemberRecord
    resnap: bool = False


Reaction = list[Event] | Resnap | RoundChanged | GoneMember


def react(
    view: View,
    watched: Watched,
    wev: WatchEvent,
    *,
    r: int,
    now: float,
    max_nodes: int,
    unit: int = 1,
) -> Reaction:
    """Apply one watch event of the phase in round ``r`` to the view; what
    it means (``now``: this node's clock; ``max_nodes``, ``unit``: the job's
    max and node unit)."""
    nid, put = K.node_id_of(wev.kv.key), wev.type == "put"
    if watched is Watched.ROUND:
        if wev.kv.mod_revision <= view.round_rev:
            return []  # already known: the phase started from a newer snapshot
        view.set_round(wev.kv if put else None, wev.kv.mod_revision)
        return RoundChanged()
    if watched is Watched.PREDECESSOR:
        return [] if put else Resnap()
    if watched is Watched.JOINS:
        _apply(view.joiners, nid, wev)
        return [joiners_event(view, now)]
    if watched is Watched.NODES:
        return _nodes_changed(view, nid, wev, r, now)
    if watched is Watched.DONE:
        if put and nid not in view.done:
            view.done.add(nid)
            if all_done(view, r):
                return [BarrierDone()]
        return []
    if watched is Watched.WATCHER:
        member = _member(view, r, nid)
        if put or member is None:
            return []
        return GoneMember(member, resnap=True)
    _apply(view.waiting, nid, wev)  # Watched.WAITING
    return [waiting_event(view, r, nid, max_nodes, unit=unit)] if put else []


def _apply(keys: dict[str, KeyValue], nid: str, wev: WatchEvent) -> None:
    if wev.type == "put":
        keys[nid] = wev.kv
    else:
        keys.pop(nid, None)


def _member(view: View, r: int, nid: str) -> MemberRecord | None:
    return next((m for m in view.known(r) if m.node_id == nid), None)


def _nodes_changed(view: View, nid: str, wev: WatchEvent, r: int, now: float) -> Reaction:
    _apply(view.nodes, nid, wev)
    if view.decider:
        return [joiners_event(view, now)]
    member = None if wev.type == "put" else _member(view, r, nid)
    if member is None or nid in view.done:
        return []
    return GoneMember(member)
