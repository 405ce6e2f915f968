"""Store values that are not records: left out, or the job's verdict.

Anyone who reaches a store without a token can put any bytes under any key of
a job (docs/rendezvous.md, *Values that are not records*). What a value that
does not decode (:meth:`.records._Record.decode` raises a ProtocolError)
means depends on its key:

* A per-node key under a prefix the agents list (``nodes/``, ``waiting/``,
  ``rounds/{R}/join/``): one node's record. One that does not decode, or
  whose name after the prefix is not a node id, holds no node's record: it
  is left out as if absent (:func:`problem`), with one line for the operator
  (:class:`JunkLog`: once per key and revision, at most :data:`MAX_LINES`
  lines per node, so a stranger cannot flood the log). Junk put over a real
  node's key is then the same as deleting it, which a stranger can do anyway.
* A record the whole job agrees on (``config``, ``round``, a round's result
  and its shards): there is no other copy to go by, so a damaged one ends the
  job with a verdict: :class:`~elastrun.errors.RecordDamaged`, one line naming
  the key and what is wrong (:func:`agreed`). Why it is not rebuilt: docs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import ParamSpec, TypeVar

from elastrun.errors import ProtocolError, RecordDamaged
from elastrun.event_kinds import RecordSkipped
from elastrun.events import EventSink
from elastrun.rendezvous import keys as K
from elastrun.rendezvous.records import ConfigRecord, JoinRecord, PresenceRecord, WaitingRecord
from elastrun.store.base import KeyValue
from elastrun.untrusted import printable

__all__ = [
    "MAX_LINES",
    "JunkLog",
    "NodeKind",
    "agreed",
    "damaged",
    "decode_config",
    "problem",
]

# Lines a node says about keys left out, in all; then one more saying that
# further ones are left out without a line.
MAX_LINES = 16
# Characters of a key, or of what is wrong with its value, in a line.
KEY_CHARS = 200
PROBLEM_CHARS = 300

NodeKind = type[PresenceRecord] | type[JoinRecord] | type[WaitingRecord]

P = ParamSpec("P")
T = TypeVar("T")


def problem(prefix: str, kv: KeyValue, kind: NodeKind) -> str | None:
    """What keeps ``kv``, a key under ``prefix``, from holding a node's
    ``kind`` record (None: it holds one)."""
    name = kv.key[len(prefix) :] if kv.key.startswith(prefix) else kv.key
    if not K.valid_node_id(name):
        return f"store key {kv.key}: {name!r} is not a node id"
    try:
        kind.decode(kv.key, kv.value)
    except ProtocolError as exc:
        return str(exc)
    return None


def damaged(exc: ProtocolError, what: str) -> RecordDamaged:
    """The verdict on a record the job agrees on (``what``) that ``exc``
    says is not one."""
    why = printable(exc, limit=PROBLEM_CHARS)
    return RecordDamaged(
        f"the job's {what} is damaged: {why}. Something other than elastrun wrote it (anyone "
        "who reaches the store without a token can); every node stops, as there is no other "
        "copy to go by. Set a store token (docs/cli.md) and start the job again"
    )


def agreed(decode: Callable[P, T], what: str) -> Callable[P, T]:
    """``decode`` of a record the whole job agrees on (``what``): a value
    that is not one is the verdict :func:`damaged`, not a ProtocolError."""

    def checked(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return decode(*args, **kwargs)
        except ProtocolError as exc:
            raise damaged(exc, what) from None

    return checked


decode_config = agreed(ConfigRecord.decode, "config record (its agreed settings)")


class JunkLog:
    """The operator's lines about per-node keys left out: one per key and
    revision (the same value read again says nothing), at most
    :data:`MAX_LINES` in all (the keys remembered are as many)."""

    def __init__(self, events: EventSink, node_id: str) -> None:
        self.events = events
        self.node_id = node_id
        self.say: Callable[[str], None] | None = None  # the operator's console (hooks.notice)
        self._seen: set[tuple[str, int]] = set()
        self._lines = 0

    def keep(self, prefix: str, kvs: Iterable[KeyValue], kind: NodeKind) -> list[KeyValue]:
        """The keys of ``kvs`` (under ``prefix``) that hold a node's record;
        each other is left out, with its line."""
        return [kv for kv in kvs if self.holds(prefix, kv, kind)]

    def holds(self, prefix: str, kv: KeyValue, kind: NodeKind) -> bool:
        """Whether ``kv`` holds a node's ``kind`` record; if not, its line."""
        why = problem(prefix, kv, kind)
        if why is not None:
            self.left_out(kv, why)
        return why is None

    def left_out(self, kv: KeyValue, why: str) -> None:
        mark = (kv.key, kv.mod_revision)
        if self._lines > MAX_LINES or mark in self._seen:
            return
        self._lines += 1
        self._seen.add(mark)
        if self._lines > MAX_LINES:
            line = (
                f"elastrun: warning: {MAX_LINES} store keys left out so far; further ones are "
                "left out without a line"
            )
        else:
            line = (
                "elastrun: warning: a store key left out (something other than elastrun wrote "
                f"it): {printable(why, limit=PROBLEM_CHARS)}"
            )
        self.events.emit(
            RecordSkipped(
                node=self.node_id,
                key=printable(kv.key, limit=KEY_CHARS),
                revision=kv.mod_revision,
                problem=printable(why, limit=PROBLEM_CHARS),
            )
        )
        if self.say is not None:
            self.say(line)
