"""``--rdzv-backend`` and ``--rdzv-conf`` read once, the same way by the
launcher and by ``elastrun status``: every backend alias in one table
(``store.factory.Backend``), the store's options typed (``StoreOptions``)."""

from __future__ import annotations

import pytest

from elastrun.errors import ConfigError
from elastrun.launcher.rdzv_conf import parse_rdzv_conf
from elastrun.store.etcd_conn import settings_from_options
from elastrun.store.etcd_options import EtcdOptions
from elastrun.store.factory import Backend


class Started(Exception):
    """``elastrun status`` got past reading its flags."""


def _status(argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys) -> tuple[int, str, object]:
    from elastrun.status import cli

    seen: list[object] = []

    def reached(args: object) -> int:
        seen.append(args)
        raise Started

    monkeypatch.setattr(cli, "_main", reached)
    try:
        code = cli.main(argv)
    except Started:
        code = -1
    return code, capsys.readouterr().err, seen[0] if seen else None


@pytest.mark.parametrize(
    ("name", "backend"),
    [
        ("c10d", Backend.C10D),
        ("TCP", Backend.C10D),
        ("etcd", Backend.ETCD),
        ("etcd-v2", Backend.ETCD),
        ("etcd_v2", Backend.ETCD),
    ],
)
def test_status_takes_every_alias_the_launcher_takes(
    name: str, backend: Backend, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    assert Backend.parse(name) is backend
    argv = [f"--rdzv-backend={name}", "--rdzv-endpoint=127.0.0.1:1", "--rdzv-id=j"]
    code, err, args = _status(argv, monkeypatch, capsys)
    assert code == -1, err
    assert getattr(args, "backend", None) is backend


def test_status_reads_rdzv_conf_as_the_launcher_does(
    monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    base = ["--rdzv-backend=etcd", "--rdzv-endpoint=127.0.0.1:1", "--rdzv-id=j"]
    # A job's --rdzv-conf pasted as is (torchrun's quotes included): its etcd options typed.
    conf = "'key_prefix=/jobs/,user=u,password=p,join_timeout=60,is_host=1'"
    code, err, args = _status([*base, f"--rdzv-conf={conf}"], monkeypatch, capsys)
    assert code == -1, err
    options = getattr(args, "options", None)
    assert options is not None
    assert options.etcd == EtcdOptions(key_prefix="/jobs/", user="u", password="p")
    assert options.etcd == parse_rdzv_conf(conf).etcd_options()
    # A value the launcher refuses is refused here too, before any store is reached.
    for bad, flag in (("join_timeout=-5", "join_timeout"), ("jion_timeout=5", "jion_timeout")):
        code, err, _ = _status([*base, f"--rdzv-conf={bad}"], monkeypatch, capsys)
        assert code == 2, err
        assert err.startswith("elastrun status: error: --rdzv-conf") and flag in err, err
        with pytest.raises(ConfigError, match=flag):
            parse_rdzv_conf(bad)


def test_etcd_options_reach_the_store_as_given() -> None:
    conf = parse_rdzv_conf("cacert=ca.pem,key_prefix=/p/,protocol=https,token=t")
    options = conf.etcd_options()
    assert options == EtcdOptions(cacert="ca.pem", key_prefix="/p/", protocol="https")
    # The etcd store reads them typed (no dict of strings in between).
    settings = settings_from_options("h:2379", EtcdOptions(key_prefix="/p/", protocol="https"))
    assert settings.https and settings.key_prefix == "/p/"


def test_an_overlong_rdzv_conf_item_is_shown_cut() -> None:
    with pytest.raises(ConfigError) as err:
        parse_rdzv_conf("9" * 5000)
    assert len(str(err.value)) < 300 and "is not key=value" in str(err.value)
