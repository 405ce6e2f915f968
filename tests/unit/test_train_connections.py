"""Shutting down the connections a rank opened in its function (train/connections.py)."""

from __future__ import annotations

import socket
import sys
import threading

import pytest

from elastrun.train import connections

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/fd")


def pair(listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection(listener.getsockname()[:2])
    server, _ = listener.accept()
    return client, server


def test_only_the_connections_opened_since_the_snapshot_are_shut_down() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    old_client, old_server = pair(listener)
    spared = connections.snapshot()
    new_client, new_server = pair(listener)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(new_client.recv(1)))
    reader.start()  # a blocked wait, as a store's or a collective's
    try:
        assert connections.shut_down(spared) == 2  # the new pair's two ends
        reader.join(timeout=60)
        assert got == [b""]  # the wait ended: end-of-file
        # The older connection and the listener still work; no descriptor was closed.
        old_client.sendall(b"x")
        assert old_server.recv(1) == b"x"
        third_client, third_server = pair(listener)
        third_client.close()
        third_server.close()
        assert new_client.fileno() >= 0 and new_server.fileno() >= 0
    finally:
        for s in (listener, old_client, old_server, new_client, new_server):
            s.close()
