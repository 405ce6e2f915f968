"""Nodes kept out of the job for a node fault: bounded, typed records in the store.

When the verdict rule (:mod:`.verdict`) finds a node fault, the faulty
node's agent writes a :class:`QuarantineRecord` at
``/elastrun/{run_id}/quarantine/{host}`` (the host name made a safe key
component, :func:`elastrun.names.path_component`; the record holds the real
name, and a record whose name is not the one asked for is none) and leaves
the job. A node whose agent starts (or restarts) with a quarantine record
that has not expired is refused before it joins, with a one-line message
saying until when and how to clear it (``elastrun status
--clear-quarantine HOST``). ``elastrun status`` shows the records.

The records live on no lease (they outlive the node that wrote them) and
expire by their ``until``, a wall-clock time (seconds since the epoch) of
the writer's clock: nodes' clocks differ by their skew, which a quarantine
of minutes does not notice. At most :data:`MAX_RECORDS` records are kept:
past that a node is not quarantined (it still leaves the job), so the store
never holds more than that. Every record is read as untrusted: decoded
within :data:`MAX_BYTES`, each field checked; one that fails is no record.

A straggler's replacement (agent/straggler_replacement.py) reuses the record:
group rank 0's agent writes the straggler's record itself, only by
:func:`claim`, one transaction that holds only while the round it judged is
still the job's current, closed round, the host holds no active record, and
the spare it counted still waits (compare-and-set on the three keys' mod
revisions). :func:`claim_state` reads what the decision needs first.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

from elastrun.errors import ProtocolError
from elastrun.fields import Fields
from elastrun.frozen import frozen
from elastrun.names import path_component
from elastrun.rendezvous import keys as K
from elastrun.rendezvous.records import PresenceRecord, RoundRecord, RoundState, WaitingRecord
from elastrun.store.base import Compare, KeyValue, Put, Store
from elastrun.untrusted import UntrustedData, loads

__all__ = [
    "DEFAULT_QUARANTINE",
    "MAX_BYTES",
    "MAX_QUARANTINE",
    "MAX_RECORDS",
    "ClaimState",
    "QuarantineRecord",
    "claim",
    "claim_state",
    "clear",
    "find",
    "host_key",
    "kept_in",
    "listed",
    "put",
    "spares_present",
    "waiting_spares",
]

QUARANTINE_VERSION = 1
DEFAULT_QUARANTINE = 600.0  # s a node stays out after a node fault (--quarantine-time)
MAX_QUARANTINE = 7 * 24 * 3600.0
MAX_RECORDS = 64
MAX_BYTES = 4096
MAX_HOST = 256
MAX_REASON = 1000


@frozen
class QuarantineRecord:
    """``host`` is kept out of the job from ``since`` until ``until`` (wall
    clock), for ``reason`` (the verdict's summary), judged in ``round``."""

    host: str
    since: float
    until: float
    reason: str = ""
    round: int = 0

    def active(self, now: float) -> bool:
        return now < self.until

    def to_json(self) -> dict[str, Any]:
        return {
            "v": QUARANTINE_VERSION,
            "host": self.host,
            "since": self.since,
            "until": self.until,
            "reason": self.reason,
            "round": self.round,
        }

    def encode(self) -> bytes:
        return json.dumps(self.to_json(), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> QuarantineRecord:
        """The record in ``raw``; raises UntrustedData (one line)."""
        obj = loads(raw, max_bytes=MAX_BYTES, what="a quarantine record")
        f = Fields.versioned(obj, QUARANTINE_VERSION, "a quarantine record", UntrustedData)
        since = f.number("since", high=2.0**40)
        return cls(
            host=f.text("host", MAX_HOST),
            since=since,
            until=f.number("until", low=since, high=since + MAX_QUARANTINE),
            reason=f.text("reason", MAX_REASON),
            round=f.integer("round"),
        )


def host_key(host: str) -> str:
    return path_component(host, "unknown-host")


async def listed(store: Store, keys: K.Keys) -> list[QuarantineRecord]:
    """Every quarantine record that reads (at most :data:`MAX_RECORDS`,
    expired ones too), by host. Raises StoreError."""
    kvs, _ = await store.get_prefix(keys.quarantines)
    out: list[QuarantineRecord] = []
    for kv in kvs[:MAX_RECORDS]:
        try:
            rec = QuarantineRecord.decode(kv.value)
        except UntrustedData:
            continue
        if kv.key == keys.quarantine(host_key(rec.host)):
            out.append(rec)
    return sorted(out, key=lambda r: r.host)


async def find(store: Store, keys: K.Keys, host: str) -> QuarantineRecord | None:
    """``host``'s record (expired or not); None when there is none that
    reads. Raises StoreError."""
    kv = await store.get(keys.quarantine(host_key(host)))
    if kv is None:
        return None
    try:
        rec = QuarantineRecord.decode(kv.value)
    except UntrustedData:
        return None
    return rec if rec.host == host else None


async def put(store: Store, keys: K.Keys, record: QuarantineRecord) -> bool:
    """Write ``record`` (replacing the host's); False when :data:`MAX_RECORDS`
    records of other hosts are held already. Raises StoreError."""
    key = keys.quarantine(host_key(record.host))
    kvs, _ = await store.get_prefix(keys.quarantines)
    if len([kv for kv in kvs if kv.key != key]) >= MAX_RECORDS:
        return False
    await store.put(key, record.encode())
    return True


async def clear(store: Store, keys: K.Keys, host: str) -> bool:
    """Remove ``host``'s record; True when there was one. Raises StoreError."""
    return await store.delete(keys.quarantine(host_key(host))) > 0


@frozen
class ClaimState:
    """What a straggler's replacement reads before it decides (see
    :func:`claim_state`): whether round ``round`` is still the job's current,
    closed round (``round_rev``: the ``round`` key's mod revision, 0: it is
    not), the spares that wait (their ``waiting`` keys and mod revisions; a
    node on the straggler's own host is none), the host's record (``held``:
    an active one; ``record_rev``: the key's mod revision, 0: absent), and
    whether the records are full (``full``)."""

    round: int
    round_rev: int
    spares: tuple[tuple[str, int], ...]
    held: QuarantineRecord | None
    record_rev: int
    full: bool

    @property
    def current(self) -> bool:
        return self.round_rev > 0


async def claim_state(store: Store, keys: K.Keys, host: str, round_: int, now: float) -> ClaimState:
    """What :func:`claim` will compare, read (4 reads, each bounded: the
    ``waiting/`` keys are the spares', one per node). Raises StoreError."""
    round_rev = 0
    kv = await store.get(keys.round)
    if kv is not None:
        try:
            rec = RoundRecord.decode(kv.key, kv.value)
        except ProtocolError:
            rec = None
        if rec is not None and rec.round == round_ and rec.state is RoundState.CLOSED:
            round_rev = kv.mod_revision
    spares = await waiting_spares(store, keys, host)
    key = keys.quarantine(host_key(host))
    records, _ = await store.get_prefix(keys.quarantines)
    mine = next((r for r in records if r.key == key), None)
    held = None
    if mine is not None:
        try:
            rec_q = QuarantineRecord.decode(mine.value)
        except UntrustedData:
            rec_q = None
        if rec_q is not None and rec_q.host == host and rec_q.active(now):
            held = rec_q
    full = len([r for r in records if r.key != key]) >= MAX_RECORDS
    return ClaimState(
        round_,
        round_rev,
        spares,
        held,
        0 if mine is None else mine.mod_revision,
        full,
    )


async def waiting_spares(store: Store, keys: K.Keys, host: str) -> tuple[tuple[str, int], ...]:
    """The nodes that wait for a round (their ``waiting`` keys and mod
    revisions), but for those on ``host``: what could take its place (one
    bounded read: a key per node). Raises StoreError."""
    waiting, _ = await store.get_prefix(keys.waiting_prefix)
    return tuple((w.key, w.mod_revision) for w in waiting if _spare(w, host))


async def spares_present(store: Store, keys: K.Keys, host: str, members: Collection[str]) -> int:
    """How many nodes of the job are alive (their presence records) that
    are not ``members`` (node ids: the failed round's) nor on ``host``:
    what could take ``host``'s place, whether it still waits or already
    joined the round its failure opened (one bounded read: a key per node).
    Raises StoreError."""
    kvs, _ = await store.get_prefix(keys.nodes)
    count = 0
    for kv in kvs:
        try:
            rec = PresenceRecord.decode(kv.key, kv.value)
        except ProtocolError:
            continue
        if rec.node.node_id not in members and rec.node.host != host:
            count += 1
    return count


def kept_in(members: int, min_nodes: int, spares: int) -> str | None:
    """Why a node judged faulty is not excluded (None: it leaves): it
    leaves only when the job can go on without it: a spare waits to take
    its place, or the round's ``members`` but it are still at least the
    job's ``min_nodes`` (pure; docs/reliability.md, *What excluding a node
    can cost*)."""
    if spares > 0 or members - 1 >= min_nodes:
        return None
    return f"not excluded: the job would fall below --nnodes min {min_nodes} with no spare"


def _spare(kv: KeyValue, host: str) -> bool:
    try:
        rec = WaitingRecord.decode(kv.key, kv.value)
    except ProtocolError:
        return False
    return rec.host != host


async def claim(store: Store, keys: K.Keys, state: ClaimState, record: QuarantineRecord) -> bool:
    """Write ``record`` (a straggler's) only if nothing ``state`` read has
    changed since: round ``state.round`` still the current closed round, the
    host's record key as it was, the first spare still waiting. True when
    this call wrote it: the one decision. Raises StoreError."""
    if not state.current or not state.spares or state.held is not None or state.full:
        return False
    spare_key, spare_rev = state.spares[0]
    key = keys.quarantine(host_key(record.host))
    result = await store.txn(
        [
            Compare.unchanged(keys.round, state.round_rev),
            Compare.unchanged(key, state.record_rev),
            Compare.unchanged(spare_key, spare_rev),
        ],
        [Put(key, record.encode())],
    )
    return result.succeeded
