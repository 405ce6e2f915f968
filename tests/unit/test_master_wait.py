"""A rank other than 0 connects to rank 0's store as soon as it listens
(``elastrun/worker/_master.py``), instead of after torch's connect backoff."""

from __future__ import annotations

import datetime
import socket
import threading
import types
from typing import Any

from elastrun.worker import _master


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_wait_listening_sees_a_listener_and_gives_up_at_its_timeout() -> None:
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        assert _master.wait_listening("127.0.0.1", srv.getsockname()[1], 5.0)
    assert not _master.wait_listening("127.0.0.1", _free_port(), 0.05)


def _fake_rendezvous(calls: list[tuple[Any, ...]]) -> types.ModuleType:
    mod = types.ModuleType("fake_rendezvous")

    def _create_c10d_store(*args: Any) -> str:
        calls.append(args)
        return "store"

    mod._create_c10d_store = _create_c10d_store  # type: ignore[attr-defined]
    return mod


def test_a_rank_other_than_0_waits_for_the_listener_then_creates_its_store() -> None:
    calls: list[tuple[Any, ...]] = []
    mod = _fake_rendezvous(calls)
    _master.install(mod)
    wrapped = mod._create_c10d_store
    _master.install(mod)  # once only
    assert mod._create_c10d_store is wrapped
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    listening = threading.Timer(0.2, srv.listen)
    listening.start()
    try:
        timeout = datetime.timedelta(seconds=30)
        assert mod._create_c10d_store("127.0.0.1", port, 1, 2, timeout, True) == "store"
        # Called once the port listened, with what is left of the same timeout.
        (host, got_port, rank, world, left, libuv) = calls[0]
        assert (host, got_port, rank, world, libuv) == ("127.0.0.1", port, 1, 2, True)
        assert datetime.timedelta(seconds=1) <= left < timeout
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # it listens: the wait could not have ended before
    finally:
        listening.cancel()
        srv.close()


def test_rank_0_never_waits() -> None:
    calls: list[tuple[Any, ...]] = []
    mod = _fake_rendezvous(calls)
    _master.install(mod)
    timeout = datetime.timedelta(seconds=30)
    # Nothing listens on this port: a wait would last the whole timeout.
    assert mod._create_c10d_store("127.0.0.1", _free_port(), 0, 2, timeout) == "store"
    assert calls[0][4] == timeout
