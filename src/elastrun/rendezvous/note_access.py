"""The job notes a node reads and writes (:mod:`.notes`), over its store.

Part of :class:`~.dynamic.DynamicRendezvous`: the :class:`~.api.Rendezvous`
note calls, on the node's store, key layout, lease and clock. :func:`find_note`
is the typed read of one note by its key, which ``elastrun status`` uses too.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from elastrun.clock import Clock
from elastrun.errors import RendezvousError, StoreError
from elastrun.rendezvous import keys as K
from elastrun.rendezvous import notes as N
from elastrun.store.base import NO_LEASE, KeyValue, Store
from elastrun.store.keepalive import LeaseKeeper

__all__ = ["NoteAccess", "find_note"]


async def find_note(
    store: Store,
    keys: K.Keys,
    kind: type[N.NoteT],
    round_: int | None = None,
    seat: N.Seat | None = None,
) -> N.NoteT | N.Refused | None:
    """The note ``kind`` of round ``round_`` from ``seat``, read by its key
    (:func:`~.notes.parse`: None when absent or not decodable within the
    bounds). Raises StoreError."""
    kv = await store.get(keys.note(kind.name_for(round_, seat)))
    return None if kv is None else N.parse(kind, kv.value, round_, seat)


class NoteAccess:
    """Reading, writing and gathering job notes (untrusted: dropped unless
    they decode within the bounds and pass their schema and check)."""

    store: Store
    keys: K.Keys
    keeper: LeaseKeeper
    clock: Clock

    async def find_note(
        self, kind: type[N.NoteT], round_: int | None = None, seat: N.Seat | None = None
    ) -> N.NoteT | N.Refused | None:
        try:
            return await find_note(self.store, self.keys, kind, round_, seat)
        except (StoreError, RendezvousError):
            return None

    async def write_note(self, note: N.Note) -> None:
        data = N.encode(note.to_json())
        if not N.valid_name(note.name) or len(data) > N.NOTE_MAX_BYTES:
            return
        held = self.keeper.lease if note.ON_LEASE else NO_LEASE
        if note.ON_LEASE and held == NO_LEASE:
            return  # no lease to tie it to: it would outlive this node
        with contextlib.suppress(StoreError):
            await self.store.put(self.keys.note(note.name), data, held)

    async def gather_notes(
        self, kind: type[N.NoteT], round_: int, seats: Sequence[N.Seat], timeout: float
    ) -> dict[int, N.NoteT | N.Refused]:
        by_name = {kind.name_for(round_, s): s for s in seats}
        want = {n for n in by_name if N.valid_name(n)}
        if not want:
            return {}
        first = min(want)
        prefix = self.keys.note(first[: first.rfind("_") + 1] if "_" in first else first)
        got: dict[str, N.NoteT | N.Refused] = {}

        def absorb(kv: KeyValue) -> None:
            name = kv.key[len(self.keys.note("")) :]
            if name in want:
                # Another node's (or anyone's) bytes: dropped unless they decode
                # within the bounds; refused (with why) unless they pass the check.
                found = N.parse(kind, kv.value, round_, by_name[name])
                if found is not None:
                    got[name] = found

        deadline = self.clock.monotonic() + timeout
        with contextlib.suppress(StoreError, TimeoutError):
            kvs, rev = await self.store.get_prefix(prefix)
            for kv in kvs:
                absorb(kv)
            if want <= got.keys() or timeout <= 0:
                return _by_seat(got, by_name)
            async with (
                asyncio.timeout(max(0.0, deadline - self.clock.monotonic())),
                await self.store.watch(prefix, prefix=True, start_revision=rev + 1) as watch,
            ):
                async for event in watch:
                    if event.type == "put":
                        absorb(event.kv)
                    if want <= got.keys():
                        break
        return _by_seat(got, by_name)


def _by_seat(
    got: dict[str, N.NoteT | N.Refused], by_name: dict[str, N.Seat]
) -> dict[int, N.NoteT | N.Refused]:
    return {by_name[name].group_rank: found for name, found in got.items()}
