"""The one process helper (a zombie is dead) and the test helpers' ports."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys

import pytest

from elastrun.procs import pid_alive, signal_name
from tests.helpers import free_port, free_ports, wait_for


def test_a_zombie_is_dead_and_a_running_process_alive() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert pid_alive(proc.pid)
        proc.kill()
        # Not reaped yet: a zombie, which runs nothing.
        wait_for(lambda: not pid_alive(proc.pid), 10, "the killed child to be a zombie")
        with open(f"/proc/{proc.pid}/stat", encoding="ascii") as f:
            assert f.read().rsplit(")", 1)[1].split()[0] == "Z"
    finally:
        proc.kill()
        proc.wait(10)
    assert not pid_alive(proc.pid)
    assert not pid_alive(0) and not pid_alive(-1)


def test_signal_names() -> None:
    assert signal_name(signal.SIGKILL) == "SIGKILL"
    assert signal_name(200) == "200"
    assert signal_name(signal.SIGRTMIN + 5) == "SIGRTMIN+5"  # not "39"
    assert signal_name(signal.SIGRTMIN) == "SIGRTMIN"


def test_a_held_port_is_not_handed_out_again_but_a_server_can_listen_on_it() -> None:
    port = free_port()
    assert len({*free_ports(5), port}) == 6
    # The port is taken as far as the kernel is concerned (so bind(0) and
    # outgoing connections never get it) ...
    with socket.socket() as plain, pytest.raises(OSError, match="in use"):
        plain.bind(("127.0.0.1", port))
    # ... and nothing answers there until a server listens.
    with socket.socket() as probe, pytest.raises(ConnectionRefusedError):
        probe.connect(("127.0.0.1", port))

    async def serve() -> None:
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", port)
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            with pytest.raises(OSError):  # a second server finds it in use
                await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", port)
        finally:
            server.close()
            await server.wait_closed()

    asyncio.run(serve())


def test_wait_for_is_bounded_and_names_what_it_waited_for() -> None:
    calls: list[int] = []

    def never() -> None:
        calls.append(1)

    with pytest.raises(AssertionError, match="waiting for godot"):
        wait_for(never, 0.2, "godot", interval=0.05)
    # It asked again and again, then gave up: each wait is at least the interval,
    # so at most 0.2 s / 0.05 s + 2 asks (a slow machine only makes them fewer)
    assert 2 <= len(calls) <= 6
    assert wait_for(lambda: "x", 1, "x") == "x"
