"""Job notes: what the agents share beside the rendezvous records, typed and bounded.

A note is a JSON object (``"v": 1``) at ``/elastrun/{run_id}/notes/{name}``
(see docs/rendezvous.md). Anything that reaches the store can write one, so
every note read is untrusted: it is decoded within the note limit and
:data:`~elastrun.untrusted.MAX_DEPTH` levels, then checked
against its schema here (types, lengths, counts: :class:`NoteInvalid` names
the first problem), and finally matched against the round records: a note
counts only when it is about a round the records name and comes from that
round's member at its group rank (:class:`Seat`). The schemas:

``progress_{G}``  :class:`ProgressNote`, group rank G's step times, replaced
                  every few seconds, on the node's lease (agent/stragglers.py)
``stragglers``    :class:`StragglersNote`, the verdicts of group rank 0's agent
                  for the round, on its lease (agent/stragglers.py)
``goodput``       :class:`GoodputNote`, group rank 0's agent's goodput figures,
                  replaced every few seconds, on its lease (agent/goodput.py)
``stacks_{R}_{G}``  :class:`StacksNote`, group rank G's ranks' stacks when round
                  R ended on a hang (agent/hangs.py); all deleted when the next
                  hang's round opens
``modules``       :class:`ModuleReport`, the modules the script imports, as
                  group rank 0's agent learnt them (agent/modlearn.py)
``replica_{G}``   :class:`ReplicaNote`, the TCP port on which group rank G's
                  agent takes its neighbour's memory checkpoints in round R,
                  on its lease (agent/replica.py)
``refused``       :class:`RefusalNote`, the last node refused for settings
                  that differ from the job's (config mismatch), written by
                  that node as it exits, so that the waiting nodes say why it
                  never joined (agent/refusals.py)

Each schema is a :class:`Note`: it names its key (:meth:`Note.name_for`, from
the round and the member's :class:`Seat`), says whether it lives on its
writer's lease (``ON_LEASE``), and has ``to_json``, a strict ``from_json``
(raising :class:`NoteInvalid` for anything a writer of this version would
not have written) and :meth:`Note.check`. :func:`parse` is the one typed read
of a note's bytes, which the rendezvous (``read_note``, ``gather_notes``) and
``elastrun status`` both use: a note that does not decode within the bounds
is no note (None); one that decodes but fails its schema or its check is
:class:`Refused` (with why), and never reaches a caller as data.
"""

from __future__ import annotations

import abc
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, Self, TypeVar

from elastrun.fields import Fields
from elastrun.frozen import frozen
from elastrun.goodput import Goodput
from elastrun.untrusted import UntrustedData, loads
from elastrun.worker import _modnames

__all__ = [
    "GOODPUT",
    "MAX_FRAMES",
    "MAX_MODULES",
    "MAX_RANKS",
    "MAX_TEXT",
    "NOTE_MAX_BYTES",
    "SLOW_RATIO",
    "STACKS_PREFIX",
    "STRAGGLERS",
    "GoodputNote",
    "ModuleReport",
    "Note",
    "NoteInvalid",
    "NoteT",
    "ProgressNote",
    "RankProgress",
    "RankStack",
    "RefusalNote",
    "Refused",
    "ReplicaNote",
    "Seat",
    "StacksNote",
    "Straggler",
    "StragglersNote",
    "encode",
    "parse",
    "progress_name",
    "replica_name",
    "seats",
    "stacks_budget",
    "stacks_name",
    "valid_name",
]

NOTE_VERSION = 1
NOTE_MAX_BYTES = 256 * 1024  # one note, as written and as read
NAME = re.compile(r"[a-z][a-z0-9_]{0,31}\Z")
NODE_ID = re.compile(r"[A-Za-z0-9._-]{1,128}\Z")

STRAGGLERS = "stragglers"
GOODPUT = "goodput"
MODULES = "modules"
REFUSED = "refused"
MAX_MESSAGE = 2000  # a refusal's message (the settings that differ, named)
STACKS_PREFIX = "stacks_"
MAX_RANKS = 4096  # ranks of one node in a note
MAX_FRAMES = 30  # frames of one rank's stack
MAX_TEXT = 300  # a frame, a host name
MAX_PHASE = 64
MAX_STRAGGLERS = 256  # ranks named in the stragglers note
MAX_COUNT = 2**53  # steps and ranks: what a JSON number holds exactly
MAX_SECONDS = 1e12  # a duration or a wall-clock time
# The stacks notes of one hang, all nodes together: each node's note gets an
# equal share (within the per-node bounds), cut to the top frames beyond it.
STACKS_TOTAL_BYTES = 1024 * 1024
STACKS_NODE_MIN = 4 * 1024
STACKS_NODE_MAX = 128 * 1024
# A rank slower than the median of all ranks by more than this is slow (the
# straggler rule's ratio: agent/stragglers.py; status checks a flag with it).
SLOW_RATIO = 1.2
# The modules note: the names' rule and bounds are those of every module list
# (worker/_modnames.py); a Python or torch version as recorded ("3.11.7",
# "2.13.0+cpu").
MAX_MODULES = _modnames.MAX_MODULES
VERSION_RE = re.compile(r"[0-9A-Za-z.+_-]{1,64}\Z")


class NoteInvalid(UntrustedData):
    """A note that does not match its schema."""


def valid_name(name: str) -> bool:
    return NAME.match(name) is not None


def progress_name(group_rank: int) -> str:
    return f"progress_{group_rank}"


def replica_name(group_rank: int) -> str:
    return f"replica_{group_rank}"


def stacks_name(round_: int, group_rank: int) -> str:
    return f"{STACKS_PREFIX}{round_}_{group_rank}"


def stacks_budget(members: int) -> int:
    """Bytes one node's stacks note may take when ``members`` nodes share a hang."""
    share = STACKS_TOTAL_BYTES // max(1, members)
    return max(STACKS_NODE_MIN, min(STACKS_NODE_MAX, share))


def encode(value: Mapping[str, Any]) -> bytes:
    return json.dumps({**value, "v": NOTE_VERSION}, sort_keys=True).encode()


def _decode(name: str, raw: bytes) -> Mapping[str, Any]:
    """A note's JSON object, decoded within the bounds; raises UntrustedData
    (NoteInvalid when it is not a note of this version). Only :func:`parse`
    uses it: no reader sees a note's JSON."""
    obj = loads(raw, max_bytes=NOTE_MAX_BYTES, what=f"note {name}")
    return Fields.versioned(obj, NOTE_VERSION, f"note {name}", NoteInvalid).raw


def checked_version(value: object) -> str | None:
    """A recorded Python or torch version, or None when ``value`` is not one."""
    return value if isinstance(value, str) and VERSION_RE.match(value) else None


# -- field checks: each raises NoteInvalid naming the note and the field -----------
def _fields(raw: object, what: str) -> Fields:
    return Fields(raw, what, NoteInvalid)


def _node_id(f: Fields) -> str:
    value = f.text("node_id", MAX_TEXT)
    if not NODE_ID.match(value):
        raise f.bad("node_id", "not a node id")
    return value


def _unique(ranks: Iterable[int]) -> None:
    seen: set[int] = set()
    for r in ranks:
        if r in seen:
            raise NoteInvalid(f"rank {r} is listed twice")
        seen.add(r)


# -- the round's members, as the records name them -------------------------------
@frozen
class Seat:
    """A member of a round, from the round's result record: its node id,
    group rank and global ranks (contiguous, in group rank order)."""

    node_id: str
    group_rank: int
    first_rank: int
    nproc: int

    def holds(self, rank: int) -> bool:
        return self.first_rank <= rank < self.first_rank + self.nproc


def seats(members: Iterable[tuple[str, int, int]]) -> dict[int, Seat]:
    """Group rank -> seat, from each member's (node id, group rank, nproc)."""
    out: dict[int, Seat] = {}
    first = 0
    for node_id, group_rank, nproc in sorted(members, key=lambda m: m[1]):
        out[group_rank] = Seat(node_id, group_rank, first, nproc)
        first += nproc
    return out


def _check_seat(what: str, node_id: str, group_rank: int, ranks: Iterable[int], seat: Seat) -> None:
    if group_rank != seat.group_rank or node_id != seat.node_id:
        raise NoteInvalid(
            f"{what} is from {node_id} at group rank {group_rank}, not from the round's "
            f"member {seat.node_id} at group rank {seat.group_rank}"
        )
    for r in ranks:
        if not seat.holds(r):
            raise NoteInvalid(f"{what} names rank {r}, not one of that member's ranks")


def _member(what: str, round_: int | None, seat: Seat | None) -> tuple[int, Seat]:
    """The round and the seat a note about a round's member is read for."""
    if round_ is None or seat is None:
        raise TypeError(f"a {what} is read for a round and a member's seat")
    return round_, seat


def _of_round(what: str, round_: int | None, found: int) -> None:
    if round_ is None:
        raise TypeError(f"a {what} is read for a round")
    if found != round_:
        raise NoteInvalid(f"{what} of round {found}, not of round {round_}")


# -- the schema every note follows --------------------------------------------------
class Note(abc.ABC):
    """A job note's schema: where it is (:meth:`name_for`, :attr:`name`),
    whether it lives on its writer's lease (``ON_LEASE``: gone when that node
    leaves or dies), its JSON (``to_json``; ``from_json`` raises
    :class:`NoteInvalid`) and its :meth:`check` against what the reader
    expects (the round, the member at that seat)."""

    ON_LEASE: ClassVar[bool] = False

    @classmethod
    @abc.abstractmethod
    def name_for(cls, round_: int | None, seat: Seat | None) -> str:
        """The note's name for round ``round_`` and the member at ``seat``
        (TypeError when the kind needs one that is not given)."""

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """Its name, as written."""

    @abc.abstractmethod
    def to_json(self) -> dict[str, Any]: ...

    @classmethod
    @abc.abstractmethod
    def from_json(cls, raw: object) -> Self: ...

    def check(self, round_: int | None, seat: Seat | None) -> Self:
        """Itself, when it is what a reader of round ``round_`` expects from
        ``seat``; raises NoteInvalid otherwise."""
        del round_, seat
        return self


NoteT = TypeVar("NoteT", bound=Note)


@frozen
class Refused:
    """A note that decoded within the bounds but is not what its reader
    expects (its schema, its round, its member): why, in one line."""

    name: str
    why: str


def parse(
    kind: type[NoteT], raw: bytes, round_: int | None = None, seat: Seat | None = None
) -> NoteT | Refused | None:
    """The one typed read of a note's bytes: a ``kind`` of round ``round_``
    from ``seat``; None when ``raw`` does not decode within the bounds (no
    note at all); :class:`Refused` when it fails the schema or the check."""
    name = kind.name_for(round_, seat)
    try:
        obj = _decode(name, raw)
    except UntrustedData:
        return None
    try:
        return kind.from_json(obj).check(round_, seat)
    except UntrustedData as exc:
        return Refused(name, str(exc))


# -- stacks ------------------------------------------------------------------------
@frozen
class RankStack:
    """One rank's main-thread stack when a hang was declared."""

    rank: int
    host: str
    frames: tuple[str, ...]  # "func (file:line)", most recent first
    in_torch: bool
    hung: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "host": self.host,
            "frames": list(self.frames),
            "in_torch": self.in_torch,
            "hung": self.hung,
        }

    @classmethod
    def from_json(cls, raw: object) -> RankStack:
        obj = _fields(raw, "a rank's stack")
        frames = obj.items("frames", MAX_FRAMES, required=True)
        if not all(isinstance(f, str) and len(f) <= MAX_TEXT for f in frames):
            raise NoteInvalid(f"a frame is not a string of at most {MAX_TEXT} characters")
        return cls(
            rank=obj.integer("rank"),
            host=obj.text("host", MAX_TEXT),
            frames=tuple(frames),
            in_torch=obj.flag("in_torch"),
            hung=obj.flag("hung"),
        )


@frozen
class StacksNote(Note):
    """``stacks_{round}_{group_rank}``: a node's ranks' stacks at a hang."""

    round: int
    group_rank: int
    node_id: str
    ranks: tuple[RankStack, ...]

    @classmethod
    def name_for(cls, round_: int | None, seat: Seat | None) -> str:
        r, at = _member("stacks note", round_, seat)
        return stacks_name(r, at.group_rank)

    @property
    def name(self) -> str:
        return stacks_name(self.round, self.group_rank)

    def to_json(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "group_rank": self.group_rank,
            "node_id": self.node_id,
            "ranks": [r.to_json() for r in self.ranks],
        }

    @classmethod
    def from_json(cls, raw: object) -> StacksNote:
        obj = _fields(raw, "a stacks note")
        ranks = tuple(RankStack.from_json(r) for r in obj.items("ranks", MAX_RANKS, required=True))
        _unique(r.rank for r in ranks)
        return cls(
            round=obj.integer("round"),
            group_rank=obj.integer("group_rank"),
            node_id=_node_id(obj),
            ranks=ranks,
        )

    def check(self, round_: int | None, seat: Seat | None) -> StacksNote:
        """Itself, when it is about round ``round_`` and from ``seat``."""
        r, at = _member("stacks note", round_, seat)
        _of_round("stacks note", r, self.round)
        _check_seat("stacks note", self.node_id, self.group_rank, (x.rank for x in self.ranks), at)
        return self


# -- progress -------------------------------------------------------------------------
@frozen
class RankProgress:
    """One rank's last progress (from its heartbeat file)."""

    rank: int
    step: int | None = None
    steps: int | None = None
    step_time: float | None = None  # median of its recent optimizer step intervals (s)
    own_time: float | None = None  # the same outside backward passes (s)
    idle_s: float | None = None  # since its last progress
    phase: str | None = None  # a long phase it is in ("checkpoint")
    pid: int | None = None  # its process
    kept: bool | None = None  # its process was kept from an earlier round (in-process restart)
    # step is the script's own number (heartbeat(step)); False: this process's
    # optimizer steps; None: not said (an older agent)
    reported: bool | None = None
    standby: bool | None = None  # its process was a standby's (set up before it had a rank)

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "step": self.step,
            "reported": self.reported,
            "steps": self.steps,
            "step_time": self.step_time,
            "own_time": self.own_time,
            "idle_s": self.idle_s,
            "phase": self.phase,
            "pid": self.pid,
            "kept": self.kept,
            "standby": self.standby,
        }

    @classmethod
    def from_json(cls, raw: object) -> RankProgress:
        obj = _fields(raw, "a rank's progress")
        return cls(
            rank=obj.integer("rank"),
            step=obj.optional_integer("step"),
            steps=obj.optional_integer("steps"),
            step_time=obj.optional_number("step_time", high=MAX_SECONDS),
            own_time=obj.optional_number("own_time", high=MAX_SECONDS),
            idle_s=obj.optional_number("idle_s", high=MAX_SECONDS),
            phase=obj.optional_text("phase", MAX_PHASE),
            pid=obj.optional_integer("pid"),
            kept=None if obj.absent("kept") else obj.flag("kept"),
            reported=None if obj.absent("reported") else obj.flag("reported"),
            standby=None if obj.absent("standby") else obj.flag("standby"),
        )


@frozen
class ProgressNote(Note):
    """``progress_{group_rank}``: a node's ranks' step times in a round."""

    ON_LEASE: ClassVar[bool] = True

    round: int
    group_rank: int
    node_id: str
    host: str
    at: float  # wall clock of the report
    ranks: tuple[RankProgress, ...]

    @classmethod
    def name_for(cls, round_: int | None, seat: Seat | None) -> str:
        return progress_name(_member("progress note", round_, seat)[1].group_rank)

    @property
    def name(self) -> str:
        return progress_name(self.group_rank)

    def to_json(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "group_rank": self.group_rank,
            "node_id": self.node_id,
            "host": self.host,
            "at": self.at,
            "ranks": [r.to_json() for r in self.ranks],
        }

    @classmethod
    def from_json(cls, raw: object) -> ProgressNote:
        obj = _fields(raw, "a progress note")
        ranks = tuple(
            RankProgress.from_json(r) for r in obj.items("ranks", MAX_RANKS, required=True)
        )
        _unique(r.rank for r in ranks)
        return cls(
            round=obj.integer("round"),
            group_rank=obj.integer("group_rank"),
            node_id=_node_id(obj),
            host=obj.text("host", MAX_TEXT),
            at=obj.number("at", high=MAX_SECONDS),
            ranks=ranks,
        )

    def check(self, round_: int | None, seat: Seat | None) -> ProgressNote:
        """Itself, when it is about round ``round_`` and from ``seat``."""
        r, at = _member("progress note", round_, seat)
        _of_round("progress note", r, self.round)
        _check_seat(
            "progress note", self.node_id, self.group_rank, (x.rank for x in self.ranks), at
        )
        return self


@frozen
class Straggler:
    rank: int
    own_time: float  # its step time outside backward passes (s)

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "own_time": self.own_time}

    @classmethod
    def from_json(cls, raw: object) -> Straggler:
        obj = _fields(raw, "a straggler")
        return cls(rank=obj.integer("rank"), own_time=obj.number("own_time", high=MAX_SECONDS))


@frozen
class StragglersNote(Note):
    """``stragglers``: the ranks of a round that group rank 0's agent judged
    persistently slower than the median (at most ``MAX_STRAGGLERS``). Read
    for a round (no seat: the note names no writer)."""

    ON_LEASE: ClassVar[bool] = True

    round: int
    at: float
    median: float | None  # the median own time of all ranks (s)
    stragglers: tuple[Straggler, ...]

    @classmethod
    def name_for(cls, round_: int | None, seat: Seat | None) -> str:
        return STRAGGLERS

    @property
    def name(self) -> str:
        return STRAGGLERS

    def to_json(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "at": self.at,
            "median": self.median,
            "stragglers": [s.to_json() for s in self.stragglers[:MAX_STRAGGLERS]],
        }

    @classmethod
    def from_json(cls, raw: object) -> StragglersNote:
        obj = _fields(raw, "a stragglers note")
        found = tuple(
            Straggler.from_json(s) for s in obj.items("stragglers", MAX_STRAGGLERS, required=True)
        )
        _unique(s.rank for s in found)
        return cls(
            round=obj.integer("round"),
            at=obj.number("at", high=MAX_SECONDS),
            median=obj.optional_number("median", high=MAX_SECONDS),
            stragglers=found,
        )

    def check(self, round_: int | None, seat: Seat | None) -> StragglersNote:
        """Itself, when it is the verdict of round ``round_``."""
        _of_round("stragglers note", round_, self.round)
        return self


# -- goodput ------------------------------------------------------------------------
@frozen
class GoodputNote(Note):
    """``goodput``: the goodput figures of group rank 0's agent (its ledger
    goes on across rounds). Read for a round: a note of that round or an
    earlier one (while a round forms, the last one's figures stand)."""

    ON_LEASE: ClassVar[bool] = True

    round: int
    at: float  # wall clock of the figures
    figures: Goodput

    @classmethod
    def name_for(cls, round_: int | None, seat: Seat | None) -> str:
        return GOODPUT

    @property
    def name(self) -> str:
        return GOODPUT

    def to_json(self) -> dict[str, Any]:
        return {"round": self.round, "at": self.at, "figures": self.figures.to_json()}

    @classmethod
    def from_json(cls, raw: object) -> GoodputNote:
        obj = _fields(raw, "a goodput note")
        return cls(
            round=obj.integer("round"),
            at=obj.number("at", high=MAX_SECONDS),
            figures=Goodput.from_json(obj.raw.get("figures"), NoteInvalid),
        )

    def check(self, round_: int | None, seat: Seat | None) -> GoodputNote:
        """Itself, when it is of round ``round_`` or an earlier one."""
        if round_ is None:
            raise TypeError("a goodput note is read for a round")
        if self.round > round_:
            raise NoteInvalid(f"goodput note of round {self.round}, after round {round_}")
        return self


# -- memory checkpoint replicas -----------------------------------------------------
@frozen
class ReplicaNote(Note):
    """``replica_{group_rank}``: where a node's agent takes the memory
    checkpoints of the node before it (the port on the member's address)."""

    ON_LEASE: ClassVar[bool] = True

    round: int
    group_rank: int
    node_id: str
    port: int

    @classmethod
    def name_for(cls, round_: int | None, seat: Seat | None) -> str:
        return replica_name(_member("replica note", round_, seat)[1].group_rank)

    @property
    def name(self) -> str:
        return replica_name(self.group_rank)

    def to_json(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "group_rank": self.group_rank,
            "node_id": self.node_id,
            "port": self.port,
        }

    @classmethod
    def from_json(cls, raw: object) -> ReplicaNote:
        obj = _fields(raw, "a replica note")
        port = obj.integer("port", high=65535)
        if port < 1:
            raise NoteInvalid("a replica note's port is 0")
        return cls(
            round=obj.integer("round"),
            group_rank=obj.integer("group_rank"),
            node_id=_node_id(obj),
            port=port,
        )

    def check(self, round_: int | None, seat: Seat | None) -> ReplicaNote:
        """Itself, when it is about round ``round_`` and from ``seat``."""
        r, at = _member("replica note", round_, seat)
        _of_round("replica note", r, self.round)
        _check_seat("replica note", self.node_id, self.group_rank, (), at)
        return self


# -- a node refused ------------------------------------------------------------------
@frozen
class RefusalNote(Note):
    """``refused``: the last node the job refused for settings that differ
    from the job's, and why (the refused node's own error line). One key,
    overwritten by each refusal; not on a lease (the node holds none yet)."""

    node_id: str
    host: str
    message: str

    @classmethod
    def name_for(cls, round_: int | None, seat: Seat | None) -> str:
        return REFUSED

    @property
    def name(self) -> str:
        return REFUSED

    def to_json(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "host": self.host, "message": self.message}

    @classmethod
    def from_json(cls, raw: object) -> RefusalNote:
        obj = _fields(raw, "a refusal note")
        return cls(
            node_id=_node_id(obj),
            host=obj.text("host", MAX_TEXT),
            message=obj.text("message", MAX_MESSAGE),
        )


# -- the modules the script imports ---------------------------------------------------
@frozen
class ModuleReport(Note):
    """``modules``: the modules a script imported. What a worker reports over
    its channel (agent/modlearn.py builds it with :meth:`listed`), and what
    the job's note holds (written by group rank 0's agent for the others:
    :meth:`from_json`). Both keep only the names that pass the rule of
    ``worker/_modnames.py`` (at most ``MAX_MODULES``, distinct); the others
    are dropped and counted (``refused``). Read with no round or seat."""

    modules: tuple[str, ...] = ()
    python: str | None = None
    torch: str | None = None
    refused: int = 0  # names dropped by from_json

    @classmethod
    def name_for(cls, round_: int | None, seat: Seat | None) -> str:
        return MODULES

    @property
    def name(self) -> str:
        return MODULES

    def to_json(self) -> dict[str, Any]:
        return {"modules": list(self.modules), "python": self.python, "torch": self.torch}

    @classmethod
    def from_json(cls, raw: object) -> ModuleReport:
        obj = _fields(raw, "a modules note")
        listed = obj.raw.get("modules")
        if not isinstance(listed, list):
            raise NoteInvalid("modules is not a list")
        return cls.listed(listed, obj.raw.get("python"), obj.raw.get("torch"))

    @classmethod
    def listed(
        cls, listed: list[object], python: object, torch: object, script: str | None = None
    ) -> ModuleReport:
        """The names of ``listed`` that pass the rule (``script``: the module
        name that would run the script), with the versions when they are ones."""
        names = _modnames.checked(listed, script, MAX_MODULES)
        return cls(
            modules=tuple(names),
            python=checked_version(python),
            torch=checked_version(torch),
            refused=min(len(listed), MAX_MODULES) - len(names),
        )
