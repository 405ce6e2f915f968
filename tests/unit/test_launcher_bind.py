"""Where the store an agent hosts listens (launcher/bind.py): the addresses
the endpoint names, never every interface unless ``store_bind`` asks, with a
warning for a host name that resolves here to loopback only. The resolver and
"is this address mine" are given, as a host's /etc/hosts and interfaces would
answer; the real ones are used by tests/integration/test_store_exposure.py."""

from __future__ import annotations

from typing import Any

import pytest

from elastrun.errors import ConfigError
from elastrun.launcher.bind import Listen, listen_on
from elastrun.launcher.config import LaunchConfig
from elastrun.launcher.plan import resolve

NAMES = {
    "node07": ["127.0.1.1"],  # Debian's /etc/hosts line for the host's own name
    "node08": ["10.0.0.8", "fd00::8"],
    "gateway": ["10.0.0.1"],
    "localhost": ["127.0.0.1", "::1"],
}
MINE = {"127.0.0.1", "::1", "127.0.1.1", "10.0.0.8", "fd00::8"}


def listen(host: str, port: int = 29400, **kw: Any) -> Listen:
    return listen_on(host, port, resolver=NAMES.__getitem__, local=MINE.__contains__, **kw)


def test_an_address_is_bound_as_given() -> None:
    got = listen("10.0.0.8")
    assert (got.hosts, got.connect, got.warnings) == (("10.0.0.8",), "10.0.0.8", ())


def test_a_name_binds_its_own_addresses_only() -> None:
    assert listen("node08").hosts == ("10.0.0.8", "fd00::8")
    assert listen("localhost").hosts == ("127.0.0.1", "::1")
    assert listen("localhost").warnings == ()
    assert listen("node08", 0).hosts == ("10.0.0.8",)  # port 0: one address, one port


def test_a_name_that_resolves_to_loopback_here_warns_naming_the_fix() -> None:
    got = listen("node07")
    assert got.hosts == ("127.0.1.1",)
    (warning,) = got.warnings
    assert "node07 resolves on this node to 127.0.1.1 (loopback) only" in warning
    assert "--rdzv-conf store_bind=0.0.0.0" in warning
    assert listen("node07", multi_node=False).warnings == ()  # nobody else must reach it


def test_a_name_with_no_address_here_cannot_be_hosted() -> None:
    with pytest.raises(ConfigError, match=r"gateway resolves here to 10\.0\.0\.1, none of them"):
        listen("gateway")


@pytest.mark.parametrize(
    ("value", "hosts", "connect"),
    [
        ("0.0.0.0", ("0.0.0.0",), "node07"),
        ("::", ("::",), "node07"),
        ("*", ("0.0.0.0", "::"), "node07"),
        ("10.0.0.8", ("10.0.0.8",), "10.0.0.8"),
        ("node08", ("10.0.0.8", "fd00::8"), "10.0.0.8"),
    ],
)
def test_store_bind_asks_for_other_addresses(
    value: str, hosts: tuple[str, ...], connect: str
) -> None:
    got = listen("node07", store_bind=value)
    assert (got.hosts, got.connect, got.warnings) == (hosts, connect, ())
    with pytest.raises(ConfigError, match="store_bind=gateway: not an address of this machine"):
        listen("node07", store_bind="gateway")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (LaunchConfig(standalone=True), "--standalone keeps the store on 127.0.0.1"),
        (LaunchConfig(rdzv_backend="etcd", rdzv_endpoint="e:2379"), "only for the c10d"),
    ],
)
def test_store_bind_is_refused_where_it_cannot_apply(config: LaunchConfig, message: str) -> None:
    config = LaunchConfig(**{**config.__dict__, "rdzv_configs": {"store_bind": "0.0.0.0"}})
    with pytest.raises(ConfigError, match=message):
        resolve(config)
