"""One endpoint type: every reader parses the same way and writes the same way."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastrun.endpoint import Endpoint, format_endpoints, parse_endpoint_list
from elastrun.errors import ConfigError
from elastrun.launcher.config import LaunchConfig
from elastrun.launcher.plan import resolve
from elastrun.store.factory import parse_endpoint as store_parse


def launcher_parse(text: str) -> Endpoint:
    """The embedded store's endpoint as the launcher reads --rdzv-endpoint."""
    config = LaunchConfig(rdzv_backend="c10d", rdzv_endpoint=text)
    return resolve(config).endpoints[0]


@pytest.mark.parametrize(
    ("text", "expected", "written"),
    [
        ("node1", Endpoint("node1", 29400), "node1:29400"),
        (" node1:1234 ", Endpoint("node1", 1234), "node1:1234"),
        ("10.0.0.1:0", Endpoint("10.0.0.1", 0), "10.0.0.1:0"),
        ("[::1]:29500", Endpoint("::1", 29500), "[::1]:29500"),
        ("[fe80::1%eth0]", Endpoint("fe80::1%eth0", 29400), "[fe80::1%eth0]:29400"),
        ("::1", Endpoint("::1", 29400), "[::1]:29400"),
    ],
)
def test_forms_parse_and_write_back(text: str, expected: Endpoint, written: str) -> None:
    ep = Endpoint.parse(text, 29400)
    assert ep == expected
    assert str(ep) == written
    assert Endpoint.parse(str(ep), 1) == ep  # what is written parses back


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", "empty address"),
        (":80", "bad host"),
        ("host:http", "bad port 'http'"),
        ("host:70000", "bad port '70000'"),
        ("h:²", "bad port '²'"),
        ("[::1", "unclosed '['"),
        ("[::1]x", "expected [ipv6]:port"),
        ("[node1]:1", "not an IPv6 address"),
        ("a:b:c", "neither host:port nor an IPv6 address"),
        ("a b:1", "bad host"),
        ("http://h:1", "neither host:port"),
        ("h/x:1", "bad host"),
    ],
)
def test_malformed_endpoints_name_the_flag_and_the_problem(text: str, problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        Endpoint.parse(text, 29400, "--rdzv-endpoint")
    assert str(info.value).startswith("--rdzv-endpoint: "), info.value
    assert problem in str(info.value)


def test_the_launcher_and_the_store_read_an_endpoint_alike() -> None:
    """They once had parsers of their own that disagreed (port 0, brackets)."""
    for text in ("h:0", "[::1]:0", "h", "[::1]"):
        assert launcher_parse(text) == store_parse(text, 29400)
    for text in ("[x]:1", "h:65536", "a:b:c"):
        with pytest.raises(ConfigError):
            launcher_parse(text)
        with pytest.raises(ConfigError):
            store_parse(text, 29400)


def test_lists_take_schemes_and_refuse_empty_entries() -> None:
    eps, https = parse_endpoint_list("http://a:1, https://b/,[::1]:3,::2", 2379)
    assert eps == (Endpoint("a", 1), Endpoint("b", 2379), Endpoint("::1", 3), Endpoint("::2", 2379))
    assert https
    assert format_endpoints(eps) == "a:1,b:2379,[::1]:3,[::2]:2379"
    assert parse_endpoint_list("a", 2379) == ((Endpoint("a", 2379),), False)
    with pytest.raises(ConfigError, match="empty entry"):
        parse_endpoint_list("a:1,,b", 2379)
    with pytest.raises(ConfigError, match="must be http or https"):
        parse_endpoint_list("ftp://a:1", 2379)


def test_etcd_refuses_port_0_and_the_embedded_store_takes_it() -> None:
    pytest.importorskip("httpx")
    from elastrun.store.etcd_conn import settings_from_options
    from elastrun.store.etcd_options import EtcdOptions

    assert store_parse("h:0") == Endpoint("h", 0)  # the store's host picks a free port
    for given_as in ("h:0", (Endpoint("h", 0),)):
        with pytest.raises(ConfigError, match="port 0"):
            settings_from_options(given_as, EtcdOptions())


def test_etcd_https_comes_from_the_scheme_or_the_protocol_key() -> None:
    pytest.importorskip("httpx")
    from elastrun.store.etcd_conn import settings_from_options
    from elastrun.store.etcd_options import EtcdOptions

    assert settings_from_options("https://h:1", EtcdOptions()).https
    assert not settings_from_options((Endpoint("h", 1),), EtcdOptions()).https
    assert settings_from_options((Endpoint("h", 1),), EtcdOptions(protocol="https")).https


hosts = st.one_of(
    st.from_regex(r"[a-z][a-z0-9.-]{0,20}", fullmatch=True),
    st.ip_addresses(v=4).map(str),
    st.ip_addresses(v=6).map(str),
)


@given(host=hosts, port=st.integers(0, 65535))
def test_any_endpoint_written_parses_back(host: str, port: int) -> None:
    ep = Endpoint(host, port)
    assert Endpoint.parse(str(ep), 1) == ep
    if ":" in host:
        assert ipaddress.IPv6Address(host)
        assert str(ep).startswith("[")
