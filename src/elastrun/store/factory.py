"""Pick a store implementation from a ``--rdzv-backend`` name.

* ``c10d`` / ``tcp``: the embedded store (:class:`~elastrun.store.client.TcpStore`),
  endpoint ``host[:port]`` (default port 29400; IPv6 as ``[::1]:29400``).
* ``memory``: an in-process :class:`~elastrun.store.memory.MemoryStore` (tests).
* ``etcd`` / ``etcd-v2``: etcd v3 (:mod:`elastrun.store.etcd`, imported lazily).
"""

from __future__ import annotations

import importlib
import ipaddress
from collections.abc import Awaitable, Callable, Mapping
from typing import cast

from elastrun.errors import ConfigError
from elastrun.store.base import Store
from elastrun.store.memory import MemoryStore

__all__ = ["BACKENDS", "DEFAULT_PORT", "open_store", "parse_endpoint"]

DEFAULT_PORT = 29400
BACKENDS = ("c10d", "tcp", "memory", "etcd", "etcd-v2")


def parse_endpoint(endpoint: str, default_port: int = DEFAULT_PORT) -> tuple[str, int]:
    """``"host"``, ``"host:port"``, ``"[v6]:port"``, ``"[v6]"`` or a bare IPv6
    address -> ``(host, port)``. Raises ConfigError naming what is wrong."""
    text = endpoint.strip()
    if not text:
        raise ConfigError("the store endpoint is empty; expected host[:port]")
    port_text: str | None = None
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            raise ConfigError(f"endpoint {endpoint!r}: missing ']' after the IPv6 address")
        host, rest = text[1:close], text[close + 1 :]
        if rest:
            if not rest.startswith(":"):
                raise ConfigError(f"endpoint {endpoint!r}: expected ':port' after ']'")
            port_text = rest[1:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ConfigError(f"endpoint {endpoint!r}: {host!r} is not an IPv6 address") from None
    elif text.count(":") > 1:
        try:
            ipaddress.IPv6Address(text)
        except ValueError:
            raise ConfigError(
                f"endpoint {endpoint!r}: write an IPv6 address with a port as [addr]:port"
            ) from None
        host = text
    else:
        host, _, port_text = text.partition(":")
        if not _:
            port_text = None
    if not host or any(c.isspace() for c in host):
        raise ConfigError(f"endpoint {endpoint!r}: missing or invalid host; expected host[:port]")
    if port_text is None:
        return host, default_port
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ConfigError(f"endpoint {endpoint!r}: port {port_text!r} is not a number in 0-65535")
    return host, int(port_text)


async def open_store(
    backend: str,
    endpoint: str,
    *,
    token: str | None = None,
    conf: Mapping[str, str] | None = None,
    timeout: float = 30.0,
    request_timeout: float | None = None,
) -> Store:
    """Open a connected store for ``backend`` at ``endpoint``.

    ``timeout`` bounds this first connection (retried: the store may still be
    starting). ``request_timeout``, when given, bounds each later request,
    reconnections included, so that a store lost mid-job is reported within
    it; otherwise the backend's default (embedded store) or ``timeout`` (etcd)."""
    name = backend.strip().lower()
    if name in ("c10d", "tcp"):
        from elastrun.store.client import TcpStore

        host, port = parse_endpoint(endpoint, DEFAULT_PORT)
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
        return await opener(
            endpoint, conf=dict(conf or {}), timeout=timeout, request_timeout=request_timeout
        )
    raise ConfigError(
        f"unknown rendezvous backend {backend!r}; choose one of: c10d (or tcp), etcd, etcd-v2"
        ", static"
    )
