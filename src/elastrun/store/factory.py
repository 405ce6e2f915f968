"""Pick a store implementation from a ``--rdzv-backend`` name.

* ``c10d`` / ``tcp``: the embedded store (:class:`~elastrun.store.client.TcpStore`),
  endpoint ``host[:port]`` (default port 29400; IPv6 as ``[::1]:29400``).
* ``memory``: an in-process :class:`~elastrun.store.memory.MemoryStore` (tests).
* ``etcd`` / ``etcd-v2``: etcd v3 (:mod:`elastrun.store.etcd`, imported lazily).
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import cast

from elastrun.endpoint import Endpoint, format_endpoints
from elastrun.errors import ConfigError
from elastrun.store.base import Store
from elastrun.store.memory import MemoryStore

__all__ = ["BACKENDS", "DEFAULT_ETCD_PORT", "DEFAULT_PORT", "open_store", "parse_endpoint"]

DEFAULT_PORT = 29400  # the embedded store's
DEFAULT_ETCD_PORT = 2379  # etcd's client port
BACKENDS = ("c10d", "tcp", "memory", "etcd", "etcd-v2")


def parse_endpoint(endpoint: str, default_port: int = DEFAULT_PORT) -> Endpoint:
    """The embedded store's endpoint in any form :class:`Endpoint` parses.
    Raises ConfigError naming what is wrong."""
    return Endpoint.parse(endpoint, default_port, "store endpoint")


Endpoints = str | Endpoint | Sequence[Endpoint]


async def open_store(
    backend: str,
    endpoint: Endpoints,
    *,
    token: str | None = None,
    conf: Mapping[str, str] | None = None,
    timeout: float = 30.0,
    request_timeout: float | None = None,
) -> Store:
    """Open a connected store for ``backend`` at ``endpoint``: typed (one
    :class:`Endpoint`, or etcd's members), or as the text a user gives.

    ``timeout`` bounds this first connection (retried: the store may still be
    starting). ``request_timeout``, when given, bounds each later request,
    reconnections included, so that a store lost mid-job is reported within
    it; otherwise the backend's default (embedded store) or ``timeout`` (etcd)."""
    name = backend.strip().lower()
    if name in ("c10d", "tcp"):
        from elastrun.store.client import TcpStore

        host, port = _one(endpoint)
        if request_timeout is None:
            return await TcpStore.connect(host, port, token=token, timeout=timeout)
        store = await TcpStore.connect(
            host, port, token=token, timeout=timeout, request_timeout=request_timeout
        )
        store.connect_timeout = request_timeout  # reconnecting watches, from now on
        return store
    if name == "memory":
        return MemoryStore()
    if name in ("etcd", "etcd-v2"):
        module = importlib.import_module("elastrun.store.etcd")
        opener = cast(Callable[..., Awaitable[Store]], module.open_etcd_store)
        members = (endpoint,) if isinstance(endpoint, Endpoint) else endpoint
        return await opener(
            members, conf=dict(conf or {}), timeout=timeout, request_timeout=request_timeout
        )
    raise ConfigError(
        f"unknown rendezvous backend {backend!r}; choose one of: c10d (or tcp), etcd, etcd-v2"
        ", static"
    )


def _one(endpoint: Endpoints) -> Endpoint:
    if isinstance(endpoint, str):
        return parse_endpoint(endpoint)
    if isinstance(endpoint, Endpoint):
        return endpoint
    if len(endpoint) != 1:
        raise ConfigError(
            f"the embedded store has one endpoint, got {len(endpoint)}: "
            f"{format_endpoints(endpoint)}"
        )
    return endpoint[0]
