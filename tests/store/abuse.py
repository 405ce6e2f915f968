"""Hostile clients of the embedded store, and its memory under each.

Used by tests/store/test_store_limits.py, and run as a script to measure the
peak memory (VmHWM) of a real ``elastrun store serve`` process under each
abuse scenario, each on a fresh server (the figures in docs/reliability.md)::

    python -m tests.store.abuse

Every hostile socket here is a plain blocking socket of this process, bound
to a loopback source address of its own (127.0.0.2 by default) so that the
store's per-peer limits apply to it and not to the legitimate client.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from elastrun.store import codec
from elastrun.store.client import TcpStore

ABUSER = "127.0.0.2"
MiB = 1024 * 1024


def vm_kib(pid: int, field: str) -> int:
    """``VmRSS`` or ``VmHWM`` (KiB) of a process."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def connect(host: str, port: int, source: str = ABUSER, timeout: float = 5.0) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=timeout, source_address=(source, 0))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # hold little for the server
    return sock


@contextlib.contextmanager
def sockets() -> Iterator[list[socket.socket]]:
    held: list[socket.socket] = []
    try:
        yield held
    finally:
        for sock in held:
            with contextlib.suppress(OSError):
                sock.close()


def silent_connections(host: str, port: int, n: int, held: list[socket.socket]) -> None:
    """``n`` connections that never say anything."""
    for _ in range(n):
        with contextlib.suppress(OSError):
            held.append(connect(host, port))


def half_sent_frames(host: str, port: int, n: int, held: list[socket.socket]) -> None:
    """``n`` connections that announce a frame (a hello of 4000 bytes, the
    most the store accepts before a hello) and send half of it; and ``n``
    that announce a 4 MiB frame and send 64 KiB of it."""
    for _ in range(n):
        with contextlib.suppress(OSError):
            sock = connect(host, port)
            held.append(sock)
            sock.sendall(struct.pack(">I", 4000) + b'{"v":1,"t":"hello","token":"' + b"x" * 2000)
        with contextlib.suppress(OSError):
            sock = connect(host, port)
            held.append(sock)
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.send(struct.pack(">I", 4 * MiB) + b"{" * (64 * 1024))


def big_frames_before_hello(
    host: str, port: int, n: int, held: list[socket.socket], size: int = 4 * MiB
) -> int:
    """``n`` connections that each start a frame of ``size`` bytes before any
    hello and push as much of it as the store takes within 30 s. Returns the
    bytes the store accepted in all."""
    data = memoryview(struct.pack(">I", size) + b"{" + b" " * (size - 1))
    pending: dict[socket.socket, memoryview] = {}
    for _ in range(n):
        with contextlib.suppress(OSError):
            sock = connect(host, port)
            sock.setblocking(False)
            held.append(sock)
            pending[sock] = data
    return push(pending, 30.0)


def half_frames_after_hello(
    host: str,
    port: int,
    n: int,
    held: list[socket.socket],
    *,
    token: str | None = None,
    size: int = 4 * MiB,
    short: int = 1,
    within: float = 30.0,
) -> int:
    """``n`` connections that say hello (with ``token``) and get the store's
    answer, then each announce a frame of ``size`` bytes and send all of it but
    its last ``short`` bytes, as much as the store takes within ``within``
    seconds. Returns the bytes of those frames the store accepted in all."""
    frame = memoryview(struct.pack(">I", size) + b"{" + b" " * (size - 1 - short))
    pending: dict[socket.socket, memoryview] = {}
    for _ in range(n):
        with contextlib.suppress(OSError):
            sock = connect(host, port)
            held.append(sock)
            say_hello(sock, token)
            sock.setblocking(False)
            pending[sock] = frame
    return push(pending, within)


def say_hello(sock: socket.socket, token: str | None) -> None:
    """Send a hello on ``sock`` and read the store's answer (OSError if it
    is not a hello: refused, or no answer within the socket's timeout)."""
    sock.sendall(codec.encode_frame(codec.hello(token)))
    decoder = codec.FrameDecoder()
    while True:
        data = sock.recv(4096)
        if not data:
            raise ConnectionResetError("closed by the store before its hello")
        frames = decoder.feed(data)
        if frames:
            if frames[0].get("t") != "hello":
                raise ConnectionRefusedError(f"the store answered {frames[0]}")
            return


def push(pending: dict[socket.socket, memoryview], within: float) -> int:
    """Send each socket its bytes, round robin, without blocking, for at most
    ``within`` seconds; a socket the store closed is dropped. Returns the
    bytes sent in all."""
    sent = 0
    deadline = time.monotonic() + within
    while pending and time.monotonic() < deadline:
        progress = False
        for sock, data in list(pending.items()):
            try:
                k = sock.send(data[: 1 << 20])
            except BlockingIOError:
                continue
            except OSError:  # closed by the store
                del pending[sock]
                continue
            sent += k
            progress = progress or k > 0
            if k == len(data):
                del pending[sock]
            else:
                pending[sock] = data[k:]
        if not progress:
            time.sleep(0.05)
    return sent


def closed_by_server(sock: socket.socket) -> bool:
    """True once the server closed ``sock`` (end of file or a reset)."""
    sock.setblocking(False)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def never_reading_watchers(
    host: str,
    port: int,
    token: str | None,
    n: int,
    held: list[socket.socket],
    start_revision: int | None = 1,
) -> None:
    """``n`` authenticated connections, each watching everything from
    ``start_revision`` (None: from now on), that never read a byte after the
    store's hello."""
    for i in range(n):
        sock = connect(host, port)
        held.append(sock)
        say_hello(sock, token)
        watch = codec.encode_request(1, codec.WatchRequest(i + 1, "", True, start_revision))
        sock.sendall(codec.encode_frame(watch))


async def served_while(
    store: TcpStore, flooding: threading.Event, prefix: str, *, at_least: int = 20
) -> tuple[int, float]:
    """Puts, gets and a watch of a legitimate client, one round after the
    other, until ``flooding`` is cleared and at least ``at_least`` rounds are
    done: each put must be read back and seen by the watch, in order. Returns
    the rounds done (bounded: 100 000) and the slowest round's seconds."""
    watch = await store.watch(prefix, prefix=True)
    rounds, worst = 0, 0.0
    try:
        while flooding.is_set() or rounds < at_least:
            start = time.monotonic()
            key = f"{prefix}{rounds}"
            revision = await store.put(key, str(rounds).encode())
            kv = await store.get(key)
            assert kv is not None and kv.value == str(rounds).encode()
            event = await asyncio.wait_for(watch.__anext__(), 10)
            assert (event.kv.key, event.kv.mod_revision) == (key, revision)
            worst = max(worst, time.monotonic() - start)
            rounds += 1
            assert rounds < 100_000
    finally:
        await watch.close()
    return rounds, worst


async def overwrite(store: TcpStore, key: str, size: int, times: int) -> int:
    """Put ``times`` values of ``size`` bytes under ``key``, then delete it;
    returns how many puts were accepted."""
    value = os.urandom(size)
    accepted = 0
    for _ in range(times):
        try:
            await store.put(key, value)
            accepted += 1
        except Exception:
            pass
    await store.delete(key)
    return accepted


# -- the measurement ----------------------------------------------------------------
def _measure(name: str, scenario: Callable[[str, int, int, str], str]) -> None:
    from tests.store.conftest import start_server_process, stop_process

    token_file = Path(f"/tmp/elastrun-abuse-token-{os.getpid()}")
    token_file.write_text("s3cret-token")
    token_file.chmod(0o600)
    server = start_server_process("--token-file", str(token_file))
    try:
        pid = server.proc.pid
        time.sleep(0.5)
        before = vm_kib(pid, "VmHWM")
        note = scenario(server.host, server.port, pid, "s3cret-token")
        time.sleep(1.0)
        peak = vm_kib(pid, "VmHWM")
        alive = "alive" if server.alive() else "DEAD"
        print(
            f"| {name} | {before / 1024:.0f} MB | {peak / 1024:.0f} MB | "
            f"+{(peak - before) / 1024:.0f} MB | {note}; server {alive} |",
            flush=True,
        )
    finally:
        stop_process(server.proc)
        token_file.unlink(missing_ok=True)


def _silent(host: str, port: int, pid: int, token: str) -> str:
    with sockets() as held:
        silent_connections(host, port, 600, held)
        time.sleep(1.0)
        closed = sum(closed_by_server(s) for s in held)
        return f"{len(held)} opened, {closed} closed by the store at once"


def _big(host: str, port: int, pid: int, token: str) -> str:
    with sockets() as held:
        sent = big_frames_before_hello(host, port, 600, held)
        time.sleep(1.0)
        closed = sum(closed_by_server(s) for s in held)
        return f"{sent / MiB:.0f} MiB accepted from 600 connections, {closed} closed by the store"


def _half(host: str, port: int, pid: int, token: str) -> str:
    with sockets() as held:
        half_sent_frames(host, port, 300, held)
        time.sleep(1.0)
        closed = sum(closed_by_server(s) for s in held)
        return f"{len(held)} opened, {closed} closed by the store at once"


def _overwrites(size: int) -> Callable[[str, int, int, str], str]:
    def run(host: str, port: int, pid: int, token: str) -> str:
        async def body() -> int:
            store = await TcpStore.connect(host, port, token=token)
            try:
                return await overwrite(store, "/abuse/big", size, 300)
            finally:
                await store.close()

        accepted = asyncio.run(body())
        return f"{accepted} of 300 puts accepted"

    return run


def _watchers(host: str, port: int, pid: int, token: str) -> str:
    async def fill() -> None:
        store = await TcpStore.connect(host, port, token=token)
        try:
            await overwrite(store, "/abuse/big", 1536 * 1024, 30)
        finally:
            await store.close()

    asyncio.run(fill())
    with sockets() as held:
        never_reading_watchers(host, port, token, 10, held)
        time.sleep(3.0)
        return "10 watchers from revision 1 over 30 values of 1.5 MiB, never reading"


def main() -> None:
    print("| scenario | VmHWM before | VmHWM after | growth | what happened |")
    print("|---|---|---|---|---|")
    _measure("600 connections, no hello", _silent)
    _measure("600 connections each sending a 4 MiB frame before its hello", _big)
    _measure("300 half-sent hellos + 300 announced 4 MiB frames", _half)
    _measure("300 overwrites of a 3 MB key, then delete", _overwrites(3_000_000))
    _measure("300 overwrites of a 1.5 MiB key, then delete", _overwrites(1536 * 1024))
    _measure("10 never-reading watchers from revision 1", _watchers)


if __name__ == "__main__":
    main()
