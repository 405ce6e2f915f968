"""What the agent sees of a rendezvous: settings, a round's result, the handler.

The agent's loop, in terms of this interface::

    rdzv = <a Rendezvous>                     # dynamic (store-backed) or static
    while True:
        result = await rdzv.next_round()      # blocks until this node is a member
        start workers for `result`
        wait for the first of: workers exited, rdzv.wait_for_change()
        all workers ok   -> await rdzv.complete(); exit 0        (exit barrier)
        a worker failed  -> stop workers; await rdzv.request_restart(failure)
                            (raises RestartBudgetExhausted when the job's budget is spent)
        change signalled -> stop workers (membership change: not counted)
    finally: await rdzv.shutdown()            # leave (never closes the job for others)

Before its first ``next_round()`` the agent gives the rendezvous what to call
back, in one explicit call: ``rdzv.attach(RendezvousHooks(progress=...,
notice=..., lease_listener=...))``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from elastrun.errors import RendezvousError, StoreError
from elastrun.failure import FailureRecord
from elastrun.frozen import frozen
from elastrun.names import RunId
from elastrun.rendezvous.fault_history import FaultEntry, FaultHistory, HealthFailure, JudgedFault
from elastrun.rendezvous.notes import Note, NoteT, Refused, Seat
from elastrun.rendezvous.quarantine import ClaimState, QuarantineRecord
from elastrun.rendezvous.ranks import WorkerRanks, worker_ranks
from elastrun.rendezvous.records import AgreedSettings
from elastrun.rendezvous.sizes import WorldSizes
from elastrun.store.base import RevokeSpec

__all__ = [
    "AgreedSettings",
    "Change",
    "GroupShape",
    "LeaseListener",
    "Member",
    "ProgressCallback",
    "Rendezvous",
    "RendezvousHooks",
    "RendezvousSettings",
    "RevokeSpec",
    "RoundResult",
    "WaitingStatus",
    "whole",
]


@frozen
class RendezvousSettings:
    """Settings of one node's rendezvous. The fields of :meth:`agreed` must be
    equal on every node of a job (config agreement); the rest are per node."""

    run_id: RunId
    min_nodes: int
    max_nodes: int
    max_restarts: int = 0
    join_timeout: float = 600.0
    last_call_timeout: float = 30.0
    # Per node: how long leaving (shutdown: revoking the lease) may take; as
    # torch's close timeout. Past it the lease expires by itself within lease_ttl.
    close_timeout: float = 30.0
    lease_ttl: float = 10.0
    exit_barrier_timeout: float = 300.0
    # --node-unit: only world sizes that are multiples of it (nodes beyond the
    # largest allowed size wait as spares); agreed by every node.
    node_unit: int = 1
    # per node:
    role: str = "default"  # its workers' ROLE_NAME; a job's nodes may differ (as torchrun)
    nproc: int = 1
    host: str = ""  # human-readable host name
    addr: str = ""  # address other nodes and workers use to reach this node
    node_rank_hint: int | None = None
    # The store's candidate hosts, as given (agreed: every node the same list).
    candidates: str = ""

    def agreed(self) -> AgreedSettings:
        """The fields every node of the job must agree on (the job's ``config``)."""
        return AgreedSettings(
            min_nodes=self.min_nodes,
            max_nodes=self.max_nodes,
            max_restarts=self.max_restarts,
            join_timeout=self.join_timeout,
            last_call_timeout=self.last_call_timeout,
            node_unit=self.node_unit,
            candidates=self.candidates,
        )

    def sizes(self) -> WorldSizes:
        """The world sizes this job may form (``--nnodes``, ``--node-unit``)."""
        return WorldSizes(self.min_nodes, self.max_nodes, self.node_unit)


@frozen
class Member:
    node_id: str
    host: str
    addr: str
    group_rank: int
    nproc: int
    role: str = ""  # its workers' role ("" in results of versions with one role a job)


@frozen
class GroupShape:
    """The sizes of a round whose result names only this node (see
    :attr:`RoundResult.shape`)."""

    group_world_size: int  # members
    world_size: int  # workers: every member's nproc
    rank_offset: int  # this node's first global rank
    role_rank_offset: int  # this node's first role rank
    role_world_size: int  # the workers of this node's role


@frozen
class RoundResult:
    """The outcome of a closed rendezvous round, as seen by one member.

    ``members`` holds every member, in group-rank order, when ``shape`` is
    None; else only this node (a large round's result is read in shards:
    each node reads its own place) and ``shape`` gives the round's sizes.
    :meth:`Rendezvous.full_result` gives the result with every member."""

    run_id: str
    round: int
    members: tuple[Member, ...]  # ordered by group_rank; only this node's with a shape
    group_rank: int  # this node's
    master_addr: str
    master_port: int
    restart_count: int  # restarts of the job used so far (job-wide)
    max_restarts: int
    reason: str = ""  # why the round closed (dynamic: the decider's rule)
    shape: GroupShape | None = None
    # This round's close charged the worker failure that opened it (restart_count
    # counts it): the restart that ended round ``round - 1``.
    charged: bool = False

    @property
    def complete(self) -> bool:
        """``members`` holds every member."""
        return self.shape is None

    def charges(self, ended: int) -> bool:
        """Whether this round's close charged the restart that ended round
        ``ended`` (this node's last round): the round that restart opened is
        ``ended + 1``, and a round closes charged only with every member of
        the round before back. A later round (this node was not in ``ended +
        1``, a lost member) or one closed uncharged (a node or the store's
        host lost: the failure was collateral) did not."""
        return self.charged and self.round == ended + 1

    @property
    def group_world_size(self) -> int:
        return len(self.members) if self.shape is None else self.shape.group_world_size

    @property
    def world_size(self) -> int:
        """Total workers: the sum of every member's nproc."""
        if self.shape is not None:
            return self.shape.world_size
        return sum(m.nproc for m in self.members)

    @property
    def rank_offset(self) -> int:
        """Global rank of this node's local rank 0 (ranks are contiguous)."""
        if self.shape is not None:
            return self.shape.rank_offset
        return sum(m.nproc for m in self.members if m.group_rank < self.group_rank)

    @property
    def role_rank_offset(self) -> int:
        """Role rank of this node's local rank 0 (:func:`.ranks.worker_ranks`)."""
        if self.shape is not None:
            return self.shape.role_rank_offset
        return self._worker_ranks().role_base

    @property
    def role_world_size(self) -> int:
        """The workers of this node's role, on every member."""
        if self.shape is not None:
            return self.shape.role_world_size
        return self._worker_ranks().role_size

    def _worker_ranks(self) -> WorkerRanks:
        return worker_ranks([(m.role, m.nproc) for m in self.members])[self.group_rank]

    @property
    def me(self) -> Member:
        if self.shape is not None:
            return self.members[0]
        return self.members[self.group_rank]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@frozen
class Change:
    """Why the current round must end (returned by ``wait_for_change``)."""

    reason: str  # "node_waiting" | "member_lost" | "new_round" | "restart_requested" | ...
    detail: str = ""  # human-readable, e.g. "node host-b (10.0.0.2) lost: lease expired"
    counts_as_restart: bool = False
    hang: bool = False  # a hang was declared elsewhere: collect the stacks before stopping
    # Kill the workers at once, no grace: this node gave up its store's host
    # without proof that it is dead, and another group may form (docs/failover.md).
    stop_now: bool = False


@frozen
class WaitingStatus:
    """What ``next_round()`` waits for (reported on each change; the
    ``rendezvous_waiting`` event carries the same fields)."""

    round: int
    state: str  # "joining" (joined the open round) | "waiting" (round closed without me)
    joined: int  # joiners of the open round; for "waiting", members of the closed round
    min_nodes: int
    max_nodes: int
    deadline: str  # "last_call" | "join_timeout": the next deadline that ends the wait
    seconds_left: float  # until that deadline, when reported
    live: bool = True  # joined is live (the decider); else as of this node's last read
    detail: str = ""  # e.g. "round 0 is full (2 of max 2 nodes)"


ProgressCallback = Callable[[WaitingStatus], None]
# Told how another process could revoke this node's lease (the store's
# ``revoke_spec``), or None when it holds none.
LeaseListener = Callable[[RevokeSpec | None], None]


@frozen
class RendezvousHooks:
    """What a rendezvous calls back (each optional), given by :meth:`Rendezvous.attach`."""

    #: Called with what next_round() waits for, on each change.
    progress: ProgressCallback | None = None
    #: Called with a line for the operator, e.g. that this node started a new
    #: job under the id of a job that is over.
    notice: Callable[[str], None] | None = None
    #: Called whenever this node's lease changes, with how another process
    #: could revoke it (None: no lease): the agent's orphan guard revokes it
    #: if the agent is killed, so the others see the node gone at once rather
    #: than at the lease TTL.
    lease_listener: LeaseListener | None = None


class Rendezvous(abc.ABC):
    """One node's handle on the job's rendezvous."""

    settings: RendezvousSettings
    #: The callbacks given by :meth:`attach` (none until then).
    hooks: RendezvousHooks = RendezvousHooks()

    @abc.abstractmethod
    def attach(self, hooks: RendezvousHooks) -> None:
        """Call ``hooks`` from now on (replacing those given before). Given
        before ``next_round()``; a lease already held is reported at once."""

    @abc.abstractmethod
    async def next_round(self) -> RoundResult:
        """Join (or wait for) the next round; return once this node is a
        member of a closed round. Raises RendezvousTimeout, RendezvousClosed
        (job already finished: the caller exits 0), ConfigMismatch,
        RestartBudgetExhausted, StoreError."""

    async def full_result(self, result: RoundResult) -> RoundResult:
        """``result`` with every member (read where it names only this node:
        O(n) bytes, for what needs the whole group)."""
        return result

    @abc.abstractmethod
    async def wait_for_change(self) -> Change:
        """Return when the current round must end: a member was lost, a node
        waits to join (and the world is below max), or another member opened
        a new round. Cancel it when the workers end first."""

    @abc.abstractmethod
    async def request_restart(self, failure: FailureRecord) -> None:
        """This node's workers failed: open a new round (at most once per
        round, whichever node asks first). The restart is charged against the
        job-wide budget when that round closes with every previous member
        back; if a member is gone, the failure was collateral of losing it and
        is not counted. An overspent budget makes ``next_round`` raise
        RestartBudgetExhausted (static rendezvous: raised here). ``failure``
        becomes the job's last failure when charged, and its one-line
        description the new round's detail."""

    async def job_failure(self, failure: FailureRecord, timeout: float) -> FailureRecord:
        """The job's root cause for the restart this node asked for with
        ``failure``: the failure the round keeps, the same on every node (the
        first any member of the round reported, unless a later one is
        stronger evidence: :mod:`elastrun.rendezvous.root_cause`), waiting up
        to ``timeout`` seconds for the other members to report or rejoin.
        ``failure`` when the round keeps none (a rendezvous without a store:
        always). Never raises."""
        del timeout
        return failure

    @abc.abstractmethod
    async def complete(self) -> None:
        """This node's workers all succeeded: the exit barrier. Returns when
        every member of the round completed (or after the exit barrier
        timeout), and marks the job finished."""

    async def find_note(
        self, kind: type[NoteT], round_: int | None = None, seat: Seat | None = None
    ) -> NoteT | Refused | None:
        """The job note ``kind`` (:mod:`elastrun.rendezvous.notes`) of round
        ``round_`` from the member at ``seat``, as :func:`~.notes.parse` reads
        it: None when absent or not decodable within the note limits,
        :class:`~.notes.Refused` (with why) when it fails its schema or its
        check. Never raises."""
        del kind, round_, seat
        return None  # a rendezvous without a store keeps no notes

    async def read_note(
        self, kind: type[NoteT], round_: int | None = None, seat: Seat | None = None
    ) -> NoteT | None:
        """The job note ``kind`` of round ``round_`` from ``seat``, typed and
        checked (:meth:`find_note`); None when there is none that passes.
        Never raises."""
        found = await self.find_note(kind, round_, seat)
        return found if isinstance(found, kind) else None

    async def write_note(self, note: Note) -> None:
        """Leave the job-wide note ``note`` for the other agents (best effort,
        bounded in size; never raises). A kind ``ON_LEASE`` is tied to this
        node's lease, so it vanishes when the node leaves or dies (not written
        while the node holds no lease)."""
        del note  # a rendezvous without a store keeps no notes

    async def gather_notes(
        self, kind: type[NoteT], round_: int, seats: Sequence[Seat], timeout: float
    ) -> dict[int, NoteT | Refused]:
        """The notes ``kind`` of round ``round_`` from the members at ``seats``,
        by group rank, waiting up to ``timeout`` seconds for those not written
        yet (or not decodable yet): each as :meth:`find_note` reads it, those
        absent or not decodable left out. Never raises."""
        del kind, round_, seats, timeout
        return {}

    async def joining_running_job(self) -> bool:
        """True when the job trains without this node right now (its round is
        closed and this node is not a member): joining would restart the
        others' workers; or will train without it (a round opened after the
        job trained, whose other previous members reach the smallest world
        even with one of them gone): joining would hold their restart.
        Asked before ``next_round()``; never raises."""
        return False

    async def record_fault(
        self, entry: FaultEntry, *, own: bool, timeout: float
    ) -> FaultHistory | None:
        """Add ``entry``, the root cause of a failed round, to the job's fault
        history (:mod:`.fault_history`: the first entry for a round stays;
        ``own``: this node's failure is the root cause, written at once, else
        after waiting up to ``timeout`` s for that node's); the history as it
        then stands, the same on every member. None: no history (a
        rendezvous without a store, or a store that did not answer). Never
        raises."""
        del entry, own, timeout
        return None

    async def fault_history(self) -> FaultHistory | None:
        """The job's fault history (None: none kept, or not readable). Never raises."""
        return None

    async def stop_job(self, summary: str) -> None:
        """Stop the job for a script fault: keep ``summary`` in the fault
        history and mark the job failed, so that every node, the spares
        too, ends. Best effort; never raises."""
        del summary

    async def record_verdict(self, verdict: JudgedFault) -> None:
        """Keep ``verdict`` in the fault history for ``elastrun status`` (the
        first of its round stays). Best effort; never raises."""
        del verdict

    async def record_health(self, failure: HealthFailure) -> None:
        """Keep this node's failed health check in the fault history for
        ``elastrun status`` (the last few kept). Best effort; never raises."""
        del failure

    async def spares_for(self, host: str, members: Sequence[str]) -> int | None:
        """How many nodes of the job, alive, not ``members`` (the failed
        round's node ids) and not on ``host``, could take ``host``'s place
        (:func:`.quarantine.spares_present`); None: not known (no store, or
        it did not answer). Never raises."""
        del host, members
        return None

    async def quarantine(self, record: QuarantineRecord) -> bool:
        """Keep ``record.host`` out of the job (:mod:`.quarantine`); False
        when not written (no store, too many records). Never raises."""
        del record
        return False

    async def quarantine_of(self, host: str) -> QuarantineRecord | None:
        """``host``'s quarantine record, expired or not (None: none, or no
        store). Never raises."""
        del host
        return None

    async def replacement_state(self, host: str, round_: int, now: float) -> ClaimState | None:
        """What replacing straggler ``host`` in round ``round_`` depends on
        (:func:`.quarantine.claim_state`; ``now``: wall clock); None: not
        known (no store, or it did not answer). Never raises."""
        del host, round_, now
        return None

    async def claim_replacement(self, state: ClaimState, record: QuarantineRecord) -> bool:
        """Write straggler ``record.host``'s quarantine record only if
        nothing ``state`` read changed (:func:`.quarantine.claim`: one
        compare-and-set); True when this call made the decision. Never raises."""
        del state, record
        return False

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Leave the job (revoke this node's lease). Never closes the job for
        the others. Safe to call more than once."""


async def whole(rendezvous: Rendezvous, result: RoundResult) -> RoundResult:
    """``result`` with every member (:meth:`Rendezvous.full_result`), or as
    it is (:attr:`RoundResult.complete` false) when the store does not answer."""
    try:
        return await rendezvous.full_result(result)
    except (StoreError, RendezvousError):
        return result
