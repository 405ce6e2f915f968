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
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from elastrun.fields import Fields
from elastrun.names import path_component
from elastrun.rendezvous import keys as K
from elastrun.store.base import Store
from elastrun.untrusted import UntrustedData, loads

__all__ = [
    "DEFAULT_QUARANTINE",
    "MAX_BYTES",
    "MAX_QUARANTINE",
    "MAX_RECORDS",
    "QuarantineRecord",
    "clear",
    "find",
    "host_key",
    "listed",
    "put",
]

QUARANTINE_VERSION = 1
DEFAULT_QUARANTINE = 1800.0  # s a node stays out after a node fault
MAX_QUARANTINE = 7 * 24 * 3600.0
MAX_RECORDS = 64
MAX_BYTES = 4096
MAX_HOST = 256
MAX_REASON = 1000


@dataclass(frozen=True)
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
