"""Which store a job uses, and opening it.

:class:`Backend` is ``--rdzv-backend``, every alias in one place:

* ``c10d`` / ``tcp``: the embedded store (:class:`~elastrun.store.client.TcpStore`),
  endpoint ``host[:port]`` (default port 29400; IPv6 as ``[::1]:29400``).
* ``etcd`` / ``etcd-v2`` / ``etcd_v2``: etcd v3 (:mod:`elastrun.store.etcd`,
  imported lazily).
* ``static``: a fixed world, no store.

:func:`open_store` opens a connected store for a backend (or ``"memory"``: an
in-process :class:`~elastrun.store.memory.MemoryStore`, for tests), with its
options typed once (:class:`StoreOptions`: the embedded store's token, etcd's
:class:`EtcdOptions`).
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import field
from typing import cast

from elastrun.endpoint import Endpoint, format_endpoints
from elastrun.errors import ConfigError
from elastrun.frozen import frozen
from elastrun.store.base import Store
from elastrun.store.etcd_options import EtcdOptions
from elastrun.untrusted import printable

__all__ = [
    "DEFAULT_PORT",
    "Backend",
    "StoreOptions",
    "open_store",
    "parse_endpoint",
]

DEFAULT_PORT = 29400  # the embedded store's


class Backend(enum.StrEnum):
    """``--rdzv-backend``: which rendezvous (and store) a job uses."""

    C10D = "c10d"  # the embedded store (also "tcp")
    ETCD = "etcd"  # etcd v3 (also "etcd-v2", served by the same backend)
    STATIC = "static"  # a fixed world, no store

    @classmethod
    def parse(cls, name: object) -> Backend:
        """A backend or its name, any case, torchrun's aliases included."""
        if isinstance(name, Backend):
            return name
        backend = _BACKEND_NAMES.get(str(name).strip().lower())
        if backend is None:
            raise ConfigError(
                f"--rdzv-backend: unknown backend {printable(repr(str(name)[:64]))}; choose "
                "one of c10d (also tcp), etcd (also etcd-v2), static"
            )
        return backend


# Every name of each backend (torchrun's aliases included).
_BACKEND_NAMES = {
    "c10d": Backend.C10D,
    "tcp": Backend.C10D,
    "etcd": Backend.ETCD,
    "etcd-v2": Backend.ETCD,
    "etcd_v2": Backend.ETCD,
    "static": Backend.STATIC,
}


@frozen
class StoreOptions:
    """How to open a store: the embedded store's token, etcd's options."""

    token: str | None = None
    etcd: EtcdOptions = field(default_factory=EtcdOptions)


def parse_endpoint(endpoint: str, default_port: int = DEFAULT_PORT) -> Endpoint:
    """The embedded store's endpoint in any form :class:`Endpoint` parses.
    Raises ConfigError naming what is wrong."""
    return Endpoint.parse(endpoint, default_port, "store endpoint")


Endpoints = str | Endpoint | Sequence[Endpoint]


async def open_store(
    backend: Backend | str,
    endpoint: Endpoints,
    options: StoreOptions | None = None,
    *,
    timeout: float = 30.0,
    request_timeout: float | None = None,
) -> Store:
    """Open a connected store for ``backend`` (a :class:`Backend`, one of its
    names, or ``"memory"``) at ``endpoint``: typed (one :class:`Endpoint`, or
    etcd's members), or as the text a user gives.

    ``timeout`` bounds this first connection (retried: the store may still be
    starting). ``request_timeout``, when given, bounds each later request,
    reconnections included, so that a store lost mid-job is reported within
    it; otherwise the backend's default (embedded store) or ``timeout`` (etcd)."""
    if isinstance(backend, str) and backend.strip().lower() == "memory":
        from elastrun.store.memory import MemoryStore  # tests only: no agent loads the engine

        return MemoryStore()
    kind = Backend.parse(backend)
    options = options or StoreOptions()
    if kind is Backend.C10D:
        from elastrun.store.client import TcpStore

        host, port = _one(endpoint)
        if request_timeout is None:
            return await TcpStore.connect(host, port, token=options.token, timeout=timeout)
        store = await TcpStore.connect(
            host, port, token=options.token, timeout=timeout, request_timeout=request_timeout
        )
        store.connect_timeout = request_timeout  # reconnecting watches, from now on
        return store
    if kind is Backend.ETCD:
        module = importlib.import_module("elastrun.store.etcd")
        opener = cast(Callable[..., Awaitable[Store]], module.open_etcd_store)
        members = (endpoint,) if isinstance(endpoint, Endpoint) else endpoint
        return await opener(
            members, options=options.etcd, timeout=timeout, request_timeout=request_timeout
        )
    raise ConfigError("--rdzv-backend static keeps no store")


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
