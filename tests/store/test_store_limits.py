"""The embedded store's limits against hostile and careless clients: floods of
connections that never say hello, half-sent frames, clients that never read,
huge values and answers. A real server (an ``elastrun store serve`` process
where the test measures it), real clients, raw sockets for the abusers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from elastrun.errors import LimitExceeded, RevisionCompacted, StoreError
from elastrun.store import codec
from elastrun.store.base import Get, Put
from elastrun.store.client import TcpStore
from elastrun.store.engine import Engine
from elastrun.store.limits import StoreLimits
from elastrun.store.memory import MemoryStore
from elastrun.store.server import StoreServer
from tests.conftest import PYTHON, REPO
from tests.store.abuse import (
    closed_by_server,
    connect,
    half_sent_frames,
    never_reading_watchers,
    silent_connections,
    sockets,
    vm_kib,
)
from tests.store.conftest import ServerProcess, start_server_process, stop_process

TOKEN = "correct horse battery staple"


def run(coro_fn: Callable[[], Awaitable[None]], timeout: float = 120.0) -> None:
    async def main() -> None:
        async with asyncio.timeout(timeout):
            await coro_fn()

    asyncio.run(main())


def frame(message: dict[str, object]) -> bytes:
    return codec.encode_frame(message)


@pytest.fixture
def token_server(tmp_path: Path) -> Iterator[ServerProcess]:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    server = start_server_process("--token-file", str(token_file), "--hello-timeout", "2")
    yield server
    stop_process(server.proc)


# -- floods ---------------------------------------------------------------------------
def test_a_legitimate_client_is_served_while_a_flood_is_refused(
    token_server: ServerProcess,
) -> None:
    server = token_server
    pid = server.proc.pid
    flood_done = threading.Event()
    held_lock = threading.Lock()
    all_held: list[socket.socket] = []

    def flood() -> None:
        try:
            for _ in range(2):
                with sockets() as held:
                    silent_connections(server.host, server.port, 600, held)
                    half_sent_frames(server.host, server.port, 300, held)
                    with held_lock:
                        all_held.extend(held)
                    held.clear()  # closed by the test at the end, not here
        finally:
            flood_done.set()

    async def body() -> None:
        rss_before = vm_kib(pid, "VmHWM")
        store = await TcpStore.connect(server.host, server.port, token=TOKEN, timeout=10)
        watch = await store.watch("/legit/", prefix=True)
        attacker = threading.Thread(target=flood, daemon=True)
        attacker.start()
        worst = 0.0
        newcomer: TcpStore | None = None
        i = 0
        while not flood_done.is_set() or i < 100:
            t = time.monotonic()
            revision = await store.put(f"/legit/{i}", str(i).encode())
            kv = await store.get(f"/legit/{i}")
            event = await asyncio.wait_for(watch.__anext__(), 10)
            worst = max(worst, time.monotonic() - t)
            assert kv is not None and kv.value == str(i).encode()
            assert (event.kv.key, event.kv.mod_revision) == (f"/legit/{i}", revision)
            if i == 20:  # a client that connects in the middle of the flood gets in
                newcomer = await TcpStore.connect(server.host, server.port, token=TOKEN, timeout=10)
            i += 1
            assert i < 100_000
        assert newcomer is not None and await newcomer.get("/legit/0") is not None
        print(f"legitimate client: {i} rounds, worst put+get+event {worst * 1000:.0f} ms")
        assert worst < 5.0
        growth = (vm_kib(pid, "VmHWM") - rss_before) / 1024
        print(f"store peak memory grew {growth:.1f} MB under the flood")
        assert growth < 64, f"the flood made the store grow by {growth:.0f} MB"
        # Connections that never finish their hello are closed (hello timeout 2 s).
        deadline = time.monotonic() + 15
        with held_lock:
            flood_socks = list(all_held)
        while not all(closed_by_server(s) for s in flood_socks):
            assert time.monotonic() < deadline, "abusive connections still open"
            await asyncio.sleep(0.2)
        assert await store.ping() > 0
        await newcomer.close()
        await store.close()

    try:
        run(body)
    finally:
        with held_lock:
            for sock in all_held:
                with contextlib.suppress(OSError):
                    sock.close()
    assert server.alive()


def test_watchers_that_never_read_cost_the_store_little_memory() -> None:
    """300 connections watch everything and never read while a client puts a
    1.5 MiB value 30 times: the store's peak memory (a real ``elastrun store
    serve``) grows by less than 300 MB. It grew by 545 MB when each watcher
    was queued a copy of each event of its own (and the C allocator kept the
    memory those copies left behind)."""
    server = start_server_process()
    pid = server.proc.pid

    async def puts() -> None:
        store = await TcpStore.connect(server.host, server.port, timeout=10)
        value = os.urandom(1536 * 1024)
        for _ in range(30):
            await store.put("/flood/big", value)
        assert await store.ping() > 0
        await store.close()

    try:
        with sockets() as held:
            never_reading_watchers(server.host, server.port, None, 300, held, start_revision=None)
            before = vm_kib(pid, "VmHWM")
            run(puts)
            growth = (vm_kib(pid, "VmHWM") - before) / 1024
            print(f"store peak memory grew {growth:.1f} MB")
            assert growth < 300, f"300 watchers that never read made the store grow {growth:.0f} MB"
        assert server.alive()
    finally:
        stop_process(server.proc)


def test_abuse_is_logged_in_bounded_volume(tmp_path: Path) -> None:
    log_path = tmp_path / "store.log"
    with open(log_path, "w") as err:
        proc = subprocess.Popen(
            [PYTHON, "-m", "elastrun", "store", "serve", "--port", "0", "--hello-timeout", "1"],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            start_new_session=True,
        )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        port = int(line.rsplit(":", 1)[1])
        with sockets() as held:
            silent_connections("127.0.0.1", port, 500, held)
            for sock in held[:200]:
                with contextlib.suppress(OSError):
                    sock.sendall(b"\xff" * 64)  # garbage
            time.sleep(3.0)
    finally:
        stop_process(proc)
    text = log_path.read_text()
    lines = text.splitlines()
    print(f"{len(lines)} log lines for 500 abusive connections")
    assert "Traceback" not in text
    assert 1 <= len(lines) <= 40, text[-3000:]
    assert "suppressed" in text


# -- per-connection limits (a server in this process, to look inside) ----------------
def test_connection_limits_in_all_and_per_peer() -> None:
    limits = StoreLimits(
        max_connections=30,
        max_connections_per_peer=20,
        max_pending_hello=12,
        max_pending_hello_per_peer=5,
    )

    async def body() -> None:
        async with StoreServer("127.0.0.1", 0, limits=limits) as server:
            host, port = server.address or ("", 0)
            loop = asyncio.get_running_loop()

            def flood() -> list[socket.socket]:
                held: list[socket.socket] = []
                silent_connections(host, port, 25, held)
                return held

            held = await loop.run_in_executor(None, flood)
            await asyncio.sleep(0.5)
            assert server.pending_count <= 5  # the oldest were evicted
            closed = sum(closed_by_server(s) for s in held)
            assert closed >= 20
            for s in held:
                s.close()
            # Authenticated connections from one peer: up to the per-peer limit.
            hello = frame(codec.hello(None))

            def authenticated(n: int) -> list[socket.socket]:
                out = []
                for _ in range(n):
                    s = connect(host, port)
                    s.sendall(hello)
                    s.recv(65536)  # the answer: a hello, or refused (busy)
                    out.append(s)
                return out

            await asyncio.sleep(0.3)
            peers = await loop.run_in_executor(None, authenticated, 22)
            await asyncio.sleep(0.5)
            open_ones = [s for s in peers if not closed_by_server(s)]
            assert len(open_ones) == 20
            # Others still get in, up to the total.
            stores = [await TcpStore.connect(host, port, timeout=5) for _ in range(10)]
            assert server.connection_count == 30
            with pytest.raises(StoreError, match="busy"):
                await TcpStore.connect(host, port, timeout=1)
            for s in peers:
                s.close()
            for store in stores:
                assert await store.ping() >= 0
                await store.close()

    run(body)


def test_a_frame_begun_must_be_finished_in_time() -> None:
    async def body() -> None:
        limits = StoreLimits(frame_timeout=0.5)
        async with StoreServer("127.0.0.1", 0, limits=limits) as server:
            host, port = server.address or ("", 0)
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(frame(codec.hello(None)) + struct.pack(">I", 1000) + b'{"v":1')
            data = b""
            with contextlib.suppress(ConnectionError):
                while chunk := await asyncio.wait_for(reader.read(65536), 5):
                    data += chunk
            replies = codec.FrameDecoder().feed(data)
            assert replies[0]["t"] == "hello"
            assert replies[-1]["t"] == "error" and "not completed" in replies[-1]["message"]
            writer.close()

    run(body)


def test_before_the_hello_only_a_small_frame_is_read() -> None:
    async def body() -> None:
        async with StoreServer("127.0.0.1", 0) as server:
            host, port = server.address or ("", 0)
            for payload in (
                struct.pack(">I", 5000) + b"{",  # announced too large
                struct.pack(">I", 100) + b" " * 5000,  # more bytes than a hello
            ):
                reader, writer = await asyncio.open_connection(host, port)
                writer.write(payload)
                data = await asyncio.wait_for(reader.read(65536), 5)
                reply = codec.FrameDecoder().feed(data)[0]
                assert reply["t"] == "error" and reply["code"] == "protocol", reply
                writer.close()

    run(body)


# -- values, answers, paging ------------------------------------------------------------
def test_large_prefixes_are_read_in_pages_and_too_large_answers_are_errors(
    store_server: ServerProcess,
) -> None:
    async def body() -> None:
        store = await TcpStore.connect(store_server.host, store_server.port, timeout=10)
        p = f"/pages/{os.getpid()}/"
        values = {f"{p}{i:02d}": os.urandom(1536 * 1024) for i in range(7)}  # 14 MB as base64
        for key, value in values.items():
            await store.put(key, value)
        conn = store._conn
        kvs, revision = await store.get_prefix(p)
        assert [(kv.key, kv.value) for kv in kvs] == sorted(values.items())
        assert revision >= max(kv.mod_revision for kv in kvs)
        # A txn whose answer cannot fit is refused, unapplied, with a clear error.
        with pytest.raises(LimitExceeded, match="max_response"):
            await store.txn([], [Put(p + "marker", b"1"), Get(p, prefix=True)])
        assert await store.get(p + "marker") is None
        with pytest.raises(LimitExceeded, match="max_value"):
            await store.put(p + "huge", b"x" * (1536 * 1024 + 1))
        # A client that does not page gets an error, not a dropped connection.
        with pytest.raises(LimitExceeded, match="pages"):
            await store._request(codec.RangeRequest(p), codec.RangeAnswer.from_json)
        assert store._conn is conn, "the connection was dropped"
        await store.delete(p, prefix=True)
        await store.close()

    run(body)


def test_a_paged_read_is_one_consistent_snapshot() -> None:
    async def body() -> None:
        async with StoreServer("127.0.0.1", 0) as server:
            host, port = server.address or ("", 0)
            reader = await TcpStore.connect(host, port, timeout=5)
            writer = await TcpStore.connect(host, port, timeout=5)
            for i in range(20):
                await writer.put(f"/snap/{i:02d}", b"0")
            # Undisturbed, small pages give every key.
            kvs, _ = await reader.get_prefix_paged("/snap/", page_keys=3)
            assert [kv.key for kv in kvs] == [f"/snap/{i:02d}" for i in range(20)]
            # A write between pages restarts the read: the result is never a mix.
            stop = asyncio.Event()

            async def churn() -> None:
                n = 0
                while not stop.is_set():
                    n += 1
                    await writer.put(f"/snap/{n % 20:02d}", str(n).encode())
                    await asyncio.sleep(0)

            task = asyncio.create_task(churn())
            outcomes = []
            for _ in range(5):
                try:
                    kvs, revision = await reader.get_prefix_paged("/snap/", page_keys=3)
                    assert all(kv.mod_revision <= revision for kv in kvs)
                    assert len(kvs) == 20
                    outcomes.append("snapshot")
                except StoreError as exc:
                    assert "kept changing" in str(exc)
                    outcomes.append("gave up")
            stop.set()
            await task
            print(outcomes)
            await reader.close()
            await writer.close()

    run(body)


# -- watches that fall behind -------------------------------------------------------
def test_memory_store_watch_queue_is_bounded_and_catches_up() -> None:
    async def body() -> None:
        limits = StoreLimits(watch_queue_bytes=64 * 1024)
        store = MemoryStore(engine=Engine(limits=limits))
        watch = await store.watch("/q/", prefix=True)
        value = os.urandom(10_000)
        for i in range(100):  # 1 MB of events; nobody reads
            await store.put(f"/q/{i:03d}", value)
        assert watch.queued_bytes <= 64 * 1024 + 11_000  # type: ignore[attr-defined]
        keys = [(await watch.__anext__()).kv.key for _ in range(100)]
        assert keys == [f"/q/{i:03d}" for i in range(100)]
        await store.close()

    run(body)


def test_a_watch_that_falls_behind_the_compacted_history_says_so() -> None:
    async def body() -> None:
        limits = StoreLimits(watch_queue_bytes=10_000, history_revisions=20)
        store = MemoryStore(engine=Engine(limits=limits))
        watch = await store.watch("/f/", prefix=True)
        for i in range(100):
            await store.put(f"/f/{i:03d}", b"v" * 1000)
        seen = 0
        with pytest.raises(RevisionCompacted) as info:
            while True:
                await asyncio.wait_for(watch.__anext__(), 5)
                seen += 1
        assert 0 < seen < 100 and info.value.compact_revision == 81
        await store.close()

    run(body)


def test_tcp_watch_resuming_past_compacted_history_says_so() -> None:
    async def body() -> None:
        limits = StoreLimits(history_revisions=10)
        async with StoreServer("127.0.0.1", 0, limits=limits) as server:
            host, port = server.address or ("", 0)
            watcher = await TcpStore.connect(host, port, timeout=5)
            writer = await TcpStore.connect(host, port, timeout=5)
            watch = await watcher.watch("/r/", prefix=True)
            await writer.put("/r/0", b"")
            assert (await asyncio.wait_for(watch.__anext__(), 5)).kv.key == "/r/0"
            await server.stop()  # the watcher is cut off while the writer goes on
            engine = server.engine
            for i in range(1, 30):
                engine.put(f"/r/{i}", b"")
            server2 = StoreServer("127.0.0.1", port, engine=engine)
            await server2.start()
            with pytest.raises(RevisionCompacted) as info:
                await asyncio.wait_for(watch.__anext__(), 15)
            assert info.value.compact_revision == engine.compact_revision
            await watcher.close()
            await writer.close()
            await server2.stop()

    run(body)


# -- the command's flags --------------------------------------------------------------
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-connections", "lots"], "--max-connections: expected a whole number"),
        (["--history-bytes", "0"], "--history-bytes"),
        (["--max-value-bytes", "2M"], "--max-value-bytes"),
        (["--hello-timeout", "-1"], "--hello-timeout"),
        (["--max-partial-bytes", "0"], "--max-partial-bytes"),
        (["--slow-watch-bytes", "1.5M"], "--slow-watch-bytes"),
    ],
)
def test_serve_refuses_bad_limits(flags: list[str], message: str) -> None:
    done = subprocess.run(
        [PYTHON, "-m", "elastrun", "store", "serve", "--port", "0", *flags],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr


def test_serve_takes_limits_and_enforces_them(tmp_path: Path) -> None:
    server = start_server_process("--max-value-bytes", "1K", "--max-connections-per-peer", "3")

    async def body() -> None:
        store = await TcpStore.connect(server.host, server.port, timeout=10)
        await store.put("/k", b"x" * 1024)
        with pytest.raises(LimitExceeded, match="1024 bytes"):
            await store.put("/k", b"x" * 1025)
        others = [await TcpStore.connect(server.host, server.port, timeout=5) for _ in range(2)]
        with pytest.raises(StoreError, match="busy"):
            await TcpStore.connect(server.host, server.port, timeout=1)
        for s in [store, *others]:
            await s.close()

    try:
        run(body)
    finally:
        stop_process(server.proc)
