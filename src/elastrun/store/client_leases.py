"""The leases a :class:`~elastrun.store.client.TcpStore` holds, renewed at once
after a reconnect.

The embedded store cuts a lease to a short grace when the connection that
granted it or last kept it alive ends (see :mod:`elastrun.store.server`), so
that a dead client's keys vanish quickly. A live client that merely lost its
connection must not lose its leases to that grace: as soon as it has a new
connection, before any other request, it sends a keepalive for every lease it
holds. A lease is held from its grant or a successful keepalive through this
client until it is revoked through it, reported missing (expired or
revoked), or past the TTL it had at its last renewal (its holder stopped
renewing it: a reconnect must not revive it).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from typing import TYPE_CHECKING, Any

from elastrun.clock import Clock
from elastrun.errors import ProtocolError
from elastrun.store import codec

if TYPE_CHECKING:
    from collections.abc import Iterator

    from elastrun.store.client_conn import Conn

__all__ = ["HeldLeases"]


class HeldLeases:
    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._expires: dict[int, float] = {}  # lease -> its deadline as last renewed here

    def __len__(self) -> int:
        return len(self._expires)

    def renewed(self, lease: int, ttl: float) -> None:
        """Granted or kept alive through this client, with ``ttl``."""
        self._expires[lease] = self._clock.monotonic() + ttl

    def forget(self, lease: int) -> None:
        self._expires.pop(lease, None)

    def clear(self) -> None:
        self._expires.clear()

    def due(self) -> list[int]:
        """The leases to renew now (those past their last known TTL are dropped)."""
        now = self._clock.monotonic()
        for lease in [lease for lease, expires in self._expires.items() if expires <= now]:
            del self._expires[lease]
        return sorted(self._expires)

    def renew_on(self, conn: Conn, request_ids: Iterator[int]) -> int:
        """Write a keepalive for every held lease on ``conn`` (a new
        connection) without waiting for the answers, which arrive through the
        connection's read loop: a renewed lease's TTL is refreshed, a lease the
        store no longer has is forgotten. Returns how many were sent."""
        leases = self.due()
        for lease in leases:
            request_id = next(request_ids)
            future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
            future.add_done_callback(functools.partial(self._answered, lease))
            conn.pending[request_id] = future
            try:
                frame = codec.encode_request(request_id, codec.LeaseKeepaliveRequest(lease))
                conn.writer.write(codec.encode_frame(frame))
            except (OSError, ProtocolError, RuntimeError):
                conn.pending.pop(request_id, None)
                future.cancel()
                break  # the connection is going already; the next one renews
        return len(leases)

    def _answered(self, lease: int, future: asyncio.Future[dict[str, Any]]) -> None:
        if future.cancelled() or future.exception() is not None:
            return  # the connection was lost too: the next one renews
        response = future.result()
        if response.get("ok") is True:
            result = response.get("result")
            with contextlib.suppress(ProtocolError):  # a malformed answer renews nothing
                answer = codec.LeaseKeepaliveAnswer.from_json(
                    result if isinstance(result, dict) else {}
                )
                if lease in self._expires:
                    self.renewed(lease, answer.ttl)
            return
        error = response.get("error")
        if isinstance(error, dict) and error.get("code") == "lease_not_found":
            self.forget(lease)
