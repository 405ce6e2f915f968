"""A closed round's result as stored: a small header and the members in shards.

A round's result (:class:`~.records.ResultRecord`: every member with its group
rank) is O(n) bytes. Every member needs only its own place in it (its group
rank, its first global rank), the round's sizes and its master; so the closing
txn writes it as (record version :data:`RESULT_VERSION`)::

    rounds/{R}/result          ResultHeader  round, sizes, master, restarts,
                               the shard count, group rank 0's member
    rounds/{R}/members/{k}     ResultShard   the members whose node id hashes
                               to shard k (:func:`shard_of`), each with its
                               group rank, role, first global rank, first
                               role rank and role size

A member reads the header and its own shard, in one txn (:class:`Head`:
O(n / shards) bytes, at most :data:`SHARD_MEMBERS` members on average); the
whole membership (:func:`load`: every shard, checked against the header) is
read only where it is needed: the decider and whoever opens the next round,
the exit barrier's watcher, a running member's loss detection, ``elastrun
status``, the agent's features that need every member.

The shard count is :func:`shard_count` of the job's ``max_nodes`` (an agreed
setting), so a member knows its shard's key before it reads the header; a
header with another count is read again with the right key. Every shard is
written, empty or not: a missing shard is a broken result.

Every record is untrusted: a shard names its round and its index, every member
in it hashes to it, and the union of the shards is the header's members,
group ranks 0..n-1 each once, with first global ranks and role ranks that
add up (:func:`.ranks.worker_ranks`); else
:class:`~elastrun.errors.ProtocolError` names the key and the problem. A key
under the shards' prefix that is none of the header's shards
(``members/{k}``, k in 0..shards-1) is not part of the result: left out
(:func:`decode_result` returns it).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Self

from elastrun.frozen import frozen
from elastrun.rendezvous import keys as K
from elastrun.rendezvous.fields import Fields
from elastrun.rendezvous.ranks import worker_ranks
from elastrun.rendezvous.records import MemberRecord, ResultRecord
from elastrun.store.base import KeyValue

__all__ = [
    "MAX_SHARDS",
    "RESULT_VERSION",
    "SHARD_MEMBERS",
    "Head",
    "ResultHeader",
    "ResultShard",
    "Seat",
    "decode_result",
    "decode_whole",
    "load",
    "shard_count",
    "shard_of",
    "stored_form",
]

# The result's records are version 2 (the other records: 1): an elastrun that
# reads a single-record result says the versions differ, naming the key.
RESULT_VERSION = 2
SHARD_MEMBERS = 64  # members per shard, on average, up to MAX_SHARDS shards
MAX_SHARDS = 64  # with the header and the round record: within etcd's 128 ops a txn


def shard_count(max_nodes: int) -> int:
    """The number of shards of every result of a job of ``max_nodes``."""
    return max(1, min(MAX_SHARDS, -(-max(1, max_nodes) // SHARD_MEMBERS)))


def shard_of(node_id: str, shards: int) -> int:
    """The shard that holds ``node_id``'s place (CRC-32: the same on every host)."""
    return zlib.crc32(node_id.encode()) % shards


@frozen
class Seat:
    """A member and its workers' place (:func:`.ranks.worker_ranks`): its
    first global rank (the sum of the nproc of the members before it in
    group-rank order), its first role rank (the same, over the members of
    its role) and its role's size (0 as read from a shard of an older
    version, which has none: :meth:`ResultShard.decode` makes it the
    header's world size, as every member then had the job's one role)."""

    member: MemberRecord
    rank_base: int
    role_base: int
    role_size: int

    def to_json(self) -> dict[str, Any]:
        return {
            **self.member.to_json(),
            "rank_base": self.rank_base,
            "role_base": self.role_base,
            "role_size": self.role_size,
        }

    @classmethod
    def from_json(cls, raw: object, where: str) -> Seat:
        f = Fields(raw, where)
        base = f.integer("rank_base")
        # Absent from older versions' shards: one role, role ranks = global ranks.
        role_base = f.integer("role_base") if "role_base" in f.raw else base
        role_size = f.integer("role_size", low=1) if "role_size" in f.raw else 0
        return cls(MemberRecord.from_json(raw, where), base, role_base, role_size)


@frozen
class ResultHeader:
    """``rounds/{R}/result``: round R's result without its members."""

    round: int
    size: int  # members (the group world size)
    world_size: int  # workers: every member's nproc
    shards: int
    first: MemberRecord  # group rank 0: the master, the first barrier watcher
    master_addr: str
    master_port: int
    restarts: int = 0
    charged: bool = False
    reason: str = ""
    opened_at: float | None = None
    closed_at: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "size": self.size,
            "world_size": self.world_size,
            "shards": self.shards,
            "first": self.first.to_json(),
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "restarts": self.restarts,
            "charged": self.charged,
            "reason": self.reason,
            "opened_at": self.opened_at,
            "closed_at": self.closed_at,
        }

    @classmethod
    def from_json(cls, raw: object, where: str = "result header") -> Self:
        f = Fields(raw, where)
        first = MemberRecord.from_json(f.raw.get("first"), f"{where}: first")
        size, world = f.integer("size", low=1), f.integer("world_size", low=1)
        if first.group_rank != 0 or world < size:
            raise f.bad("first", "not group rank 0 of the sizes given")
        return cls(
            round=f.integer("round"),
            size=size,
            world_size=world,
            shards=f.integer("shards", low=1, high=MAX_SHARDS),
            first=first,
            master_addr=f.text("master_addr"),
            master_port=f.port("master_port"),
            restarts=f.count("restarts", 0),
            charged=f.flag("charged"),
            reason=f.note("reason"),
            opened_at=f.wall("opened_at"),
            closed_at=f.wall("closed_at"),
        )

    def encode(self) -> bytes:
        return K.encode(self.to_json(), version=RESULT_VERSION)

    @classmethod
    def decode(cls, key: str, value: bytes) -> Self:
        where = f"store key {key}"
        return cls.from_json(K.decode(key, value, version=RESULT_VERSION), where)


@frozen
class ResultShard:
    """``rounds/{R}/members/{k}``: the members of round R in shard ``k``, in
    group-rank order."""

    round: int
    shard: int
    seats: tuple[Seat, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "shard": self.shard,
            "members": [s.to_json() for s in self.seats],
        }

    @classmethod
    def from_json(cls, raw: object, where: str = "result shard") -> Self:
        f = Fields(raw, where)
        seats = tuple(Seat.from_json(m, f"{where}: members") for m in f.items("members"))
        return cls(round=f.integer("round"), shard=f.integer("shard"), seats=seats)

    def encode(self) -> bytes:
        return K.encode(self.to_json(), version=RESULT_VERSION)

    @classmethod
    def decode(cls, key: str, value: bytes, header: ResultHeader) -> Self:
        """The shard at ``key`` of ``header``'s round, each member in it hashing to it."""
        where = f"store key {key}"
        shard = cls.from_json(K.decode(key, value, version=RESULT_VERSION), where)
        f = Fields({}, where)
        if shard.round != header.round or str(shard.shard) != K.node_id_of(key):
            raise f.bad("shard", f"not shard {K.node_id_of(key)} of round {header.round}")
        seats = tuple(
            s if s.role_size else replace(s, role_size=header.world_size) for s in shard.seats
        )
        for s in seats:
            m = s.member
            if shard_of(m.node_id, header.shards) != shard.shard:
                raise f.bad("members", f"naming {m.node_id}, which is not in this shard")
            if m.group_rank >= header.size or s.rank_base + m.nproc > header.world_size:
                raise f.bad("members", f"placing {m.node_id} outside the header's sizes")
            if s.role_base + m.nproc > s.role_size or s.role_size > header.world_size:
                raise f.bad("members", f"placing {m.node_id} outside its role's size")
        return replace(shard, seats=seats)


def stored_form(result: ResultRecord, shards: int) -> tuple[ResultHeader, list[ResultShard]]:
    """``result`` as its header and its ``shards`` shards."""
    placed: list[list[Seat]] = [[] for _ in range(shards)]
    places = worker_ranks([(m.role, m.nproc) for m in result.members])  # group-rank order
    for m, w in zip(result.members, places, strict=True):
        placed[shard_of(m.node_id, shards)].append(Seat(m, w.rank_base, w.role_base, w.role_size))
    header = ResultHeader(
        round=result.round,
        size=len(result.members),
        world_size=result.world_size,
        shards=shards,
        first=result.members[0],
        master_addr=result.master_addr,
        master_port=result.master_port,
        restarts=result.restarts,
        charged=result.charged,
        reason=result.reason,
        opened_at=result.opened_at,
        closed_at=result.closed_at,
    )
    return header, [ResultShard(result.round, k, tuple(s)) for k, s in enumerate(placed)]


def load(header: ResultHeader, shards: Sequence[ResultShard], where: str) -> ResultRecord:
    """The whole result from its header and every shard (each decoded against
    the header): ProtocolError, naming ``where``, if they do not make one."""
    f = Fields({}, where)
    if sorted(s.shard for s in shards) != list(range(header.shards)):
        raise f.bad("shards", f"not the {header.shards} the header names")
    seats = sorted((s for shard in shards for s in shard.seats), key=lambda s: s.member.group_rank)
    members = tuple(s.member for s in seats)
    if [m.group_rank for m in members] != list(range(header.size)):
        raise f.bad("members", f"not group ranks 0..{header.size - 1}, each once")
    if len({m.node_id for m in members}) != len(members):
        raise f.bad("members", "naming a node twice")
    places = worker_ranks([(m.role, m.nproc) for m in members])
    for s, w in zip(seats, places, strict=True):
        if s.rank_base != w.rank_base:
            raise f.bad("members", f"giving {s.member.node_id} first global rank {s.rank_base}")
        if (s.role_base, s.role_size) != (w.role_base, w.role_size):
            raise f.bad("members", f"giving {s.member.node_id} role ranks that do not add up")
    if sum(m.nproc for m in members) != header.world_size or members[0] != header.first:
        raise f.bad("members", "not the header's world size and group rank 0")
    return ResultRecord(
        round=header.round,
        members=members,
        master_addr=header.master_addr,
        master_port=header.master_port,
        restarts=header.restarts,
        charged=header.charged,
        reason=header.reason,
        opened_at=header.opened_at,
        closed_at=header.closed_at,
    )


def decode_whole(header: KeyValue, shards: Sequence[KeyValue]) -> ResultRecord:
    """The whole result stored at ``header`` (its key and bytes) and ``shards``
    (every key under its shards' prefix), decoded and checked."""
    return decode_result(header, shards)[0]


def decode_result(
    header: KeyValue, shards: Sequence[KeyValue]
) -> tuple[ResultRecord, list[KeyValue]]:
    """:func:`decode_whole`, and the keys of ``shards`` left out: those that
    are none of the header's shards (``rounds/{R}/members/{k}``, k in
    0..shards-1, beside ``rounds/{R}/result``)."""
    head = ResultHeader.decode(header.key, header.value)
    prefix = header.key.rsplit("/", 1)[0] + "/members/"
    names = {f"{prefix}{k}" for k in range(head.shards)}
    extra = [kv for kv in shards if kv.key not in names]
    parts = [ResultShard.decode(kv.key, kv.value, head) for kv in shards if kv.key in names]
    return load(head, parts, f"store key {header.key}"), extra


@frozen
class Head:
    """What a node reads of a closed round: the header and its own place
    (None: it is not a member)."""

    header: ResultHeader
    mine: Seat | None

    @classmethod
    def of(cls, result: ResultRecord, node_id: str, shards: int) -> Head:
        """The head of a whole result (this node closed the round, or read it all)."""
        header, parts = stored_form(result, shards)
        mine = next(
            (s for s in parts[shard_of(node_id, shards)].seats if s.member.node_id == node_id),
            None,
        )
        return cls(header, mine)

    @classmethod
    def find(cls, header: ResultHeader, shard: ResultShard, node_id: str) -> Head:
        return cls(header, next((s for s in shard.seats if s.member.node_id == node_id), None))
