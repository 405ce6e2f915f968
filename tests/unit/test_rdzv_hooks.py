"""What a rendezvous calls back, given once by ``Rendezvous.attach``
(RendezvousHooks): in-process handlers on the in-memory store."""

from __future__ import annotations

import asyncio
from typing import Any

from elastrun.names import RunId
from elastrun.rendezvous.api import RendezvousHooks, RendezvousSettings, WaitingStatus
from elastrun.rendezvous.dynamic import DynamicRendezvous
from elastrun.rendezvous.static import StaticRendezvous
from elastrun.store.base import EmbeddedRevoke, RevokeSpec
from elastrun.store.memory import MemoryStore


class Revocable(MemoryStore):
    """The in-memory store, saying how its leases could be revoked (as the
    embedded store and etcd do; the in-memory store cannot be reached)."""

    def revoke_spec(self, lease: int) -> RevokeSpec | None:
        return EmbeddedRevoke(lease=lease, host="127.0.0.1", port=1)


def _handler(store: MemoryStore, node: str = "a") -> DynamicRendezvous:
    settings = RendezvousSettings(
        run_id=RunId("J"),
        min_nodes=1,
        max_nodes=1,
        last_call_timeout=0.0,
        join_timeout=10.0,
        lease_ttl=5.0,
        host=node,
        addr="127.0.0.1",
    )
    return DynamicRendezvous(store, settings, node_id=node)


def _run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 20.0))


def test_the_lease_listener_hears_of_each_lease_and_of_none() -> None:
    async def main() -> tuple[list[Any], int]:
        store = Revocable()
        h, told = _handler(store), list[Any]()
        h.attach(RendezvousHooks(lease_listener=told.append))
        assert told == []  # no lease yet
        await h.next_round()
        lease = h.keeper.lease
        await h.shutdown()
        return told, lease

    told, lease = _run(main())
    assert told == [EmbeddedRevoke(lease=lease, host="127.0.0.1", port=1), None]


def test_hooks_given_while_a_lease_is_held_hear_of_it_at_once() -> None:
    async def main() -> tuple[list[Any], list[Any], int]:
        store = Revocable()
        h, first, second = _handler(store), list[Any](), list[Any]()
        h.attach(RendezvousHooks(lease_listener=first.append))
        await h.next_round()
        h.attach(RendezvousHooks(lease_listener=second.append))  # replaces the first
        lease = h.keeper.lease
        await h.shutdown()
        return first, second, lease

    first, second, lease = _run(main())
    assert first == [EmbeddedRevoke(lease=lease, host="127.0.0.1", port=1)]
    assert second == [EmbeddedRevoke(lease=lease, host="127.0.0.1", port=1), None]


def test_progress_reports_what_next_round_waits_for() -> None:
    async def main() -> list[WaitingStatus]:
        store = MemoryStore()
        h, seen = _handler(store), list[WaitingStatus]()
        h.attach(RendezvousHooks(progress=seen.append))
        await h.next_round()
        await h.shutdown()
        return seen

    seen = _run(main())
    assert seen and seen[0].round == 0 and seen[0].min_nodes == 1


def test_a_static_rendezvous_keeps_its_hooks_and_calls_none() -> None:
    settings = RendezvousSettings(run_id=RunId("J"), min_nodes=1, max_nodes=1, host="h")
    h = StaticRendezvous(settings, node_rank=0, master_addr="127.0.0.1", master_port=1234)
    said: list[str] = []
    leases: list[Any] = []
    hooks = RendezvousHooks(notice=said.append, lease_listener=leases.append)
    h.attach(hooks)
    _run(h.next_round())
    assert h.hooks is hooks and said == [] and leases == []
