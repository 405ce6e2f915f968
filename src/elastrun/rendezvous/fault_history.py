"""The job's history of root causes: one entry per failed round, bounded, typed, untrusted.

Each time the workers fail, the nodes agree on the job's root cause
(:mod:`.root_cause`: the failure the round keeps). That failure, with the
step its rank reached, is appended here as a :class:`FaultEntry`, once per
failed round, to one record at ``/elastrun/{run_id}/faults``
(:class:`FaultHistory`, at most :data:`MAX_ENTRIES` entries: the oldest
dropped first). The verdict rule (:mod:`.verdict`) reads the history; every
member of the failed round reads the same one, so all of them reach the same
verdict.

Who writes: the node whose failure is the root cause (it alone knows the
step its rank reached: the rank's progress file, flushed as the script
raised). Every other member waits, at most ``timeout`` seconds, for that
node's entry, and writes its own (the same root cause, its step unknown)
when none came: a root-cause node whose agent died writes nothing. Each
write is a compare-and-set on the record, and the first entry for a round
stays: later ones for the same round are not added, so every member reads
one entry per round. No wall clocks of different nodes are compared.

The record is read as untrusted (anything that reaches the store may write
it): decoded within :data:`MAX_BYTES` and the depth bound, each field
checked (:class:`~elastrun.fields.Fields`); a record that fails is no
history (and the next write replaces it). A damaged history therefore never
leads to a verdict: it fails safe (no exclusion, no stop).

``stopped``: the summary of the script fault that stopped the job (set
once, by :func:`stop`), which a node that waited as a spare prints when the
job fails under it.

Beside the entries, the record keeps what ``elastrun status`` shows of the
job's faults, each list bounded (the oldest dropped first) and read as
untrusted like the rest:

* ``verdicts``: the last :data:`MAX_VERDICTS` verdicts that were not
  transient (:class:`JudgedFault`: the round, the kind, the node, the
  verdict's line and what was done about it), one per round, written by the
  node that acts on it (:func:`judged`: a script fault by every node, the
  first kept; a node fault by the faulty node, which decides whether it
  leaves);
* ``health``: the last :data:`MAX_HEALTH` failed health checks
  (:class:`HealthFailure`: the node, when, the round the store was at, why,
  the output's tail), written by the node whose check failed
  (:func:`health_failed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
from collections.abc import Callable
from typing import Any

from elastrun.errors import ProtocolError, RendezvousError, StoreError
from elastrun.failure import FailureRecord, weight
from elastrun.fields import Fields
from elastrun.frozen import frozen
from elastrun.rendezvous import keys as K
from elastrun.rendezvous.records import RoundRecord
from elastrun.store.base import Store
from elastrun.untrusted import UntrustedData, loads

__all__ = [
    "FAULTS_VERSION",
    "MAX_BYTES",
    "MAX_ENTRIES",
    "FaultEntry",
    "FaultHistory",
    "HealthFailure",
    "HistoryInvalid",
    "JudgedFault",
    "entry_of",
    "health_failed",
    "judged",
    "read",
    "record",
    "split_exception",
    "stop",
]

FAULTS_VERSION = 1
MAX_ENTRIES = 32  # failed rounds kept (the verdict reads the last few)
MAX_HOST = 256
MAX_EXCEPTION = 128  # an exception's (qualified) type name
MAX_MESSAGE = 300  # an exception's message, as kept
MAX_SUMMARY = 1000
MAX_VERDICTS = 8  # verdicts kept for `elastrun status`
MAX_HEALTH = 16  # failed health checks kept for `elastrun status`
MAX_OUTPUT = 500  # characters of a failed check's output kept (its last)
# The record: MAX_ENTRIES entries, MAX_VERDICTS verdicts and MAX_HEALTH
# health failures at their bounds fit in it.
MAX_BYTES = 128 * 1024
WRITE_TRIES = 8  # compare-and-set attempts (other members write it too)
_EXCEPTION = re.compile(r"([A-Za-z_][A-Za-z0-9_.]{0,127})(?::\s?(.*))?\Z", re.DOTALL)


class HistoryInvalid(UntrustedData):
    """A fault history that is not one this version would have written."""


@frozen
class FaultEntry:
    """The root cause of one failed round, as the verdict rule reads it."""

    round: int  # the round whose workers failed
    host: str  # the node whose rank failed
    rank: int | None = None  # the global rank (None: not known)
    kind: str = ""  # failure.SIGNAL | ERROR | HANG | BROKEN_COLLECTIVE ("": not known)
    own: bool = False  # a rank of ``host`` failed by itself (failure.weight 0)
    exitcode: int | None = None
    signal: str | None = None
    exception: str = ""  # the exception's type ("": none known)
    message: str = ""  # its message, at most MAX_MESSAGE characters
    step: int | None = None  # the step the rank reached (None: not known)

    def what(self) -> str:
        """``ValueError: bad batch``, ``killed by SIGBUS``, ``exit code 3``."""
        if self.exception:
            return f"{self.exception}: {self.message}" if self.message else self.exception
        if self.signal:
            return f"killed by {self.signal}"
        if self.exitcode is not None:
            return f"exit code {self.exitcode}"
        return self.kind or "failed"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, raw: object) -> FaultEntry:
        f = Fields(raw, "a fault entry", HistoryInvalid)
        return cls(
            round=f.integer("round"),
            host=f.text("host", MAX_HOST),
            rank=f.optional_integer("rank"),
            kind=f.text("kind", 32),
            own=f.flag("own"),
            exitcode=f.optional_integer("exitcode", low=-(2**31), high=2**31),
            signal=f.optional_text("signal", 32),
            exception=f.text("exception", MAX_EXCEPTION),
            message=f.text("message", MAX_MESSAGE),
            step=f.optional_integer("step"),
        )


@frozen
class JudgedFault:
    """A verdict that was not transient, as ``elastrun status`` shows it:
    judged on round ``round``'s failure, its ``kind`` (``node_fault`` or
    ``script_fault``), the node it names, its one line (``summary``) and what
    was done (``outcome``: the job stopped, the node left, or why it stayed)."""

    round: int
    kind: str
    host: str
    summary: str
    outcome: str = ""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, raw: object) -> JudgedFault:
        f = Fields(raw, "a verdict", HistoryInvalid)
        return cls(
            round=f.integer("round"),
            kind=f.text("kind", 32),
            host=f.text("host", MAX_HOST),
            summary=f.text("summary", MAX_SUMMARY),
            outcome=f.text("outcome", MAX_SUMMARY),
        )


@frozen
class HealthFailure:
    """A node's failed health check (agent/node_health.py): ``host``, when
    (``before_round``: it did not join; ``training``: it leaves at the next
    round boundary), the job's round in the store when it was written
    (None: no round yet), the wall-clock time ``at`` (the writer's clock),
    why (``reason``) and the last :data:`MAX_OUTPUT` characters of its output."""

    host: str
    when: str
    round: int | None
    at: float
    reason: str
    output: str = ""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, raw: object) -> HealthFailure:
        f = Fields(raw, "a health failure", HistoryInvalid)
        return cls(
            host=f.text("host", MAX_HOST),
            when=f.text("when", 32),
            round=f.optional_integer("round"),
            at=f.number("at", high=2.0**40),
            reason=f.text("reason", MAX_MESSAGE),
            output=f.text("output", MAX_OUTPUT),
        )


@frozen
class FaultHistory:
    """The job's failed rounds, oldest first (one entry per round, at most
    :data:`MAX_ENTRIES`), and the summary of the verdict that stopped it."""

    entries: tuple[FaultEntry, ...] = ()
    stopped: str = ""
    verdicts: tuple[JudgedFault, ...] = ()  # oldest first, one per round
    health: tuple[HealthFailure, ...] = ()  # oldest first

    def has(self, round_: int) -> bool:
        return any(e.round == round_ for e in self.entries)

    def added(self, entry: FaultEntry) -> FaultHistory:
        """With ``entry`` (unless its round has one), the oldest dropped past the bound."""
        if self.has(entry.round):
            return self
        entries = sorted((*self.entries, entry), key=lambda e: e.round)
        return dataclasses.replace(self, entries=tuple(entries[-MAX_ENTRIES:]))

    def with_verdict(self, verdict: JudgedFault) -> FaultHistory:
        """With ``verdict`` (unless its round has one), the oldest dropped past the bound."""
        if any(v.round == verdict.round for v in self.verdicts):
            return self
        kept = sorted((*self.verdicts, verdict), key=lambda v: v.round)
        return dataclasses.replace(self, verdicts=tuple(kept[-MAX_VERDICTS:]))

    def with_health(self, failure: HealthFailure) -> FaultHistory:
        """With ``failure`` last, the oldest dropped past the bound."""
        return dataclasses.replace(self, health=(*self.health, failure)[-MAX_HEALTH:])

    def encode(self) -> bytes:
        obj = {
            "v": FAULTS_VERSION,
            "entries": [e.to_json() for e in self.entries],
            "stopped": self.stopped,
            "verdicts": [v.to_json() for v in self.verdicts],
            "health": [h.to_json() for h in self.health],
        }
        return json.dumps(obj, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> FaultHistory:
        """The history in ``raw``; raises :class:`HistoryInvalid` (one line)."""
        obj = loads(raw, max_bytes=MAX_BYTES, what="the fault history")
        f = Fields.versioned(obj, FAULTS_VERSION, "the fault history", HistoryInvalid)
        entries = tuple(FaultEntry.from_json(e) for e in f.items("entries", MAX_ENTRIES))
        verdicts = tuple(JudgedFault.from_json(v) for v in f.items("verdicts", MAX_VERDICTS))
        rounds = [e.round for e in entries]
        if rounds != sorted(set(rounds)):
            raise HistoryInvalid("the fault history: entries are not one per round, in order")
        rounds = [v.round for v in verdicts]
        if rounds != sorted(set(rounds)):
            raise HistoryInvalid("the fault history: verdicts are not one per round, in order")
        return cls(
            entries=entries,
            stopped=f.text("stopped", MAX_SUMMARY),
            verdicts=verdicts,
            health=tuple(HealthFailure.from_json(h) for h in f.items("health", MAX_HEALTH)),
        )


def split_exception(message: str) -> tuple[str, str]:
    """``("ValueError", "bad batch")`` of a failure's message ``ValueError:
    bad batch``; ``("", message)`` when it does not start with a type name."""
    first = message.strip().split("\n", 1)[0]
    m = _EXCEPTION.match(first)
    if m is None or (m.group(2) is None and not first[:1].isupper()):
        return "", first[:MAX_MESSAGE]
    return m.group(1), (m.group(2) or "").strip()[:MAX_MESSAGE]


def entry_of(failure: FailureRecord, round_: int, step: int | None) -> FaultEntry:
    """The entry of round ``round_``, whose root cause is ``failure``."""
    exception, message = split_exception(failure.message) if failure.message else ("", "")
    return FaultEntry(
        round=round_,
        host=failure.host[:MAX_HOST],
        rank=failure.rank,
        kind=failure.kind[:32],
        own=weight(failure) == 0,
        exitcode=failure.exitcode,
        signal=(failure.signal or None) and str(failure.signal)[:32],
        exception=exception,
        message=message,
        step=step,
    )


async def _read_kv(store: Store, keys: K.Keys) -> tuple[FaultHistory, int]:
    """The history and its key's mod revision (0: absent); a damaged one
    reads as empty, and is replaced at its revision by the next write."""
    kv = await store.get(keys.faults)
    if kv is None:
        return FaultHistory(), 0
    try:
        return FaultHistory.decode(kv.value), kv.mod_revision
    except UntrustedData:
        return FaultHistory(), kv.mod_revision


async def read(store: Store, keys: K.Keys) -> FaultHistory:
    """The job's history (empty when absent or damaged). Raises StoreError."""
    return (await _read_kv(store, keys))[0]


async def _update(
    store: Store, keys: K.Keys, change: Callable[[FaultHistory], FaultHistory]
) -> FaultHistory:
    """``change(history)`` written by compare-and-set, retried; the history as it stands."""
    hist = FaultHistory()
    for _ in range(WRITE_TRIES):
        hist, rev = await _read_kv(store, keys)
        new = change(hist)
        if new == hist:
            return hist
        if rev == 0:
            if await store.create(keys.faults, new.encode()):
                return new
        elif await store.compare_and_set(keys.faults, rev, new.encode()):
            return new
    return hist


async def record(
    store: Store, keys: K.Keys, entry: FaultEntry, *, own: bool, timeout: float
) -> FaultHistory | None:
    """Add ``entry`` (its round's root cause) unless its round has one. With
    ``own`` (this node's failure is the root cause) at once; else once the
    root-cause node's entry has not come within ``timeout`` seconds. The
    history as it then stands; None when the store did not answer in time.
    Never raises."""
    with contextlib.suppress(StoreError, RendezvousError, TimeoutError):
        async with asyncio.timeout(max(0.0, timeout) + 5.0):
            if not own:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, timeout)):
                        await _wait_for_round(store, keys, entry.round)
            return await _update(store, keys, lambda h: h.added(entry))
    return None


async def _wait_for_round(store: Store, keys: K.Keys, round_: int) -> None:
    while True:
        kvs, rev = await store.get_prefix(keys.faults)
        for kv in kvs:
            if kv.key == keys.faults:
                with contextlib.suppress(UntrustedData):
                    if FaultHistory.decode(kv.value).has(round_):
                        return
        watch = await store.watch(keys.faults, start_revision=rev + 1)
        async with watch:
            async for _event in watch:
                break


async def stop(store: Store, keys: K.Keys, summary: str) -> None:
    """Keep ``summary`` as the verdict that stopped the job (the first kept).
    Raises StoreError."""
    text = summary[:MAX_SUMMARY]
    await _update(store, keys, lambda h: h if h.stopped else dataclasses.replace(h, stopped=text))


async def judged(store: Store, keys: K.Keys, verdict: JudgedFault) -> None:
    """Keep ``verdict`` for ``elastrun status`` (the first of its round
    stays). Raises StoreError."""
    await _update(store, keys, lambda h: h.with_verdict(verdict))


async def health_failed(store: Store, keys: K.Keys, failure: HealthFailure) -> None:
    """Keep ``failure`` for ``elastrun status``, stamped with the job's
    current round (its ``round`` record's; None when it has none that
    reads). Raises StoreError."""
    round_ = None
    kv = await store.get(keys.round)
    if kv is not None:
        with contextlib.suppress(ProtocolError):
            round_ = RoundRecord.decode(kv.key, kv.value).round
    stamped = dataclasses.replace(failure, round=round_)
    await _update(store, keys, lambda h: h.with_health(stamped))
