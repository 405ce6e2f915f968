"""A node that lost its lease registers again, for as long as its rejoin window.

A node loses its lease when the store said it is gone (expired, revoked) or
when the store could not be reached for longer than the lease TTL (a cut
link, a store host under load). By then the other nodes have seen it gone
and re-formed without it; its own workers are stopped (the agent stops them
on the ``lease_lost`` change before it asks for the next round). To rejoin,
it needs a new lease and its presence key again: :func:`regain` tries that
until it succeeds, retrying while the store is unreachable, for at most the
*rejoin window* (the rendezvous's ``join_timeout``). Past the window it
raises :class:`~elastrun.errors.StoreUnavailable` naming the store, the
window and the last error: the agent exits 1 with that line.

What is not retried: an error that is no matter of reachability (a refused
token, a protocol error, a config mismatch), and the loss of the embedded
store's host with candidate hosts (``HostLost``, ``NotHost``): the failover
rendezvous handles those by finding the next host.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from elastrun.clock import Clock, remaining, wait_until
from elastrun.errors import HostLost, LeaseNotFound, NotHost, StoreUnavailable

__all__ = ["RETRY_EVERY", "regain"]

RETRY_EVERY = 0.5  # s between two tries while the store is unreachable


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, HostLost | NotHost):
        return False
    return isinstance(exc, StoreUnavailable | LeaseNotFound | TimeoutError | OSError)


async def regain(
    attempt: Callable[[], Awaitable[None]],
    *,
    window: float,
    clock: Clock,
    lost: str,
    store: str = "the store",
    limit: str | None = None,
    on_retry: Callable[[BaseException], None] | None = None,
) -> float:
    """Run ``attempt`` (get a lease, put the presence key) until it succeeds;
    an unreachable store is retried every :data:`RETRY_EVERY` seconds until
    ``window`` seconds have passed (a try still waiting then is cancelled).
    ``on_retry(error)`` is called after each failed try. Returns the seconds
    it took; raises StoreUnavailable past the window (``lost``: why the lease
    was lost, ``store``: what the store is, ``limit``: what bounds the window,
    by default ``join_timeout``, for the message)."""
    bound = f"join_timeout={window:g}" if limit is None else limit
    start = clock.monotonic()
    deadline = start + window
    while True:
        try:
            await wait_until(attempt(), deadline, clock)
            return clock.monotonic() - start
        except Exception as exc:
            if not _retryable(exc):
                raise
            if remaining(deadline, clock) <= 0:
                why = str(exc) or (
                    "no answer" if isinstance(exc, TimeoutError) else type(exc).__name__
                )
                raise StoreUnavailable(
                    f"{store} stayed unreachable for {window:g} s ({bound}) "
                    f"after this node's lease was lost ({lost}); giving up: {why}"
                ) from None
            if on_retry is not None:
                on_retry(exc)
        await clock.sleep_until(min(clock.monotonic() + RETRY_EVERY, deadline))
