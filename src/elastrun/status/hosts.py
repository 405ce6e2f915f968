"""``elastrun status`` for a store with candidate hosts (docs/failover.md):
ask every candidate what it is, connect to the host of the highest term.
The same command finds the job before and after a takeover."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from elastrun.endpoint import Endpoint
from elastrun.status.model import StoreHosts
from elastrun.store.base import Store
from elastrun.store.failover import Answer, Candidates, FailoverClient, Probe

__all__ = ["open_candidates", "store_hosts"]


async def open_candidates(
    endpoints: tuple[Endpoint, ...], token: str | None, timeout: float
) -> tuple[Store, StoreHosts]:
    """The store of the highest term's host, and who is who. Raises
    HostLost when no candidate hosts it within ``timeout``."""
    client = FailoverClient(Candidates(endpoints), token=token, request_timeout=timeout)
    seen = await client.look()
    store = await client.connect(timeout)
    if any(p.index == client.host and p.answer is not Answer.HOST for p in seen):
        # The answers came before a host was elected (the job starting, a
        # takeover): ask again, now that one serves.
        seen = await client.look()
    return store, store_hosts(client.term, client.host, seen, client.address)


def store_hosts(
    term: int, host: int | None, seen: Sequence[Probe], address: Callable[[int | None], str]
) -> StoreHosts:
    """Who is who: the host connected to (candidate ``host``, of ``term``),
    and the others as they answered (the host itself never among them)."""
    others = [p for p in seen if p.index != host]
    return StoreHosts(
        term=term,
        host=address(host),
        standbys=tuple(address(p.index) for p in others if p.answer is Answer.STANDBY),
        others=tuple(
            f"{address(p.index)} ({p.answer.value})"
            for p in others
            if p.answer not in (Answer.STANDBY, Answer.HOST)
        ),
    )
