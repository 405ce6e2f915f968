"""Persistent stragglers replaced by a waiting spare (``--replace-stragglers K``).

Group rank 0's agent names the stragglers every interval (agent/stragglers.py:
a rank whose own step time is more than 1.2 times the median for 3 reports
in a row). With ``--replace-stragglers K`` it also counts, per node, the
intervals in a row that any of the node's ranks was named (:class:`Streaks`).
When one node reaches K, the decision (docs/reliability.md, *Stragglers
replaced*, has the safety argument):

1. pure, from the interval (:func:`judge_interval`): nothing yet below K; no
   second decision in a round; not when more than one node is named (a cause
   they share, or a peer's, not one node's); not when a member's progress is
   missing or stale (a peer may have broken the round);
2. from the store (:func:`judge_store`, over what
   :func:`~elastrun.rendezvous.quarantine.claim_state` read): the round is
   still the job's current, closed round; the node holds no active
   quarantine record; a spare waits, and the nodes left with the spares make
   a world of at least the current size (so never fewer nodes than
   ``--nnodes``' MIN, never more removed than spares wait);
3. the one decision: the node's quarantine record (reason ``straggler: ...``,
   kept for ``--quarantine-time``, else 10 minutes when that is 0), written by one
   compare-and-set on the round, the record and the spare's waiting key
   (:func:`~elastrun.rendezvous.quarantine.claim`). A decision that does not
   hold (step 1 or 2 says no) is only reported: a ``straggler_replacement``
   event with ``replaced: false`` and why, once per node, reason and round.

The straggler's own agent reads its quarantine record (one read) when a
round starts and whenever the stragglers note names one of its ranks; an
active record makes it leave the job (:class:`~elastrun.agent.hooks.Departure`:
the rendezvous left first, then its workers stopped; exit 1). The others see
a member leave: a membership change, not counted against ``--max-restarts``;
the spare takes its group rank (docs/spares.md). Restarted before the
record expires, its agent is refused (agent/attribution.py), as after a node
fault; with ``--replace-stragglers`` the agent also reads its record before
each later round (agent/agent.py), so a node whose round ended for another
reason before it saw the decision does not join the next.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from elastrun.agent.hooks import Departure, Leave
from elastrun.agent.spec import StragglerSettings
from elastrun.event_kinds import StragglerReplacement
from elastrun.events import EventSink
from elastrun.frozen import frozen
from elastrun.rendezvous import notes as N
from elastrun.rendezvous.api import Rendezvous, RoundResult
from elastrun.rendezvous.quarantine import ClaimState, QuarantineRecord
from elastrun.rendezvous.sizes import WorldSizes
from elastrun.untrusted import printable

__all__ = [
    "STALE_INTERVALS",
    "Outcome",
    "Replacement",
    "Streaks",
    "fresh",
    "judge_interval",
    "judge_store",
]

# A rank whose last progress is older than this many intervals (plus three of
# its own step times) is stale: its progress does not show what it does now.
STALE_INTERVALS = 3


class Outcome(enum.Enum):
    """What one interval's judgment comes to."""

    WAIT = "no node named for enough intervals in a row"
    LOOK = "read the store"  # the interval allows it: step 2 decides
    REPLACE = "replaced by a waiting spare"
    DONE = "a node was already replaced in this round"
    SEVERAL = "more than one node is named a straggler (a shared cause): reported only"
    STALE = "a member's progress is missing or stale (a peer may be at fault): reported only"
    ROUND = "the round changed (a failure or a membership change): reported only"
    HELD = "the node is already kept out (its quarantine record is active)"
    NO_SPARE = "no spare waits: reported only"
    SIZE = "the nodes left and the spares would not keep the world's size: reported only"
    FULL = "the quarantine records are full: reported only"


@dataclass
class Streaks:
    """Intervals in a row each node (by node id) had a rank named (pure)."""

    counts: dict[str, int] = field(default_factory=dict)

    def observe(self, named: Iterable[str]) -> None:
        """One interval: ``named``, the nodes with a rank named this interval."""
        now = set(named)
        self.counts = {n: self.counts.get(n, 0) + 1 for n in now}

    def longest(self) -> tuple[str, int] | None:
        """The node named longest in a row, and for how many intervals."""
        if not self.counts:
            return None
        node = max(sorted(self.counts), key=lambda n: self.counts[n])
        return node, self.counts[node]


def judge_interval(streak: int, after: int, named: int, fresh: bool, decided: bool) -> Outcome:
    """Step 1 (pure): a node named ``streak`` intervals in a row, with
    ``--replace-stragglers`` ``after``; ``named`` nodes named this interval;
    ``fresh``: every member's progress is in and recent; ``decided``: this
    round already replaced a node."""
    if after < 1 or streak < after:
        return Outcome.WAIT
    if decided:
        return Outcome.DONE
    if named > 1:
        return Outcome.SEVERAL
    if not fresh:
        return Outcome.STALE
    return Outcome.LOOK


def judge_store(state: ClaimState | None, members: int, sizes: WorldSizes) -> Outcome:
    """Step 2 (pure): what the store holds (``state``: None when it did not
    answer) allows replacing one of the round's ``members`` nodes."""
    if state is None or not state.current:
        return Outcome.ROUND
    if state.held is not None:
        return Outcome.HELD
    if not state.spares:
        return Outcome.NO_SPARE
    if sizes.fit(members - 1 + len(state.spares)) < members:
        return Outcome.SIZE
    if state.full:
        return Outcome.FULL
    return Outcome.REPLACE


def fresh(notes: Sequence[N.ProgressNote], members: int, interval: float) -> bool:
    """Every one of the round's ``members`` sent its note, and each of its
    ranks reported an own step time and progress within the last
    :data:`STALE_INTERVALS` intervals (plus three of its step times)."""
    if len(notes) < members:
        return False
    for note in notes:
        if not note.ranks:
            return False
        for r in note.ranks:
            if r.own_time is None or r.idle_s is None:
                return False
            if r.idle_s > STALE_INTERVALS * interval + 3 * (r.step_time or 0.0):
                return False
    return True


@dataclass
class Replacement:
    """The feature's state in one round: group rank 0's decision, and every
    node's look at its own quarantine record."""

    rendezvous: Rendezvous
    settings: StragglerSettings
    sizes: WorldSizes
    events: EventSink
    departure: Departure
    host: str
    streaks: Streaks = field(default_factory=Streaks)
    decided: bool = False
    record: QuarantineRecord | None = None  # the decision this agent made
    reported: set[tuple[str, Outcome]] = field(default_factory=set)

    @property
    def enabled(self) -> bool:
        return self.settings.replace_after > 0

    # ------------------------------------------------------ group rank 0
    async def consider(
        self, result: RoundResult, verdict: N.StragglersNote, notes: Sequence[N.ProgressNote]
    ) -> Outcome:
        """One interval's verdict (``verdict``, judged from ``notes``): the
        decision, made or reported (see the module docstring)."""
        slow = {s.rank for s in verdict.stragglers}
        named = {n.node_id: n for n in notes if any(r.rank in slow for r in n.ranks)}
        self.streaks.observe(named)
        top = self.streaks.longest()
        if not self.enabled or top is None:
            return Outcome.WAIT
        node_id, streak = top
        outcome = judge_interval(
            streak,
            self.settings.replace_after,
            len(named),
            fresh(notes, result.group_world_size, self.settings.interval),
            self.decided,
        )
        note = named.get(node_id)
        # The host as the round's result names the member (the rendezvous'
        # record), not as its note says (a note is anyone's to write).
        host = next((m.host for m in result.members if m.node_id == node_id), None)
        if note is None or host is None:
            return Outcome.WAIT
        named_one = _Candidate(
            host, note, streak, sorted(r.rank for r in note.ranks if r.rank in slow)
        )
        if outcome is Outcome.LOOK:
            outcome = await self._decide(result, named_one, verdict.median)
        if outcome not in (Outcome.WAIT, Outcome.DONE):
            self._report(result, named_one, outcome)
        return outcome

    async def _decide(
        self, result: RoundResult, named: _Candidate, median: float | None
    ) -> Outcome:
        now = time.time()
        state = await self.rendezvous.replacement_state(named.host, result.round, now)
        outcome = judge_store(state, result.group_world_size, self.sizes)
        if outcome is not Outcome.REPLACE or state is None:
            return outcome
        record = QuarantineRecord(
            named.host, now, now + self.settings.hold, named.reason(median), result.round
        )
        if not await self.rendezvous.claim_replacement(state, record):
            return Outcome.ROUND  # something it read changed: judged again next interval
        self.decided = True
        self.record = record
        if named.host == self.host:  # group rank 0 is the straggler: it leaves itself
            self.departure.request(_leave(record))
        return Outcome.REPLACE

    def _report(self, result: RoundResult, named: _Candidate, outcome: Outcome) -> None:
        key = (named.note.node_id, outcome)
        if key in self.reported:
            return
        self.reported.add(key)
        replaced = outcome is Outcome.REPLACE
        self.events.emit(
            StragglerReplacement(
                round=result.round,
                node=named.host,
                node_id=named.note.node_id,
                ranks=named.ranks,
                intervals=named.streak,
                replaced=replaced,
                why=outcome.value,
                until=self.record.until if replaced and self.record else None,
            )
        )

    # ---------------------------------------------------------- every node
    async def look(self) -> bool:
        """This node's own quarantine record: an active one (group rank 0
        decided to replace it) makes it leave. True when it asked to leave."""
        if not self.enabled or not self.host:
            return False
        rec = await self.rendezvous.quarantine_of(self.host)
        if rec is None or not rec.active(time.time()):
            return False
        self.departure.request(_leave(rec))
        return True


@frozen
class _Candidate:
    """The node named longest in a row: its host (the round's), its note,
    the intervals and its ranks named."""

    host: str
    note: N.ProgressNote
    streak: int
    ranks: list[int]

    def reason(self, median: float | None) -> str:
        """The quarantine record's reason."""
        slow = [r for r in self.note.ranks if r.rank in self.ranks]
        worst = max(slow, key=lambda r: r.own_time or 0.0)
        own = worst.own_time or 0.0
        ratio = f"{own / median:.1f} times the median {median:.3g} s" if median else "slow"
        return (
            f"straggler: rank {worst.rank}'s own step time {own:.3g} s was {ratio} "
            f"for {self.streak} intervals in a row; replaced by a waiting spare"
        )


def _leave(rec: QuarantineRecord) -> Leave:
    until = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rec.until))
    return Leave(
        f"elastrun: this node ({printable(rec.host)}) leaves the job, kept out until {until}: "
        f"{printable(rec.reason, limit=300)}",
        "straggler_replaced",
    )
