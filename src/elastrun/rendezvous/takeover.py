"""Registering in a new host's store after a takeover (docs/failover.md).

The new host's store starts empty. Each survivor writes, in one txn on what
it read: the job's settings (created if absent, else agreed), its presence,
and the round after its own last one (:func:`.rounds.takeover_round`: never
before what the store holds, with the most restarts of the two), unless the
store already holds a later round: every survivor carries its own, the first
one writes it, the others join it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from elastrun.errors import RendezvousError
from elastrun.rendezvous import keys as K
from elastrun.rendezvous import rounds
from elastrun.rendezvous.api import RendezvousSettings
from elastrun.rendezvous.damage import decode_config
from elastrun.rendezvous.plan import decode_round
from elastrun.rendezvous.records import AgreedSettings, ConfigRecord
from elastrun.store.base import Compare, Get, Put, Store

__all__ = ["REGISTER_TRIES", "register_after_takeover"]

REGISTER_TRIES = 8  # reads of the job's records (races with the other survivors)


async def register_after_takeover(
    store: Store,
    settings: RendezvousSettings,
    carry: rounds.Carry,
    presence: Callable[[], Put],
    agree: Callable[[AgreedSettings, AgreedSettings], None],
) -> None:
    """See the module doc. ``presence``: this node's presence put (on its
    lease); ``agree``: raises ConfigMismatch when the job's settings differ."""
    k, mine = K.Keys(settings.run_id), settings.agreed()
    detail = f"the store's host was lost; re-forming after round {carry.round}"
    for _ in range(REGISTER_TRIES):
        res = await store.txn([], [Get(k.config), Get(k.round)])
        config_kv = res.gets[0][0] if res.gets[0] else None
        round_kv = res.gets[1][0] if res.gets[1] else None
        found = decode_round(k.round, round_kv.value) if round_kv else None
        ops: list[Put] = [presence()]
        if config_kv is not None:
            agree(decode_config(k.config, config_kv.value).settings, mine)
        else:
            ops.append(Put(k.config, ConfigRecord(mine).encode()))
        if found is None or found.round <= carry.round:
            opened = rounds.takeover_round(carry, found, detail, time.time())
            ops.append(Put(k.round, opened.encode()))
        compares = [
            Compare.unchanged(k.config, config_kv.mod_revision if config_kv else 0),
            Compare.unchanged(k.round, round_kv.mod_revision if round_kv else 0),
        ]
        if (await store.txn(compares, ops)).succeeded:
            return
    raise RendezvousError(
        f"job {settings.run_id!r}: the new store host's records changed {REGISTER_TRIES} "
        "times while this node registered; try again"
    )
