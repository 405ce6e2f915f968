"""The dynamic rendezvous' records: one typed value per kind of key.

Each record is a frozen dataclass with ``to_json`` / ``from_json`` (its JSON
object) and ``encode`` / ``decode`` (its bytes in the store, with ``"v": 1``:
:func:`.keys.encode`, :func:`.keys.decode`). The key layout is
:mod:`.keys`; how rounds are built from these records is :mod:`.rounds`::

    config                      ConfigRecord   the agreed settings (AgreedSettings)
    nodes/{node_id}             PresenceRecord (the node: NodeInfo)
    round                       RoundRecord    (its previous members: PrevMember)
    rounds/{R}/join/{node_id}   JoinRecord     (the node: NodeInfo)
    rounds/{R}/result           ResultHeader   (group rank 0: MemberRecord) and
    rounds/{R}/members/{k}      ResultShard    the members in shards (.results),
                                               together a ResultRecord
    rounds/{R}/done/{node_id}   DONE           (an empty record)
    waiting/{node_id}           WaitingRecord

Every record read is untrusted: anyone who reaches the store may have written
it. :meth:`decode` reads it within the bounds (:func:`.keys.decode`), then
``from_json`` checks it, by these rules:

* A field the protocol decides on (round numbers, the state, restarts,
  members and their ranks, node ids, addresses, ports, process counts) must
  hold its type and range, and a field every version wrote must be there;
  else :class:`~elastrun.errors.ProtocolError` names the key and the field.
  A result's members hold the group ranks 0..n-1 in order, each node once;
  a per-node record names the node of its key.
* A field kept for people (``reason``, ``detail``, the wall-clock times,
  ``pid``, the failure records, ``hang_round``) that is absent, null or of
  another type reads as absent (records of other elastrun versions).
* Unknown fields are ignored (a version may add fields); a record this node
  rewrites (the round record) keeps the fields known here.

What a ProtocolError means to the rendezvous depends on the key
(:mod:`.damage`): a per-node key that holds no record is left out; a damaged
record the whole job agrees on is the verdict ``RecordDamaged``.
"""

from __future__ import annotations

import enum
from typing import Any, Self

from elastrun.errors import ProtocolError
from elastrun.failure import FailureRecord
from elastrun.frozen import frozen
from elastrun.rendezvous import keys as K
from elastrun.rendezvous.fields import Fields

__all__ = [
    "DONE",
    "TAKEOVER_REASON",
    "AgreedSettings",
    "ConfigRecord",
    "JoinRecord",
    "MemberRecord",
    "NodeInfo",
    "PresenceRecord",
    "PrevMember",
    "ResultRecord",
    "RoundRecord",
    "RoundState",
    "WaitingRecord",
]

# The exit barrier's done key: an empty record (its presence is what counts).
DONE = K.encode({})


class RoundState(enum.Enum):
    """The job's ``round`` record's ``state``."""

    OPEN = "open"  # round R is forming
    CLOSED = "closed"  # round R's members run (its result is written)
    FINISHED = "finished"  # the job succeeded
    FAILED = "failed"  # the job's restart budget is spent


def _failure_json(record: FailureRecord | None) -> dict[str, Any] | None:
    return None if record is None else record.to_json()


class _Record:
    """What every record has: its JSON object, its bytes in the store."""

    def to_json(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def from_json(cls, raw: object, where: str = "record") -> Self:
        raise NotImplementedError

    def encode(self) -> bytes:
        return K.encode(self.to_json())

    @classmethod
    def decode(cls, key: str, value: bytes) -> Self:
        """The record stored at ``key``; ProtocolError if it is not one."""
        return cls.from_json(K.decode(key, value), f"store key {key}")


class _NodeRecord(_Record):
    """A per-node record: it names the node of its key."""

    def owner(self) -> str:
        """The node the record names."""
        raise NotImplementedError

    @classmethod
    def decode(cls, key: str, value: bytes) -> Self:
        record = super().decode(key, value)
        if record.owner() != K.node_id_of(key):
            raise ProtocolError(f"store key {key}: node_id {record.owner()!r} is not its key's")
        return record


# -- config -------------------------------------------------------------------------
@frozen
class AgreedSettings:
    """The settings every node of a job must share (config agreement); the
    others are per node (see :class:`~.api.RendezvousSettings`). The role is
    per node (nodes of several roles form one world, as under torchrun): the
    ``role`` of older versions' records is ignored."""

    min_nodes: int
    max_nodes: int
    max_restarts: int
    join_timeout: float
    last_call_timeout: float
    # --node-unit; 1 in records of elastrun versions without it.
    node_unit: int = 1
    # The store's candidate hosts (a c10d endpoint list), "" for one endpoint.
    candidates: str = ""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "min_nodes": self.min_nodes,
            "max_nodes": self.max_nodes,
            "max_restarts": self.max_restarts,
            "join_timeout": self.join_timeout,
            "last_call_timeout": self.last_call_timeout,
            "node_unit": self.node_unit,
        }
        if self.candidates:
            out["candidates"] = self.candidates
        return out

    @classmethod
    def from_json(cls, raw: object, where: str = "settings") -> AgreedSettings:
        f = Fields(raw, where)
        return cls(
            min_nodes=f.integer("min_nodes"),
            max_nodes=f.integer("max_nodes"),
            max_restarts=f.integer("max_restarts"),
            join_timeout=f.number("join_timeout"),
            last_call_timeout=f.number("last_call_timeout"),
            node_unit=f.count("node_unit", 1),
            candidates=f.text("candidates", 4096) if "candidates" in f.raw else "",
        )


@frozen
class ConfigRecord(_Record):
    """``config``: the job's agreed settings (created by its first node)."""

    settings: AgreedSettings

    def to_json(self) -> dict[str, Any]:
        return {"settings": self.settings.to_json()}

    @classmethod
    def from_json(cls, raw: object, where: str = "config") -> Self:
        f = Fields(raw, where)
        return cls(AgreedSettings.from_json(f.raw.get("settings"), f"{where}: settings"))


# -- per-node records ---------------------------------------------------------------
def _read_role(f: Fields) -> str:
    """A node's ``role``: it decides role ranks, so a present one must be
    text (within the bounds); absent ("") in records of versions that
    agreed one role per job."""
    return f.text("role") if "role" in f.raw else ""


@frozen
class NodeInfo:
    """A node as it presents itself (its presence and join records)."""

    node_id: str
    host: str  # for people
    addr: str  # where the other nodes and the workers reach it
    nproc: int
    rank_hint: int | None = None  # --node-rank
    pid: int | None = None  # its agent's, for people
    role: str = ""  # --role (its workers' ROLE_NAME); "" in older versions' records

    def to_json(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "host": self.host,
            "addr": self.addr,
            "nproc": self.nproc,
            "rank_hint": self.rank_hint,
            "pid": self.pid,
            "role": self.role,
        }

    @classmethod
    def read(cls, f: Fields) -> NodeInfo:
        return cls(
            node_id=f.node_id(),
            host=f.text("host"),
            addr=f.text("addr"),
            nproc=f.integer("nproc", low=1),
            rank_hint=f.optional_integer("rank_hint"),
            pid=f.maybe_count("pid"),
            role=_read_role(f),
        )


@frozen
class PresenceRecord(_NodeRecord):
    """``nodes/{node_id}``: a node of the job is alive (on its lease)."""

    node: NodeInfo
    since: float | None = None  # wall clock of its registration, for people

    def owner(self) -> str:
        return self.node.node_id

    def to_json(self) -> dict[str, Any]:
        return {**self.node.to_json(), "since": self.since}

    @classmethod
    def from_json(cls, raw: object, where: str = "presence record") -> Self:
        f = Fields(raw, where)
        return cls(NodeInfo.read(f), since=f.wall("since"))


@frozen
class JoinRecord(_NodeRecord):
    """``rounds/{R}/join/{node_id}``: a node joined open round R (on its lease)."""

    node: NodeInfo
    port: int  # a free port on its host: MASTER_PORT if it becomes group rank 0

    def owner(self) -> str:
        return self.node.node_id

    def to_json(self) -> dict[str, Any]:
        return {**self.node.to_json(), "port": self.port}

    @classmethod
    def from_json(cls, raw: object, where: str = "join record") -> Self:
        f = Fields(raw, where)
        return cls(NodeInfo.read(f), port=f.port("port"))


@frozen
class WaitingRecord(_NodeRecord):
    """``waiting/{node_id}``: a node waits for the round after ``round`` (on its lease)."""

    node_id: str
    host: str
    round: int

    def owner(self) -> str:
        return self.node_id

    def to_json(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "host": self.host, "round": self.round}

    @classmethod
    def from_json(cls, raw: object, where: str = "waiting record") -> Self:
        f = Fields(raw, where)
        return cls(node_id=f.node_id(), host=f.text("host"), round=f.integer("round"))


# -- the round and its result ---------------------------------------------------------
@frozen
class PrevMember:
    """A member of the previous closed round: who keeps which group rank."""

    node_id: str
    group_rank: int

    @classmethod
    def from_json(cls, raw: object, where: str) -> PrevMember:
        f = Fields(raw, where)
        return cls(f.node_id(), f.integer("group_rank"))


# The reason of a round opened in a new host's store after a takeover
# (docs/failover.md): it closes at once only when all but one of the previous
# round's members joined (the lost host's node), else at min and last call.
TAKEOVER_REASON = "store_failover"


@frozen
class RoundRecord(_Record):
    """``round``: the job's current round (every write a compare-and-set).

    Every node reads and watches it, so it holds no list of the round's
    members (its result does: :mod:`.results`); ``prev`` is the previous
    round's members only while a round is open."""

    round: int
    state: RoundState
    restarts: int = 0  # restarts used, job-wide
    last_failure: FailureRecord | None = None  # the last charged failure
    # The failure that opened this round, charged when it closes (see
    # rounds.close_records); None for a membership change.
    pending_failure: FailureRecord | None = None
    prev: tuple[PrevMember, ...] = ()  # the previous closed round's members
    reason: str = ""  # why this round was opened
    detail: str = ""  # the same, for people: the line every member prints
    counts: bool = False  # it opened for a worker failure (charged at the close)
    opened_at: float | None = None  # wall clock, for people
    hang_round: int | None = None  # the last round that ended on a declared hang
    # The members of the previous round that reported a worker failure for
    # this round: pending_failure is the first of their failures (see
    # rendezvous/root_cause.py).
    reporters: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "round": self.round,
            "state": self.state.value,
            "restarts": self.restarts,
            "last_failure": _failure_json(self.last_failure),
            "pending_failure": _failure_json(self.pending_failure),
            "prev": [{"node_id": p.node_id, "group_rank": p.group_rank} for p in self.prev],
            "reason": self.reason,
            "detail": self.detail,
            "counts": self.counts,
            "opened_at": self.opened_at,
            "hang_round": self.hang_round,
        }
        if self.reporters:
            out["reporters"] = list(self.reporters)
        return out

    @classmethod
    def from_json(cls, raw: object, where: str = "round record") -> Self:
        f = Fields(raw, where)
        prev = tuple(PrevMember.from_json(p, f"{where}: prev") for p in f.items("prev"))
        reporters = tuple(_node_ids(f.items("reporters"), f, "reporters"))
        return cls(
            round=f.integer("round"),
            state=f.choice("state", RoundState),
            restarts=f.count("restarts", 0),
            last_failure=f.failure("last_failure"),
            pending_failure=f.failure("pending_failure"),
            prev=prev,
            reason=f.note("reason"),
            detail=f.note("detail"),
            counts=f.flag("counts"),
            opened_at=f.wall("opened_at"),
            hang_round=f.maybe_count("hang_round"),
            reporters=reporters,
        )

    @property
    def hung(self) -> bool:
        """The failure that opened this round is a declared hang."""
        return self.pending_failure is not None and bool(self.pending_failure.hang)


def _node_ids(raw: list[object], f: Fields, name: str) -> list[str]:
    out = []
    for value in raw:
        if not isinstance(value, str) or not K.valid_node_id(value):
            raise f.bad(name, "not a list of node ids")
        out.append(value)
    return out


@frozen
class MemberRecord:
    """A member of a closed round, as its result names it."""

    node_id: str
    host: str
    addr: str
    nproc: int
    group_rank: int
    role: str = ""  # its workers' role; "" in older versions' results (one role a job)

    def to_json(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "host": self.host,
            "addr": self.addr,
            "nproc": self.nproc,
            "group_rank": self.group_rank,
            "role": self.role,
        }

    @classmethod
    def from_json(cls, raw: object, where: str) -> MemberRecord:
        f = Fields(raw, where)
        return cls(
            node_id=f.node_id(),
            host=f.text("host"),
            addr=f.text("addr"),
            nproc=f.integer("nproc", low=1),
            group_rank=f.integer("group_rank"),
            role=_read_role(f),
        )


@frozen
class ResultRecord:
    """Round R's whole result: who is in it, with which group rank (decided
    once, with the close). Not a record of its own in the store: it is
    stored as a header and its members in shards (:mod:`.results`), whose
    ``load`` checks them and builds this."""

    round: int
    members: tuple[MemberRecord, ...]  # in group-rank order: 0..n-1
    master_addr: str
    master_port: int
    restarts: int = 0  # restarts used, job-wide, when R closed
    charged: bool = False  # R's close charged the failure that opened it
    reason: str = ""  # why R closed (the decider's rule)
    opened_at: float | None = None  # wall clock, for people
    closed_at: float | None = None

    def member(self, node_id: str) -> MemberRecord | None:
        return next((m for m in self.members if m.node_id == node_id), None)

    @property
    def world_size(self) -> int:
        return sum(m.nproc for m in self.members)
