"""The job's fault history and quarantine records a node reads and writes, over its store.

Part of :class:`~.dynamic.DynamicRendezvous` (as :mod:`.note_access` is for
the notes): the :class:`~.api.Rendezvous` calls of fault attribution on the
node's store and key layout. Each call is bounded in time and never raises:
a store that does not answer costs attribution its verdict, never the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Sequence

from elastrun.errors import RendezvousError, StoreError
from elastrun.rendezvous import fault_history as H
from elastrun.rendezvous import keys as K
from elastrun.rendezvous import quarantine as Q
from elastrun.rendezvous.records import RoundRecord, RoundState
from elastrun.store.base import Store

__all__ = ["CALL_TIMEOUT", "FaultAccess", "mark_failed"]

CALL_TIMEOUT = 10.0  # s: a store call of attribution that takes longer is dropped
MARK_TRIES = 8


async def mark_failed(store: Store, keys: K.Keys, summary: str) -> bool:
    """Mark the job failed (its ``round`` record's state ``failed``, the
    record's ``detail`` ``summary``), unless it already ended; compare-and-set,
    retried. True when this call marked it. Raises StoreError."""
    for _ in range(MARK_TRIES):
        kv = await store.get(keys.round)
        if kv is None:
            return False
        rec = RoundRecord.decode(kv.key, kv.value)
        if rec.state in (RoundState.FAILED, RoundState.FINISHED):
            return False
        new = dataclasses.replace(rec, state=RoundState.FAILED, detail=summary[: H.MAX_SUMMARY])
        if await store.compare_and_set(keys.round, kv.mod_revision, new.encode()):
            return True
    return False


class FaultAccess:
    """Fault history and quarantine over the node's store."""

    store: Store
    keys: K.Keys

    async def record_fault(
        self, entry: H.FaultEntry, *, own: bool, timeout: float
    ) -> H.FaultHistory | None:
        return await H.record(self.store, self.keys, entry, own=own, timeout=timeout)

    async def fault_history(self) -> H.FaultHistory | None:
        with contextlib.suppress(StoreError, RendezvousError, TimeoutError):
            async with asyncio.timeout(CALL_TIMEOUT):
                return await H.read(self.store, self.keys)
        return None

    async def stop_job(self, summary: str) -> None:
        with contextlib.suppress(StoreError, RendezvousError, TimeoutError):
            async with asyncio.timeout(CALL_TIMEOUT):
                await H.stop(self.store, self.keys, summary)
                await mark_failed(self.store, self.keys, summary)

    async def record_verdict(self, verdict: H.JudgedFault) -> None:
        with contextlib.suppress(StoreError, RendezvousError, TimeoutError):
            async with asyncio.timeout(CALL_TIMEOUT):
                await H.judged(self.store, self.keys, verdict)

    async def record_health(self, failure: H.HealthFailure) -> None:
        with contextlib.suppress(StoreError, RendezvousError, TimeoutError):
            async with asyncio.timeout(CALL_TIMEOUT):
                await H.health_failed(self.store, self.keys, failure)

    async def spares_for(self, host: str, members: Sequence[str]) -> int | None:
        with contextlib.suppress(StoreError, RendezvousError, TimeoutError):
            async with asyncio.timeout(CALL_TIMEOUT):
                return await Q.spares_present(self.store, self.keys, host, set(members))
        return None

    async def quarantine(self, record: Q.QuarantineRecord) -> bool:
        with contextlib.suppress(StoreError, RendezvousError, TimeoutError):
            async with asyncio.timeout(CALL_TIMEOUT):
                return await Q.put(self.store, self.keys, record)
        return False

    async def quarantine_of(self, host: str) -> Q.QuarantineRecord | None:
        with contextlib.suppress(StoreError, RendezvousError, TimeoutError):
            async with asyncio.timeout(CALL_TIMEOUT):
                return await Q.find(self.store, self.keys, host)
        return None

    async def replacement_state(self, host: str, round_: int, now: float) -> Q.ClaimState | None:
        with contextlib.suppress(StoreError, RendezvousError, TimeoutError):
            async with asyncio.timeout(CALL_TIMEOUT):
                return await Q.claim_state(self.store, self.keys, host, round_, now)
        return None

    async def claim_replacement(self, state: Q.ClaimState, record: Q.QuarantineRecord) -> bool:
        with contextlib.suppress(StoreError, RendezvousError, TimeoutError):
            async with asyncio.timeout(CALL_TIMEOUT):
                return await Q.claim(self.store, self.keys, state, record)
        return False
