"""A network endpoint (host and port): parsed once, written once.

Every address a user gives (``--rdzv-endpoint``, ``--master-addr``, the
``elastrun status`` flags, the endpoint of :func:`elastrun.store.factory.open_store`)
is parsed here into an :class:`Endpoint` at the edge, and passed on typed; every
address shown in a message is written by :meth:`Endpoint.__str__`::

    host            -> (host, default port)
    host:port       -> (host, port)
    [v6]            -> (v6, default port)
    [v6]:port       -> (v6, port)
    v6              -> (v6, default port)     a bare IPv6 address, e.g. ::1

    str(Endpoint("node0", 29400)) == "node0:29400"
    str(Endpoint("::1", 29400))   == "[::1]:29400"

Ports are 0..65535 (0: pick a free port, where the reader allows it; each
reader says where it does not), in ASCII digits. Host names are ASCII (an
internationalized name in its ``xn--`` form: the resolver would otherwise
fold ``²`` into ``2``), at most 253 characters, each dot-separated label at
most 63 (longer ones no resolver takes). Errors are :class:`~elastrun.errors.ConfigError`
whose message starts with the flag or thing being parsed (``what``).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from typing import NamedTuple

from elastrun.errors import ConfigError

__all__ = ["Endpoint", "format_endpoints", "parse_endpoint_list"]

MAX_PORT = 65535
SCHEMES = ("http", "https")
# Not in a host name or IP address: URL and path punctuation, list separators.
_BAD_HOST_CHARS = frozenset("/@?#,")
MAX_HOST = 253  # DNS: a name's characters, and a label's
MAX_LABEL = 63


class Endpoint(NamedTuple):
    """A host (name, IPv4 or IPv6 address, without brackets) and a port."""

    host: str
    port: int

    def __str__(self) -> str:
        """``host:port``, IPv6 in brackets: ``[::1]:29400``."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @classmethod
    def parse(cls, text: str, default_port: int, what: str = "endpoint") -> Endpoint:
        """One endpoint in any of the forms above. Raises ConfigError."""
        raw = text.strip()
        if not raw:
            raise ConfigError(f"{what}: empty address")
        host, port_text = _split(raw, text, what)
        if not host or any(
            c.isspace() or not c.isprintable() or c in _BAD_HOST_CHARS for c in host
        ):
            raise ConfigError(f"{what}: bad host in {text!r}")
        if not host.isascii():
            raise ConfigError(
                f"{what}: host {host!r} is not ASCII (write an internationalized name in its "
                "xn-- form)"
            )
        if len(host) > MAX_HOST or max(len(label) for label in host.split(".")) > MAX_LABEL:
            raise ConfigError(
                f"{what}: host name too long: at most {MAX_HOST} characters, each "
                f"dot-separated part at most {MAX_LABEL} (got {len(host)}: {host[:64]!r}...)"
            )
        if port_text is None:
            return cls(host, default_port)
        if (
            not port_text.isascii()
            or not port_text.isdigit()
            or len(port_text) > 5
            or int(port_text) > MAX_PORT
        ):
            raise ConfigError(f"{what}: bad port {port_text!r} in {text!r} (expected 0..65535)")
        return cls(host, int(port_text))


def _split(raw: str, text: str, what: str) -> tuple[str, str | None]:
    """(host, port text or None) of a stripped, non-empty endpoint."""
    if raw.startswith("["):
        end = raw.find("]")
        if end < 0:
            raise ConfigError(f"{what}: unclosed '[' in {text!r}")
        host, rest = raw[1:end], raw[end + 1 :]
        if rest and not rest.startswith(":"):
            raise ConfigError(f"{what}: expected [ipv6]:port, got {text!r}")
        if not _is_ipv6(host):
            raise ConfigError(f"{what}: {host!r} in brackets is not an IPv6 address (in {text!r})")
        return host, (rest[1:] if rest else None)
    if raw.count(":") > 1:
        if not _is_ipv6(raw):
            raise ConfigError(
                f"{what}: {text!r} is neither host:port nor an IPv6 address "
                "(write IPv6 with a port as [addr]:port)"
            )
        return raw, None  # a bare IPv6 address
    if ":" in raw:
        host, port_text = raw.split(":", 1)
        return host, port_text
    return raw, None


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def parse_endpoint_list(
    text: str, default_port: int, what: str = "endpoint"
) -> tuple[tuple[Endpoint, ...], bool]:
    """A comma-separated list of endpoints (etcd's members), each optionally
    prefixed ``http://`` or ``https://`` -> (endpoints, whether any said https).
    An empty entry is an error."""
    out: list[Endpoint] = []
    https = False
    for raw in text.split(","):
        item = raw.strip()
        if "://" in item:
            scheme, item = item.split("://", 1)
            if scheme.lower() not in SCHEMES:
                raise ConfigError(
                    f"{what}: scheme {scheme!r} in {raw.strip()!r} must be http or https"
                )
            https = https or scheme.lower() == "https"
            item = item.rstrip("/")
        if not item:
            raise ConfigError(f"{what}: empty entry in {text!r}")
        out.append(Endpoint.parse(item, default_port, what))
    return tuple(out), https


def format_endpoints(endpoints: Iterable[Endpoint]) -> str:
    """``a:1,[::1]:2``: a list as the flags take it (comma-separated)."""
    return ",".join(str(e) for e in endpoints)
