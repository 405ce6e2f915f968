"""Where the store an agent hosts listens: the addresses the endpoint names.

The embedded store listens on the addresses of ``--rdzv-endpoint``'s host,
not on every interface: an IP address as given; a host name (``localhost``
included) resolved, on each of its addresses that belongs to this machine.
``--rdzv-conf store_bind=ADDR`` asks for other addresses: ``0.0.0.0`` (every
IPv4 interface), ``::`` (every IPv6 one), ``*`` (both), or an address or name
of this machine. ``--standalone`` listens on 127.0.0.1 only.

What a node may want to know is said in one line each (:attr:`Listen.warnings`):
a host name that resolves here to loopback only (Debian's ``127.0.1.1 host``
line in /etc/hosts), which other nodes cannot reach when the job may have
more nodes.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Sequence

from elastrun.endpoint import Endpoint
from elastrun.errors import ConfigError
from elastrun.frozen import frozen

__all__ = ["EVERY_INTERFACE", "Listen", "describe", "listen_on", "store_bind_hosts"]

# store_bind values that mean every interface, and what the server binds for each.
EVERY_INTERFACE = {"0.0.0.0": ("0.0.0.0",), "::": ("::",), "*": ("0.0.0.0", "::")}

Resolver = Callable[[str], Sequence[str]]


@frozen
class Listen:
    """Where the hosted store listens."""

    hosts: tuple[str, ...]  # addresses to bind
    connect: str  # what this agent's own client connects to
    warnings: tuple[str, ...] = ()


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return None


def resolve(host: str) -> list[str]:
    """``host``'s addresses, in the resolver's order, without repeats
    (ConfigError if it does not resolve)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigError(f"{host!r} does not resolve: {exc}") from None
    out: list[str] = []
    for _, _, _, _, sockaddr in infos:
        address = str(sockaddr[0])
        if address not in out:
            out.append(address)
    return out


def bindable(address: str) -> bool:
    """Whether ``address`` belongs to this machine (a socket can be bound to it)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((address, 0))
        return True
    except OSError:
        return False


def store_bind_hosts(
    value: str, resolver: Resolver = resolve, local: Callable[[str], bool] = bindable
) -> tuple[str, ...]:
    """The addresses ``--rdzv-conf store_bind=value`` asks for."""
    if value in EVERY_INTERFACE:
        return EVERY_INTERFACE[value]
    if _ip(value) is not None:
        return (value,)
    addresses = [a for a in resolver(value) if local(a)]
    if not addresses:
        raise ConfigError(
            f"--rdzv-conf store_bind={value}: not an address of this machine "
            "(0.0.0.0, ::, * or one of its addresses)"
        )
    return tuple(addresses)


def listen_on(
    host: str,
    port: int,
    *,
    store_bind: str | None = None,
    multi_node: bool = True,
    resolver: Resolver = resolve,
    local: Callable[[str], bool] = bindable,
) -> Listen:
    """Where a store hosted for the endpoint ``host:port`` listens.
    ``multi_node``: other nodes may have to reach it. Raises ConfigError when
    ``host`` has no address of this machine."""
    if store_bind is not None:
        hosts = store_bind_hosts(store_bind, resolver, local)
        every = store_bind in EVERY_INTERFACE
        return Listen(hosts[:1] if port == 0 else hosts, host if every else hosts[0])
    if _ip(host) is not None:
        return Listen((host,), host)
    resolved = resolver(host)
    addresses = [a for a in resolved if local(a)]
    if not addresses:
        raise ConfigError(
            f"--rdzv-endpoint: {host} resolves here to {', '.join(resolved)}, none of them an "
            "address of this machine, so this node cannot host the store there; give "
            "this node's address, or --rdzv-conf store_bind=ADDR (0.0.0.0: every interface)"
        )
    if port == 0:
        addresses = addresses[:1]  # each address would get a port of its own
    warnings: list[str] = []
    if multi_node and host != "localhost" and all(_loopback(a) for a in addresses):
        warnings.append(
            f"--rdzv-endpoint {host} resolves on this node to {', '.join(addresses)} "
            "(loopback) only, so the store listens there and other nodes cannot reach it "
            "(a '127.0.1.1 host' line in /etc/hosts?); give this node's address in "
            "--rdzv-endpoint, or --rdzv-conf store_bind=0.0.0.0"
        )
    return Listen(tuple(addresses), host, tuple(warnings))


def _loopback(address: str) -> bool:
    ip = _ip(address)
    return ip is not None and ip.is_loopback


def describe(addresses: Sequence[tuple[str, int]]) -> str:
    """``a:p, [b]:p`` for messages."""
    return ", ".join(str(Endpoint(host, port)) for host, port in addresses)
