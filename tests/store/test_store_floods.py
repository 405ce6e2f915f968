"""Floods of the embedded store by a client that has said hello (no token
needed, or a stolen one): half-sent frames, and watchers that never read.
What the store holds for them is bounded in all, not only per connection, and
a legitimate client keeps being served while they run.

A server in this process (to read its :meth:`StoreServer.stats`), with its
limits scaled down so that the floods are small and fast; the full-size
floods against a real store process are ``python -m bench.store_floods``.
The abusers are raw sockets bound to 127.0.0.2 (tests/store/abuse.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from elastrun.errors import WatchCancelled
from elastrun.store import codec
from elastrun.store.client import TcpStore
from elastrun.store.limits import StoreLimits
from elastrun.store.server import StoreServer
from elastrun.store.server_output import CHUNK
from tests.store.abuse import (
    closed_by_server,
    half_frames_after_hello,
    never_reading_watchers,
    say_hello,
    served_while,
    sockets,
)

KiB = 1024
MiB = 1024 * KiB
# What the server may read past a budget before it notices: one read of the
# event loop's transport (256 KiB).
ONE_READ = 256 * KiB


def run(coro_fn: Callable[[], Awaitable[None]], timeout: float = 120.0) -> None:
    async def main() -> None:
        async with asyncio.timeout(timeout):
            await coro_fn()

    asyncio.run(main())


async def wait_until(check: Callable[[], bool], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


def test_half_sent_frames_after_the_hello_are_bounded_in_all() -> None:
    limits = StoreLimits(max_partial_bytes=2 * MiB, frame_timeout=5.0)

    async def body() -> None:
        async with StoreServer("127.0.0.1", 0, limits=limits) as server:
            host, port = server.address or ("", 0)
            loop = asyncio.get_running_loop()
            store = await TcpStore.connect(host, port, timeout=10)
            flooding = threading.Event()
            flooding.set()

            with sockets() as held:

                def flood() -> int:
                    try:  # 40 frames of 1 MiB less one byte: 40 MiB against a 2 MiB budget
                        return half_frames_after_hello(host, port, 40, held, size=MiB, within=20)
                    finally:
                        flooding.clear()

                attack = loop.run_in_executor(None, flood)
                rounds, _ = await served_while(store, flooding, "/legit/")
                sent = await attack
                assert sent > 10 * MiB  # the store kept reading: the flood was not just refused
                # What the kernel still holds reaches the store: the oldest frames are closed.
                await wait_until(lambda: server.stats().closed_partial >= 30, 10, "few closed")
                stats = server.stats()
                print(f"{sent / MiB:.0f} MiB sent by the flood; {rounds} rounds served; {stats}")
                assert stats.partial_peak <= limits.max_partial_bytes + ONE_READ
                # A legitimate large frame still gets in: the oldest half-sent frames make room.
                value = os.urandom(1536 * KiB)
                await store.put("/legit/big", value)
                kv = await store.get("/legit/big")
                assert kv is not None and kv.value == value
                # What is left is closed at the frame timeout; nothing stays held.
                await wait_until(
                    lambda: all(closed_by_server(s) for s in held), 15, "flood still connected"
                )
                await wait_until(lambda: server.stats().partial_bytes == 0, 5, "bytes still held")
                assert server.stats().partial_peak <= limits.max_partial_bytes + ONE_READ
            assert await store.ping() > 0
            await store.close()

    run(body)


def test_watchers_that_never_read_are_cancelled_and_hold_one_copy_of_each_event() -> None:
    """30 connections watch everything and never read while 12 values of
    200 KiB are put: each watch is cancelled as slow, and what the store
    holds for all of them is about one event's frame (its encoded events are
    queued by reference, the same bytes for every watch), not one copy per
    watcher. A watcher that reads at last gets its events, then the cancel."""
    limits = StoreLimits(output_high_water=64 * KiB, max_output_bytes=2 * MiB, slow_watch_bytes=MiB)
    value = os.urandom(200 * KiB)  # about 270 KiB as an event frame
    frame = len(codec.encode_frame(codec.encode_events(1, []))) + len(value) * 4 // 3 + 200

    async def body() -> None:
        async with StoreServer("127.0.0.1", 0, limits=limits) as server:
            host, port = server.address or ("", 0)
            loop = asyncio.get_running_loop()
            store = await TcpStore.connect(host, port, timeout=10)
            with sockets() as held:
                # 30 connections watch everything and never read (the last one
                # reads at the end, with a receive buffer not too small to read fast).
                await loop.run_in_executor(None, never_reading_watchers, host, port, None, 29, held)
                late = await loop.run_in_executor(None, _watcher, host, port)
                held.append(late)
                await wait_until(lambda: server.connection_count == 31, 10, "watchers not in")
                flooding = threading.Event()
                flooding.set()
                revisions: list[int] = []

                async def writes() -> None:
                    try:
                        for i in range(12):  # 12 x 270 KiB to each of 30 watchers: 97 MB
                            revisions.append(await store.put(f"/big/{i}", value))
                            await asyncio.sleep(0.05)
                    finally:
                        flooding.clear()

                writer = asyncio.create_task(writes())
                rounds, _ = await served_while(store, flooding, "/legit/")
                await writer
                await wait_until(
                    lambda: server.stats().slow_watches >= 30,
                    10,
                    f"watchers not cancelled: {server.stats()}",
                )
                stats = server.stats()
                print(f"{rounds} rounds served; {stats}")
                # One copy of a frame or two for all of them (a copy each was 30 x 270
                # KiB, past the 2 MiB budget), and a chunk each of their own at most.
                assert stats.output_peak <= 2 * frame + 30 * (CHUNK + KiB), stats
                assert stats.closed_output == 0 and stats.slow_watches == 30
                # A watcher that reads at last: its events, in order, then the cancel.
                got = await loop.run_in_executor(None, _frames_until_cancel, late)
                cancel = got[-1]
                assert cancel["code"] == "slow" and "slow_watch_bytes" in cancel["message"]
                events = [
                    codec.decode_event(e) for f in got if f["t"] == "events" for e in f["events"]
                ]
                seen = [e.kv.mod_revision for e in events]
                assert seen == sorted(seen) and seen[-1] < cancel["next_revision"]
                big = [e.kv.mod_revision for e in events if e.kv.key.startswith("/big/")]
                assert big == [r for r in revisions if r < cancel["next_revision"]]
            assert await store.ping() > 0
            await store.close()

    run(body)


def _watcher(host: str, port: int) -> socket.socket:
    """A connection watching everything, that reads only when told."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * KiB)
    sock.settimeout(10)
    sock.bind(("127.0.0.2", 0))
    sock.connect((host, port))
    say_hello(sock, None)
    watch = codec.encode_request(1, codec.WatchRequest(30, "", True))
    sock.sendall(codec.encode_frame(watch))
    return sock


def _frames_until_cancel(sock: socket.socket) -> list[dict[str, Any]]:
    """Read ``sock``'s frames (at most 1000) up to its first ``cancel``."""
    decoder = codec.FrameDecoder()
    got: list[dict[str, Any]] = []
    while len(got) < 1000:
        data = sock.recv(65536)
        assert data, f"closed before a cancel; got {got}"
        got.extend(decoder.feed(data))
        if any(f.get("t") == "cancel" for f in got):
            return got[: 1 + next(i for i, f in enumerate(got) if f.get("t") == "cancel")]
    raise AssertionError("no cancel")


def test_a_slow_watch_is_cancelled_with_the_revision_to_resume_from() -> None:
    """A real client that stops reading: its watch delivers every event it
    was sent, then ends with WatchCancelled naming the first revision it
    missed; the rest of the client's connection keeps working."""
    limits = StoreLimits(output_high_water=64 * KiB, slow_watch_bytes=MiB)

    async def body() -> None:
        async with StoreServer("127.0.0.1", 0, limits=limits) as server:
            host, port = server.address or ("", 0)
            reader = await TcpStore.connect(host, port, timeout=10)
            writer = await TcpStore.connect(host, port, timeout=10)
            watch = await reader.watch("/slow/", prefix=True)
            conn = reader._conn
            assert conn is not None
            transport = conn.writer.transport
            assert isinstance(transport, asyncio.Transport)
            transport.pause_reading()  # the client stops reading
            revisions = [await writer.put(f"/slow/{i}", os.urandom(200 * KiB)) for i in range(12)]
            await wait_until(lambda: server.stats().slow_watches == 1, 10, "not cancelled")
            transport.resume_reading()
            seen: list[int] = []
            try:
                async with asyncio.timeout(10):
                    async for event in watch:
                        seen.append(event.kv.mod_revision)
                raise AssertionError("the watch ended without an error")
            except WatchCancelled as exc:
                print(f"delivered {len(seen)} of 12, then: {exc}")
                assert seen == revisions[: len(seen)]
                assert exc.next_revision == revisions[len(seen)]
                assert "slow_watch_bytes" in str(exc)
            assert reader._conn is conn, "the connection was dropped"
            assert await reader.get("/slow/0") is not None
            with contextlib.suppress(Exception):
                await watch.close()
            await reader.close()
            await writer.close()

    run(body)


def test_a_client_that_does_not_read_its_answers_is_closed_to_make_room() -> None:
    """Answers count too: connections that ask for large values and never
    read them hold at most the output budget; a client that reads is served."""
    limits = StoreLimits(output_high_water=64 * KiB, max_output_bytes=2 * MiB)

    async def body() -> None:
        async with StoreServer("127.0.0.1", 0, limits=limits) as server:
            host, port = server.address or ("", 0)
            loop = asyncio.get_running_loop()
            store = await TcpStore.connect(host, port, timeout=10)
            await store.put("/v", os.urandom(600 * KiB))
            hello = codec.encode_frame(codec.hello(None))
            get = b"".join(
                codec.encode_frame(codec.encode_request(i, codec.GetRequest("/v")))
                for i in range(1, 5)
            )

            def flood(held: list[socket.socket]) -> None:
                for _ in range(20):  # 20 x 600 KiB+ answers nobody reads
                    s = socket.create_connection((host, port), source_address=("127.0.0.2", 0))
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                    held.append(s)
                    s.sendall(hello + get)

            with sockets() as held:
                await loop.run_in_executor(None, flood, held)
                await wait_until(lambda: server.stats().closed_output >= 10, 10, "none closed")
                kv = await store.get("/v")
                assert kv is not None and len(kv.value) == 600 * KiB
                stats = server.stats()
                print(stats)
                assert stats.output_peak <= limits.max_output_bytes + 900 * KiB
            await store.close()

    run(body)
