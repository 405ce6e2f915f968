"""The job notes a node reads and writes (:mod:`.notes`), over its store.

Part of :class:`~.dynamic.DynamicRendezvous`: the :class:`~.api.Rendezvous`
note calls, on the node's store, key layout, lease and clock.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

from elastrun.clock import Clock
from elastrun.errors import RendezvousError, StoreError
from elastrun.rendezvous import keys as K
from elastrun.rendezvous import notes as N
from elastrun.store.base import NO_LEASE, KeyValue, Store
from elastrun.store.keepalive import LeaseKeeper
from elastrun.untrusted import UntrustedData

__all__ = ["NoteAccess"]


class NoteAccess:
    """Reading, writing and gathering job notes (untrusted: dropped unless
    they decode within the bounds)."""

    store: Store
    keys: K.Keys
    keeper: LeaseKeeper
    clock: Clock

    async def read_note(self, name: str) -> dict[str, Any] | None:
        if not N.valid_name(name):
            return None
        try:
            kv = await self.store.get(self.keys.note(name))
            return None if kv is None else N.decode(name, kv.value)
        except (StoreError, RendezvousError, UntrustedData):
            return None

    async def write_note(self, name: str, value: dict[str, Any], *, lease: bool = False) -> None:
        data = N.encode(value)
        if not N.valid_name(name) or len(data) > N.NOTE_MAX_BYTES:
            return
        held = self.keeper.lease if lease else NO_LEASE
        if lease and held == NO_LEASE:
            return  # no lease to tie it to: it would outlive this node
        with contextlib.suppress(StoreError):
            await self.store.put(self.keys.note(name), data, held)

    async def gather_notes(self, names: Sequence[str], timeout: float) -> dict[str, dict[str, Any]]:
        want = {n for n in names if N.valid_name(n)}
        if not want:
            return {}
        first = min(want)
        prefix = self.keys.note(first[: first.rfind("_") + 1] if "_" in first else first)
        got: dict[str, dict[str, Any]] = {}

        def absorb(kv: KeyValue) -> None:
            name = kv.key[len(self.keys.note("")) :]
            if name in want:
                # Another node's (or anyone's) bytes: dropped unless they decode
                # within the bounds.
                with contextlib.suppress(UntrustedData):
                    got[name] = N.decode(name, kv.value)

        deadline = self.clock.monotonic() + timeout
        with contextlib.suppress(StoreError, TimeoutError):
            kvs, rev = await self.store.get_prefix(prefix)
            for kv in kvs:
                absorb(kv)
            if want <= got.keys() or timeout <= 0:
                return got
            async with (
                asyncio.timeout(max(0.0, deadline - self.clock.monotonic())),
                await self.store.watch(prefix, prefix=True, start_revision=rev + 1) as watch,
            ):
                async for event in watch:
                    if event.type == "put":
                        absorb(event.kv)
                    if want <= got.keys():
                        break
        return got
