"""The dynamic rendezvous' key layout and its JSON records (schema ``v``: 1).

Everything of one job lives under ``/elastrun/{run_id}/`` (see
docs/rendezvous.md)::

    config                      agreed settings (created by the first node)
    nodes/{node_id}             presence, on the node's lease
    round                       the job's current round record
    rounds/{R}/join/{node_id}   joiners of round R, on the lease
    rounds/{R}/result           round R's result header (written with the close)
    rounds/{R}/members/{k}      its members, in shards (see :mod:`.results`)
    rounds/{R}/done/{node_id}   exit barrier of round R (no lease): each member
                                counts them after its own (O(1) bytes); only
                                the barrier's watcher reads and watches them
                                (and the member whose count reaches the
                                round's size reads them: are they members'?)
    waiting/{node_id}           nodes waiting for the next round, on the lease
    notes/{name}                job notes the agents share (typed, bounded and
                                untrusted: see :mod:`elastrun.rendezvous.notes`)
    faults                      the job's root causes, one per failed round
                                (:mod:`elastrun.rendezvous.fault_history`)
    quarantine/{host}           nodes kept out of the job for a node fault, no
                                lease (:mod:`elastrun.rendezvous.quarantine`)

The exit barrier's "round R finished" record is ``round`` itself (``state``
finished): the one key every member at the barrier watches, besides the
barrier watcher's ``nodes/{node_id}`` (see :mod:`elastrun.rendezvous.rules`).

Records are JSON objects with ``"v": 1`` (:func:`encode`); a record that does
not decode (not JSON, larger than ``RECORD_MAX_BYTES`` or nested deeper than
:data:`~elastrun.untrusted.MAX_DEPTH` levels: anyone who reaches the store may
have written it) raises :class:`~elastrun.errors.ProtocolError` naming the key
(:func:`decode`). What each record holds, typed and checked, is
:mod:`elastrun.rendezvous.records`.

Keys are built only from checked parts: the job id is a
:class:`~elastrun.names.RunId` (parsed where it entered: it matches the job-id
grammar, with no ``/``, so no id names a part of another job's key space) and
node ids are the rendezvous' own (``NODE_ID``: ``[A-Za-z0-9._-]``, at most 128
characters).

Decoding once: the same key and the same bytes give the value decoded before
(:class:`Memo`, :class:`KeysMemo`). Every node decodes the round record and
its round's result; where many nodes share one process (the simulated agents
of bench/rdzv_bench.py) each is decoded once, not once per node. Decoding is a
function of the keys and the bytes and the values decoded are immutable, so
reusing one changes nothing; a value that does not decode raises every time.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Generic, TypeVar

from elastrun.errors import ProtocolError
from elastrun.fields import Fields
from elastrun.frozen import frozen
from elastrun.names import RunId
from elastrun.store.base import KeyValue
from elastrun.untrusted import UntrustedData, loads

__all__ = [
    "NODE_ID",
    "RECORD_VERSION",
    "Keys",
    "KeysMemo",
    "Memo",
    "decode",
    "encode",
    "node_id_of",
    "valid_node_id",
]

RECORD_VERSION = 1
RECORD_MAX_BYTES = 4 * 1024 * 1024  # above any value a store holds (the embedded one: 1.5 MiB)
# A node id: what the rendezvous makes of a host name, a pid and a random
# suffix; never a "/" (it is the last part of a per-node key).
NODE_ID = re.compile(r"[A-Za-z0-9._-]{1,128}\Z")


@frozen
class Keys:
    run_id: RunId

    @property
    def root(self) -> str:
        return f"/elastrun/{self.run_id}/"

    @property
    def config(self) -> str:
        return self.root + "config"

    @property
    def round(self) -> str:
        return self.root + "round"

    @property
    def nodes(self) -> str:
        return self.root + "nodes/"

    def node(self, node_id: str) -> str:
        return self.nodes + node_id

    @property
    def waiting_prefix(self) -> str:
        return self.root + "waiting/"

    def waiting(self, node_id: str) -> str:
        return self.waiting_prefix + node_id

    def left(self, node_id: str) -> str:
        """Put by a node that leaves the job on purpose (its agent stops),
        just before it revokes its lease: the others then say it left, not
        that it was lost."""
        return self.root + "left/" + node_id

    def round_prefix(self, r: int) -> str:
        return f"{self.root}rounds/{r}/"

    def joins(self, r: int) -> str:
        return self.round_prefix(r) + "join/"

    def join(self, r: int, node_id: str) -> str:
        return self.joins(r) + node_id

    def result(self, r: int) -> str:
        return self.round_prefix(r) + "result"

    def shards(self, r: int) -> str:
        """The prefix of round ``r``'s member shards (:mod:`.results`)."""
        return self.round_prefix(r) + "members/"

    def shard(self, r: int, k: int) -> str:
        return f"{self.shards(r)}{k}"

    def dones(self, r: int) -> str:
        return self.round_prefix(r) + "done/"

    def done(self, r: int, node_id: str) -> str:
        return self.dones(r) + node_id

    @property
    def faults(self) -> str:
        return self.root + "faults"

    @property
    def quarantines(self) -> str:
        return self.root + "quarantine/"

    def quarantine(self, host_key: str) -> str:
        return self.quarantines + host_key

    def note(self, name: str) -> str:
        """A job-wide note the agents share (e.g. the modules the script imports)."""
        return self.root + "notes/" + name


def node_id_of(key: str) -> str:
    """The last path component of a per-node key."""
    return key.rsplit("/", 1)[-1]


def valid_node_id(text: str) -> bool:
    return NODE_ID.match(text) is not None


def encode(record: Mapping[str, object], version: int = RECORD_VERSION) -> bytes:
    """A record's JSON object (see :mod:`.records`) as stored, with ``"v"``."""
    return json.dumps({"v": version, **record}, sort_keys=True).encode()


def decode(key: str, value: bytes, version: int = RECORD_VERSION) -> Mapping[str, object]:
    """The JSON object stored at ``key``, within the bounds and of record
    ``version``; raises ProtocolError naming the key."""
    try:
        obj = loads(value, max_bytes=RECORD_MAX_BYTES, what=f"store key {key}")
    except UntrustedData as exc:  # not JSON, too large, or nested too deep
        raise ProtocolError(str(exc)) from None
    where, hint = f"store key {key}", "are all nodes on the same elastrun version?"
    return Fields.versioned(
        obj, version, where, ProtocolError, what="record version", hint=hint
    ).raw


# -- decoding once --------------------------------------------------------------
R = TypeVar("R")
T = TypeVar("T")


class Memo(Generic[R]):
    """``decode(key, value)``, reused for the same key and the same bytes.
    Holds the last ``size`` keys' values."""

    def __init__(self, decode: Callable[[str, bytes], R], size: int = 8) -> None:
        self._decode = decode
        self._size = size
        self._last: dict[str, tuple[bytes, R]] = {}

    def __call__(self, key: str, value: bytes) -> R:
        found = self._last.get(key)
        if found is not None and found[0] == value:
            return found[1]
        decoded = self._decode(key, value)
        self._last.pop(key, None)
        if len(self._last) >= self._size:
            del self._last[next(iter(self._last))]
        self._last[key] = (value, decoded)
        return decoded


class KeysMemo(Generic[T]):
    """``decode(kvs)`` of several keys read together, reused for the same
    keys and bytes (as :class:`Memo` for one key): the last ``size``."""

    def __init__(self, decode: Callable[[tuple[KeyValue, ...]], T], size: int = 8) -> None:
        self._decode = decode
        self._size = size
        self._last: dict[tuple[str, ...], tuple[tuple[bytes, ...], T]] = {}

    def __call__(self, kvs: tuple[KeyValue, ...]) -> T:
        keys, values = tuple(kv.key for kv in kvs), tuple(kv.value for kv in kvs)
        found = self._last.get(keys)
        if found is not None and found[0] == values:
            return found[1]
        decoded = self._decode(kvs)
        self._last.pop(keys, None)
        if len(self._last) >= self._size:
            del self._last[next(iter(self._last))]
        self._last[keys] = (values, decoded)
        return decoded
