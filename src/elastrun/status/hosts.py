"""``elastrun status`` for a store with candidate hosts (docs/failover.md):
ask every candidate what it is, connect to the host of the highest term.
The same command finds the job before and after a takeover."""

from __future__ import annotations

from elastrun.endpoint import Endpoint
from elastrun.status.model import StoreHosts
from elastrun.store.base import Store
from elastrun.store.failover import Answer, Candidates, FailoverClient

__all__ = ["open_candidates"]


async def open_candidates(
    endpoints: tuple[Endpoint, ...], token: str | None, timeout: float
) -> tuple[Store, StoreHosts]:
    """The store of the highest term's host, and who is who. Raises
    HostLost when no candidate hosts it within ``timeout``."""
    client = FailoverClient(Candidates(endpoints), token=token, request_timeout=timeout)
    seen = await client.look()
    store = await client.connect(timeout)
    hosts = StoreHosts(
        term=client.term,
        host=client.address(client.host),
        standbys=tuple(client.address(p.index) for p in seen if p.answer is Answer.STANDBY),
        others=tuple(
            f"{client.address(p.index)} ({p.answer.value})"
            for p in seen
            if p.answer not in (Answer.STANDBY, Answer.HOST)
        ),
    )
    return store, hosts
