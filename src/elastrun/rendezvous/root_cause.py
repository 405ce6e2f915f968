"""The job's root cause across nodes: the first failure, whichever node saw it.

When a worker crashes on one node, the ranks of the other nodes whose
collective it broke fail too, and their agents may see their own failure and
ask for a restart before the crashed node's agent does. Each node whose
workers failed therefore *reports* its failure to the round its restart opened
(round R+1, whoever opened it): :func:`report` adds the node to the round
record's ``reporters`` and keeps, as its ``pending_failure`` (which becomes
the job's ``last_failure`` when the restart is charged) and its ``detail``
(the line every member prints), the first of the failures reported, unless a
later one is stronger evidence (:func:`elastrun.failure.first_failure`: a
rank that failed by itself over one whose collective broke, over a node whose
ranks its agent stopped). The store orders the reports: every write is a
compare-and-set on the round record, retried a bounded number of times; no
wall clocks of different nodes are compared. Only members of round R report,
once each, so the list is bounded by the round's size.

:func:`settle` is what a node that failed waits for before it prints its
failure summary: until the round keeps a failure no later report can replace
(:func:`elastrun.failure.weight` 0: a rank that failed by itself), or every
other member of round R has reported, joined round R+1 (a node joins only
after it reported), or is gone; at most a bounded time. Every node then
adopts the failure the round keeps, its own or another node's: the same on
every node.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

from elastrun.errors import RendezvousError, StoreError
from elastrun.failure import FailureRecord, first_failure, weight
from elastrun.frozen import frozen
from elastrun.rendezvous import keys as K
from elastrun.rendezvous.records import RoundRecord, RoundState
from elastrun.store.base import Get, Store

__all__ = ["REPORT_TIMEOUT", "REPORT_TRIES", "Settled", "report", "settle"]

REPORT_TRIES = 8  # compare-and-set attempts (others write the round record too)
REPORT_TIMEOUT = 5.0  # s: a report that takes longer (a store not answering) is dropped


def _opened_by_failure(rec: RoundRecord, node_id: str, member_round: int) -> bool:
    """Whether ``rec`` is the round that the failure of round ``member_round``
    opened, and ``node_id`` was a member of that round."""
    return (
        rec.round == member_round + 1 and rec.counts and any(p.node_id == node_id for p in rec.prev)
    )


async def report(
    store: Store, keys: K.Keys, node_id: str, member_round: int, failure: FailureRecord
) -> FailureRecord | None:
    """Add ``failure`` (this node's, of round ``member_round``) to the round
    it opened; return the job's root cause as it now stands (None: that round
    is not open any more, or not for a failure: a membership change, whose
    failures are not charged). Raises StoreError."""
    for _ in range(REPORT_TRIES):
        kv = await store.get(keys.round)
        if kv is None:
            return None
        rec = RoundRecord.decode(kv.key, kv.value)
        if not _opened_by_failure(rec, node_id, member_round):
            return None
        if node_id in rec.reporters or rec.state is not RoundState.OPEN:
            return rec.pending_failure
        first = first_failure(rec.pending_failure, failure)
        moved = first is not None and first is not rec.pending_failure
        new = dataclasses.replace(
            rec,
            reporters=(*rec.reporters, node_id),
            pending_failure=first,
            detail=first.describe() if moved and first is not None else rec.detail,
        )
        if await store.compare_and_set(keys.round, kv.mod_revision, new.encode()):
            return first
    return None


@frozen
class Settled:
    """What :func:`settle` found: the job's root cause (None: unknown), and
    the node ids of the round's members that had not reported by the deadline."""

    failure: FailureRecord | None
    awaited: tuple[str, ...] = ()


async def settle(
    store: Store,
    keys: K.Keys,
    node_id: str,
    member_round: int,
    *,
    timeout: float,
) -> Settled:
    """Wait, at most ``timeout`` seconds, until the round opened after round
    ``member_round`` keeps a failure that no later report can replace, or
    every other member of round ``member_round`` reported its failure, joined
    the next round or is gone; return the root cause the round record keeps. Never raises: a store
    error returns what is known. Every request is inside the bound: a store
    that stopped answering (etcd without quorum) costs this wait at most."""
    seen: list[Settled] = [Settled(None)]  # the latest reading, kept on a timeout
    with contextlib.suppress(StoreError, RendezvousError, TimeoutError):
        async with asyncio.timeout(max(0.0, timeout)):
            await _settle(store, keys, node_id, member_round, seen)
    return seen[-1]


async def _settle(
    store: Store, keys: K.Keys, node_id: str, member_round: int, seen: list[Settled]
) -> None:
    """Read until nobody is awaited, appending each reading to ``seen``."""
    while True:
        reads = [
            Get(keys.round),
            Get(keys.joins(member_round + 1), prefix=True),
            Get(keys.nodes, prefix=True),
        ]
        res = await store.txn([], reads)
        rounds, joins, present = res.gets
        if not rounds:
            return
        rec = RoundRecord.decode(rounds[0].key, rounds[0].value)
        if not _opened_by_failure(rec, node_id, member_round):
            return
        done = {node_id, *rec.reporters, *(K.node_id_of(kv.key) for kv in joins)}
        alive = {K.node_id_of(kv.key) for kv in present}
        awaited = [p.node_id for p in rec.prev if p.node_id not in done and p.node_id in alive]
        kept = rec.pending_failure
        seen.append(Settled(kept, tuple(awaited)))
        if not awaited or (kept is not None and weight(kept) == 0):
            return
        watch = await store.watch(keys.root, prefix=True, start_revision=res.revision + 1)
        async with watch:
            async for _event in watch:
                break
