"""``--rdzv-conf``: rendezvous and store settings, typed once.

The command line gives them as ``k=v,k=v`` (:func:`split_rdzv_conf`, the
text's grammar), Python as ``LaunchConfig.rdzv_configs`` (a mapping of text or
values, as torch's launcher takes them); :func:`parse_rdzv_conf` turns either
into one :class:`RendezvousConf`, each value checked against its range
(:data:`~elastrun.launcher.limits.CONF_SECONDS`). Unknown keys are errors;
torch's keys whose job is done otherwise are accepted and ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from elastrun.errors import ConfigError
from elastrun.frozen import frozen
from elastrun.launcher.limits import CONF_SECONDS, check_seconds, parse_seconds, shown_value
from elastrun.store.etcd_options import EtcdOptions
from elastrun.untrusted import ascii_int

__all__ = [
    "RDZV_CONF_IGNORED",
    "RDZV_CONF_KEYS",
    "RendezvousConf",
    "parse_rdzv_conf",
    "split_rdzv_conf",
]

# --rdzv-conf keys: name -> kind. "float": seconds in the key's range
# (limits.CONF_SECONDS), "bool" accepts 1/0/true/false/yes/no, "int" a whole
# number in 1..CONF_INT_MAX, "str" anything non-empty.
RDZV_CONF_KEYS: dict[str, str] = {
    "join_timeout": "float",
    "last_call_timeout": "float",
    "close_timeout": "float",
    "read_timeout": "float",
    "timeout": "float",  # torch's etcd/static spelling of the join timeout
    "lease_ttl": "float",
    "exit_barrier_timeout": "float",
    "is_host": "bool",
    "token": "str",
    "token_file": "str",
    "store_bind": "str",  # where the hosted c10d store listens (launcher/bind.py)
    "failover_timeout": "float",  # candidate hosts: how long to find a new host
    "store_max_connections_per_peer": "int",  # the hosted store's cap per address
    # this node's own health check (agent/node_health.py), as --health-check*
    "health_check": "str",
    "health_check_timeout": "float",
    "health_check_interval": "float",
    # the agent's Prometheus endpoint (agent/metrics_server.py), as --metrics-port
    "metrics_port": "str",
    # etcd
    "cacert": "str",
    "cert": "str",
    "key": "str",
    "user": "str",
    "password": "str",
    "key_prefix": "str",
    "protocol": "str",  # torch's etcd: http | https
}
# torch keys accepted for compatibility and ignored (their job is done otherwise).
RDZV_CONF_IGNORED = {
    "use_libuv": "the embedded store is always asyncio",
    "keep_alive_interval": "liveness is a lease; set lease_ttl",
    "keep_alive_max_attempt": "liveness is a lease; set lease_ttl",
    "heartbeat": "liveness is a lease; set lease_ttl",
    "store_type": "the store is chosen by --rdzv-backend",
    "rank": "static mode uses --node-rank",
}
# The largest "int" value (connections: far above any open-file limit).
CONF_INT_MAX = 1_000_000


@frozen
class RendezvousConf:
    """The typed ``--rdzv-conf``; None: not given (the reader's default)."""

    join_timeout: float | None = None  # join_timeout, else torch's timeout
    last_call_timeout: float | None = None
    close_timeout: float | None = None
    read_timeout: float | None = None  # each store request after the first
    lease_ttl: float | None = None
    exit_barrier_timeout: float | None = None
    is_host: bool | None = None  # this node hosts the c10d store (None: decide by address)
    token: str | None = None
    token_file: str | None = None
    store_bind: str | None = None
    failover_timeout: float | None = None  # candidate hosts (docs/failover.md)
    # Connections the hosted store accepts from one address (and at least as
    # many in all); None: the store's default (2048).
    store_max_connections_per_peer: int | None = None
    # --health-check, --health-check-timeout, --health-check-interval (the flags win)
    health_check: str | None = None
    health_check_timeout: float | None = None
    health_check_interval: float | None = None
    # --metrics-port (the flag wins): PORT or HOST:PORT (no comma: one host here)
    metrics_port: str | None = None
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = None
    key_prefix: str | None = None
    protocol: str | None = None

    def etcd_options(self) -> EtcdOptions:
        """The etcd store's options given (TLS files, user, key prefix, protocol)."""
        # Its fields are this conf's etcd keys, by name.
        return EtcdOptions(
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(EtcdOptions)}
        )

    def with_(self, **changes: Any) -> RendezvousConf:
        return dataclasses.replace(self, **changes)


def _unquote(text: str) -> str:
    """``'x'`` or ``"x"`` -> ``x`` (one level of matching quotes)."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1].strip()
    return text


def split_rdzv_conf(text: str) -> dict[str, str]:
    """``k=v,k=v`` -> {key: value text} (the flag's grammar; the values are
    typed by :func:`parse_rdzv_conf`).

    Quotes that no shell removed are tolerated as torchrun tolerates them: one
    level of matching quotes around the whole text (``'k=v,k=v'``, as
    PyTorch's own launcher tests pass it), an item, a key or a value is
    dropped. Values cannot hold commas, quoted or not (as in torchrun)."""
    out: dict[str, str] = {}
    body = _unquote(text.strip())
    if not body:
        return out
    for item in body.split(","):
        key, sep, value = _unquote(item.strip()).partition("=")
        key, value = _unquote(key.strip()), _unquote(value.strip())
        if not key or not sep:
            raise ConfigError(
                f"--rdzv-conf: {shown_value(item.strip())} is not key=value "
                "(expected <key1>=<value1>,<key2>=<value2>,...)"
            )
        if not value:
            raise ConfigError(f"--rdzv-conf: {key} has an empty value")
        out[key] = value
    return out


def parse_rdzv_conf(conf: str | Mapping[str, Any]) -> RendezvousConf:
    """``k=v,k=v`` (or a mapping) -> :class:`RendezvousConf`; unknown keys are errors."""
    pairs = split_rdzv_conf(conf) if isinstance(conf, str) else dict(conf)
    known = sorted(RDZV_CONF_KEYS)
    values: dict[str, Any] = {}
    for key, value in pairs.items():
        if key in RDZV_CONF_IGNORED:
            continue
        kind = RDZV_CONF_KEYS.get(key)
        if kind is None:
            raise ConfigError(
                f"--rdzv-conf: unknown key {shown_value(key)}; known keys: {', '.join(known)}"
            )
        values[key] = _conf_value(key, kind, value)
    if "token" in values and "token_file" in values:
        raise ConfigError("--rdzv-conf: give token or token_file, not both")
    if values.get("protocol", "http") not in ("http", "https"):
        raise ConfigError(
            f"--rdzv-conf: protocol must be http or https, got {values['protocol']!r}"
        )
    timeout = values.pop("timeout", None)  # torch's spelling; join_timeout wins
    if timeout is not None:
        values.setdefault("join_timeout", timeout)
    return RendezvousConf(**values)


def _conf_value(key: str, kind: str, value: Any) -> Any:
    if kind == "float":
        name, rng = f"--rdzv-conf: {key}", CONF_SECONDS[key]
        if isinstance(value, str):
            return parse_seconds(name, value, rng)
        return check_seconds(name, value, rng)
    if kind == "int":
        # ASCII digits only: '²'.isdigit() is True, yet int('²') raises.
        number = None if isinstance(value, bool) else ascii_int(str(value))
        if number is None or not 1 <= number <= CONF_INT_MAX:
            raise ConfigError(
                f"--rdzv-conf: {key} must be a whole number in 1..{CONF_INT_MAX} (ASCII "
                f"digits), got {shown_value(str(value))}"
            )
        return number
    if kind == "bool":
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"--rdzv-conf: {key} must be 1 or 0 (true/false), got {value!r}")
    text = str(value)
    if not text:
        raise ConfigError(f"--rdzv-conf: {key} has an empty value")
    if any(c in text for c in "\x00\n\r"):
        raise ConfigError(f"--rdzv-conf: {key} contains a NUL or line break")
    return text
