"""LeaseKeeper: grant a lease and keep it alive as a background task.

The keeper renews the lease every ``ttl / 3``; every wait is a deadline on
the injected clock (:func:`~elastrun.clock.wait_until`, ``sleep_until``).
It calls ``on_lost(reason)`` once, and sets :attr:`LeaseKeeper.lost`, when
the lease is gone: the store says it no longer exists (expired or revoked), or
the store could not be reached for longer than the TTL (so the lease has
expired there, or will before we can reach it). :meth:`stop` ends the task and
revokes the lease (best effort, bounded by one TTL or the timeout given).
``on_lease`` (if set) is told the lease held from now on: its id after each
grant, NO_LEASE once stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from elastrun.clock import SYSTEM_CLOCK, Clock, remaining, wait_until
from elastrun.errors import LeaseNotFound, StoreError, StoreTimeout
from elastrun.store.base import NO_LEASE, Store

__all__ = ["LeaseKeeper", "describe_store"]

log = logging.getLogger(__name__)


class LeaseKeeper:
    def __init__(
        self,
        store: Store,
        ttl: float,
        *,
        clock: Clock = SYSTEM_CLOCK,
        on_lost: Callable[[str], None] | None = None,
    ) -> None:
        self.store = store
        self.ttl = ttl
        self.clock = clock
        self.on_lost = on_lost
        self.on_lease: Callable[[int], None] | None = None
        self.lease = NO_LEASE
        self.lost = asyncio.Event()
        self.lost_reason = ""
        self._task: asyncio.Task[None] | None = None

    @property
    def alive(self) -> bool:
        return self.lease != NO_LEASE and not self.lost.is_set()

    async def start(self) -> int:
        """Grant a fresh lease and start keeping it alive; returns its id."""
        await self.stop(revoke=True)
        before = f" (before: lease lost, {self.lost_reason})" if self.lost.is_set() else ""
        self.lost = asyncio.Event()
        self.lost_reason = ""
        try:
            deadline = self.clock.monotonic() + self.ttl
            self.lease = await wait_until(self.store.lease_grant(self.ttl), deadline, self.clock)
        except TimeoutError:
            # A bare TimeoutError would escape the agent as a traceback: name the store.
            raise StoreTimeout(
                f"{describe_store(self.store)} granted no lease within {self.ttl:g} s (lease_ttl): "
                f"unreachable, or without a quorum{before}"
            ) from None
        self._task = asyncio.get_running_loop().create_task(self._run(self.lease))
        if self.on_lease is not None:
            self.on_lease(self.lease)
        return self.lease

    async def _run(self, lease: int) -> None:
        clock = self.clock
        expires = clock.monotonic() + self.ttl  # as far as we know
        renew_at = clock.monotonic() + self.ttl / 3
        while True:
            await clock.sleep_until(renew_at)
            try:
                if remaining(expires, clock) <= 0:
                    raise TimeoutError
                ttl = await wait_until(self.store.lease_keepalive(lease), expires, clock)
                expires = clock.monotonic() + ttl
                renew_at = clock.monotonic() + ttl / 3
            except LeaseNotFound:
                self._lose("lease expired or was revoked in the store")
                return
            except (StoreError, TimeoutError, OSError) as exc:
                if remaining(expires, self.clock) <= 0:
                    why = str(exc) or type(exc).__name__
                    self._lose(f"store unreachable for longer than the lease TTL ({why})")
                    return
                log.debug("lease keepalive failed, retrying: %r", exc)
                renew_at = clock.monotonic() + min(self.ttl / 10, remaining(expires, clock))

    def _lose(self, reason: str) -> None:
        self.lost_reason = reason
        self.lost.set()
        if self.on_lost is not None:
            self.on_lost(reason)

    async def stop(self, revoke: bool = True, timeout: float | None = None) -> None:
        """Stop renewing; revoke the lease (its keys vanish) unless told not to.
        The revoke is bounded by ``timeout`` (default: the TTL); if it does not
        get through, the lease still expires in the store within its TTL."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        lease, self.lease = self.lease, NO_LEASE
        if revoke and lease != NO_LEASE and not self.lost.is_set():
            with contextlib.suppress(StoreError, TimeoutError, OSError):
                bound = self.ttl if timeout is None else timeout
                deadline = self.clock.monotonic() + bound
                await wait_until(self.store.lease_revoke(lease), deadline, self.clock)
        if self.on_lease is not None and lease != NO_LEASE:
            self.on_lease(NO_LEASE)


def describe_store(store: Store) -> str:
    """What the store is, for messages (``describe()`` where it has one)."""
    describe = getattr(store, "describe", None)
    return str(describe()) if callable(describe) else "the store"
