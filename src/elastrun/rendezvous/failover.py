"""The rendezvous over a store with candidate hosts: the job outlives its
store's host (docs/failover.md).

:class:`FailoverRendezvous` is the agent's :class:`~.api.Rendezvous`. It runs
a :class:`~.dynamic.DynamicRendezvous` over the current host's store and,
beside every call, the :class:`~elastrun.store.failover.FailoverClient`'s
watch of that host. When the host is lost:

* the call in flight is abandoned: ``wait_for_change()`` returns a change
  (``store_host_lost``, not counted as a restart: workers stop),
  ``request_restart()`` and ``complete()`` return (a failure that came with
  the loss of the host's node is collateral of a membership change; a node
  whose workers succeeded is done);
* the next ``next_round()`` gives the host up, finds the new one (the
  client votes if this node is a candidate), and registers in its store as
  the same node, carrying its last round (:class:`~.rounds.Carry`): the
  round after it opens there, with the job's restart count; the survivors
  join it and it closes at the smaller world when at least ``min`` are back
  (sticky ranks: each keeps its group rank where it can).

The new host's store starts empty: the job's records are rebuilt from the
agents (its settings, their presence, the round and restarts they carry;
notes are written again by their owners), not replicated.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from elastrun.errors import StoreError
from elastrun.events import EventSink, NullSink
from elastrun.failure import FailureRecord
from elastrun.rendezvous.api import (
    Change,
    Rendezvous,
    RendezvousHooks,
    RendezvousSettings,
    RoundResult,
)
from elastrun.rendezvous.dynamic import DynamicRendezvous
from elastrun.rendezvous.fault_history import FaultEntry, FaultHistory, HealthFailure, JudgedFault
from elastrun.rendezvous.notes import Note, NoteT, Refused, Seat
from elastrun.rendezvous.quarantine import ClaimState, QuarantineRecord
from elastrun.rendezvous.rounds import Carry
from elastrun.store.base import Store
from elastrun.store.failover import FailoverClient, Lost

__all__ = ["FailoverRendezvous", "MakeRendezvous"]

T = TypeVar("T")

# How long a call's store error waits for the watch to say whether the host
# is lost (beyond the watch's own silence bound), before it is raised as it is.
SETTLE = 1.0

# (store, carry, node id) -> the dynamic rendezvous over that store.
MakeRendezvous = Callable[[Store, Carry | None, str | None], DynamicRendezvous]


class FailoverRendezvous(Rendezvous):
    """See the module doc."""

    def __init__(
        self,
        client: FailoverClient,
        settings: RendezvousSettings,
        make: MakeRendezvous,
        *,
        events: EventSink | None = None,
        say: Callable[[str], None] | None = None,
    ) -> None:
        assert client.store is not None
        self.client = client
        self.settings = settings
        self.events: EventSink = events if events is not None else NullSink()
        self._say = say
        self._make = make
        self.inner = make(client.store, None, None)
        self._last: Carry | None = None
        self._lost: Lost | None = None
        self._watch: asyncio.Task[Lost] | None = None

    @property
    def node_id(self) -> str:
        return self.inner.node_id

    # -- the host's watch --------------------------------------------------------
    def _watching(self) -> asyncio.Task[Lost]:
        if self._watch is None:
            self._watch = asyncio.get_running_loop().create_task(self.client.watch())
        return self._watch

    async def _guarded(self, call: Awaitable[T]) -> T | Lost:
        """``call``'s result, or why the host was lost first (the call is
        then cancelled). A store error of the call is raised unless the
        watch finds the host lost within its silence bound."""
        if self._lost is not None:
            if asyncio.iscoroutine(call):
                call.close()
            return self._lost
        watch = self._watching()
        task = asyncio.ensure_future(call)
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
            if task.done() and not task.cancelled() and isinstance(task.exception(), StoreError):
                settle = self.client.timing.silence + self.client.timing.heartbeat + SETTLE
                await asyncio.wait({watch}, timeout=settle)
                if not watch.done():
                    return task.result()  # raises the store error
            if watch.done():
                self._lost = watch.result()
                return self._lost
            return task.result()
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    async def _switch(self) -> None:
        """Give the lost host up, find the next one, rejoin there."""
        lost = self._lost
        assert lost is not None
        old = self.inner
        old_host = self.client.address(self.client.host)
        if self._say is not None:
            self._say(
                f"elastrun: lost the store's host {old_host} ({lost.cause}); looking for "
                f"the next host among {self.client.candidates}"
            )
        with contextlib.suppress(Exception):
            await old.keeper.stop(revoke=False, timeout=1.0)
        store = await self.client.replace(lost)
        self.inner = self._make(store, self._last, old.node_id)
        self.inner.attach(self.hooks)
        self._lost, self._watch = None, None
        if self._say is not None:
            self._say(
                f"elastrun: the store's host is now {self.client.address(self.client.host)} "
                f"(term {self.client.term}); rejoining the job"
            )

    # -- the Rendezvous interface ------------------------------------------------
    def attach(self, hooks: RendezvousHooks) -> None:
        self.hooks = hooks
        self.inner.attach(hooks)

    async def next_round(self) -> RoundResult:
        while True:
            if self._lost is not None:
                await self._switch()
            out = await self._guarded(self.inner.next_round())
            if isinstance(out, RoundResult):
                whole = await self._guarded(self.inner.full_result(out))
                if not isinstance(whole, RoundResult):
                    continue  # the store's host was lost meanwhile: rejoin at the new one
                self._last = Carry.of(whole)
                return whole

    async def full_result(self, result: RoundResult) -> RoundResult:
        return await self.inner.full_result(result)

    async def wait_for_change(self) -> Change:
        out = await self._guarded(self.inner.wait_for_change())
        if isinstance(out, Lost):
            where = self.client.address(self.client.host)
            return Change(
                "store_host_lost",
                f"the store's host {where} was lost: {out.cause}",
                stop_now=out.kill_workers,
            )
        return out

    async def request_restart(self, failure: FailureRecord) -> None:
        # Lost: the next round forms at the new host, not charged (a node was lost).
        await self._guarded(self.inner.request_restart(failure))

    async def job_failure(self, failure: FailureRecord, timeout: float) -> FailureRecord:
        # The first failure the round's members reported, at the host they share;
        # with the host lost meanwhile, this node's own.
        if self._lost is not None:
            return failure
        out = await self._guarded(self.inner.job_failure(failure, timeout))
        return failure if isinstance(out, Lost) else out

    async def complete(self) -> None:
        await self._guarded(self.inner.complete())

    async def shutdown(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(BaseException):
                await self._watch
        if self._lost is None:
            await self.inner.shutdown()

    # While the host is lost (until the next round finds the new one) the
    # notes and the job's state are not asked of the old store: it is gone.
    async def find_note(
        self, kind: type[NoteT], round_: int | None = None, seat: Seat | None = None
    ) -> NoteT | Refused | None:
        return None if self._lost is not None else await self.inner.find_note(kind, round_, seat)

    async def write_note(self, note: Note) -> None:
        if self._lost is None:
            await self.inner.write_note(note)

    async def gather_notes(
        self, kind: type[NoteT], round_: int, seats: Sequence[Seat], timeout: float
    ) -> dict[int, NoteT | Refused]:
        if self._lost is not None:
            return {}
        return await self.inner.gather_notes(kind, round_, seats, timeout)

    async def record_fault(
        self, entry: FaultEntry, *, own: bool, timeout: float
    ) -> FaultHistory | None:
        if self._lost is not None:
            return None
        return await self.inner.record_fault(entry, own=own, timeout=timeout)

    async def fault_history(self) -> FaultHistory | None:
        return None if self._lost is not None else await self.inner.fault_history()

    async def stop_job(self, summary: str) -> None:
        if self._lost is None:
            await self.inner.stop_job(summary)

    async def record_verdict(self, verdict: JudgedFault) -> None:
        if self._lost is None:
            await self.inner.record_verdict(verdict)

    async def record_health(self, failure: HealthFailure) -> None:
        if self._lost is None:
            await self.inner.record_health(failure)

    async def spares_for(self, host: str, members: Sequence[str]) -> int | None:
        return None if self._lost is not None else await self.inner.spares_for(host, members)

    async def quarantine(self, record: QuarantineRecord) -> bool:
        return False if self._lost is not None else await self.inner.quarantine(record)

    async def quarantine_of(self, host: str) -> QuarantineRecord | None:
        return None if self._lost is not None else await self.inner.quarantine_of(host)

    async def replacement_state(self, host: str, round_: int, now: float) -> ClaimState | None:
        if self._lost is not None:
            return None
        return await self.inner.replacement_state(host, round_, now)

    async def claim_replacement(self, state: ClaimState, record: QuarantineRecord) -> bool:
        return (
            False if self._lost is not None else await self.inner.claim_replacement(state, record)
        )

    async def joining_running_job(self) -> bool:
        return False if self._lost is not None else await self.inner.joining_running_job()
