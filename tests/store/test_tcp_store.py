"""The embedded TCP store: its command, processes racing and dying, auth, bad
bytes on its port, slow readers and reconnects. Real processes and loopback
sockets throughout."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import struct
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastrun.errors import (
    AuthenticationError,
    ProtocolError,
    RevisionCompacted,
    StoreTimeout,
    StoreUnavailable,
)
from elastrun.store import codec
from elastrun.store.base import Put
from elastrun.store.client import TcpStore
from elastrun.store.limits import StoreLimits
from elastrun.store.server import StoreServer
from tests.conftest import PYTHON, REPO
from tests.helpers import free_port
from tests.store.conftest import (
    ServerProcess,
    read_line,
    start_server_process,
    stop_process,
)


def run(coro_fn: Callable[[], Awaitable[None]], timeout: float = 60.0) -> None:
    async def main() -> None:
        async with asyncio.timeout(timeout):
            await coro_fn()

    asyncio.run(main())


def client_process(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [PYTHON, "-m", "tests.store.client_proc", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def has_ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[ServerProcess]:
    server = start_server_process()
    yield server
    stop_process(server.proc)


# -- the command ----------------------------------------------------------------
@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_serve_prints_bound_address_and_stops_on_sigterm(host: str) -> None:
    if host == "::1" and not has_ipv6():
        pytest.skip("no IPv6 loopback here")
    server = start_server_process(host=host)
    try:
        assert server.host == host and 0 < server.port < 65536

        async def body() -> None:
            store = await TcpStore.connect(host, server.port, timeout=10)
            await store.put("k", b"v")
            kv = await store.get("k")
            assert kv is not None and kv.value == b"v"
            await store.close()

        run(body)
        os.kill(server.proc.pid, signal.SIGTERM)
        assert server.proc.wait(10) == 0
    finally:
        stop_process(server.proc)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["serve", "--port", "http"], "--port"),
        (["serve", "--port", "70000"], "--port"),
        (["serve", "--token-file", "/nonexistent/token"], "--token-file"),
        (["bogus"], "invalid choice"),
    ],
)
def test_bad_arguments_exit_2_with_a_clear_message(args: list[str], expected: str) -> None:
    done = subprocess.run(
        [PYTHON, "-m", "elastrun", "store", *args],
        cwd=REPO,
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert expected in done.stderr


def test_port_in_use_is_a_clear_error(store_server: ServerProcess) -> None:
    done = subprocess.run(
        [PYTHON, "-m", "elastrun", "store", "serve", "--port", str(store_server.port)],
        cwd=REPO,
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 1
    assert "already in use" in done.stderr and str(store_server.port) in done.stderr


# -- processes ------------------------------------------------------------------
def test_two_client_processes_cas_race_one_winner_each_round(
    store_server: ServerProcess,
) -> None:
    prefix, rounds = f"/race/{os.getpid()}/", 20
    host, port = store_server.host, str(store_server.port)
    procs = [client_process("race", host, port, prefix, str(rounds), n) for n in ("p1", "p2")]
    try:

        async def body() -> None:
            store = await TcpStore.connect(store_server.host, store_server.port, timeout=10)
            deadline = time.monotonic() + 30
            while len((await store.get_prefix(prefix + "ready/"))[0]) < 2:
                assert time.monotonic() < deadline, "client processes never got ready"
                await asyncio.sleep(0.05)
            await store.put(prefix + "go", b"")
            await store.close()

        run(body)
        won = {}
        for name, proc in zip(("p1", "p2"), procs, strict=True):
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err
            won[name] = set(json.loads(out.strip().splitlines()[-1])["won"])
        assert won["p1"].isdisjoint(won["p2"])
        assert won["p1"] | won["p2"] == set(range(rounds))

        async def check() -> None:
            store = await TcpStore.connect(store_server.host, store_server.port, timeout=10)
            for i in range(rounds):
                kv = await store.get(f"{prefix}race/{i}")
                assert kv is not None and kv.version == 1
                assert i in won[kv.value.decode()]
            await store.close()

        run(check)
    finally:
        for proc in procs:
            stop_process(proc)


def test_sigkilled_lease_holder_keys_vanish_within_ttl(store_server: ServerProcess) -> None:
    prefix, ttl = f"/held/{os.getpid()}/", 2.0
    proc = client_process("hold", store_server.host, str(store_server.port), prefix, str(ttl))
    try:
        assert read_line(proc, 30).strip() == "ready"

        async def body() -> None:
            store = await TcpStore.connect(store_server.host, store_server.port, timeout=10)
            kvs, revision = await store.get_prefix(prefix)
            assert [kv.key for kv in kvs] == [prefix + "a", prefix + "b"]
            watch = await store.watch(prefix, prefix=True, start_revision=revision + 1)
            # the holder keeps its keys alive past the TTL ...
            await asyncio.sleep(ttl + 0.5)
            assert len((await store.get_prefix(prefix))[0]) == 2
            # ... until it is SIGKILLed (no goodbye)
            os.killpg(proc.pid, signal.SIGKILL)
            deleted: set[str] = set()
            while len(deleted) < 2:  # a bounded wait for each delete
                event = await asyncio.wait_for(watch.__anext__(), 30)
                assert event.type == "delete"
                deleted.add(event.kv.key)
            assert deleted == {prefix + "a", prefix + "b"}
            assert (await store.get_prefix(prefix))[0] == []
            await store.close()

        run(body)
    finally:
        stop_process(proc)


# -- auth -----------------------------------------------------------------------
def frame(message: dict[str, Any]) -> bytes:
    return codec.encode_frame(message)


def read_frames(sock: socket.socket, timeout: float = 5.0) -> list[dict[str, Any]]:
    """Everything the server sends until it closes the connection."""
    sock.settimeout(timeout)
    decoder = codec.FrameDecoder()
    frames: list[dict[str, Any]] = []
    with contextlib.suppress(ConnectionResetError):
        while data := sock.recv(65536):
            frames += decoder.feed(data)
    return frames


def test_wrong_or_missing_token_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("correct horse\n")
    token_file.chmod(0o600)
    server = start_server_process("--token-file", str(token_file))
    try:

        async def body() -> None:
            with pytest.raises(AuthenticationError, match="does not match"):
                await TcpStore.connect(server.host, server.port, token="wrong", timeout=5)
            with pytest.raises(AuthenticationError, match="requires a token"):
                await TcpStore.connect(server.host, server.port, timeout=5)
            # a raw client sending a write right behind a wrong hello
            with socket.create_connection((server.host, server.port), timeout=5) as sock:
                put = codec.encode_request(1, codec.PutRequest("intruder", b"x", 0))
                sock.sendall(frame(codec.hello("wrong")) + frame(put))
                replies = read_frames(sock)
            assert [(f["t"], f["code"]) for f in replies] == [("error", "auth")]
            store = await TcpStore.connect(server.host, server.port, token="correct horse")
            assert await store.get("intruder") is None
            assert (await store.get_prefix(""))[0] == []
            await store.close()

        run(body)
    finally:
        stop_process(server.proc)


# -- bounded waits --------------------------------------------------------------
def test_unreachable_store_fails_fast_naming_the_address() -> None:
    port = free_port()  # nothing listens there

    async def body() -> None:
        with pytest.raises(StoreUnavailable, match=rf"127\.0\.0\.1:{port}: connection refused"):
            await TcpStore.connect("127.0.0.1", port, timeout=1.0)

    run(body)


def test_silent_server_gives_bounded_errors() -> None:
    async def body() -> None:
        async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            data = await reader.read(65536)
            if data and b"answer-hello" in data:
                writer.write(frame({"v": 1, "t": "hello", "server_id": "x", "revision": 0}))
            await reader.read()  # then never answer anything
            writer.close()

        server = await asyncio.start_server(mute, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        # Each wait ends with the timeout's own error (never a hang: run()
        # bounds the whole body).
        with pytest.raises(StoreUnavailable, match="timed out"):
            await TcpStore.connect("127.0.0.1", port, timeout=1.0)
        store = await TcpStore.connect(
            "127.0.0.1", port, token="answer-hello", timeout=5, request_timeout=0.5
        )
        with pytest.raises(StoreTimeout, match="did not answer a get"):
            await store.get("k")
        await store.close()
        server.close()

    run(body)


# -- bad bytes on the port --------------------------------------------------------
def poke(server: ServerProcess, payload: bytes) -> list[dict[str, Any]]:
    """Send ``payload``, half-close, and read until the server hangs up."""
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
        try:
            return read_frames(sock, timeout=10)
        except ProtocolError:
            return []


def assert_server_healthy(server: ServerProcess) -> None:
    assert server.alive(), "the store process died"

    async def body() -> None:
        store = await TcpStore.connect(server.host, server.port, timeout=10)
        revision = await store.put("/fuzz/health", b"ok")
        kv = await store.get("/fuzz/health")
        assert kv is not None and kv.mod_revision == revision
        await store.close()

    run(body)


json_scalar = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
json_value = st.recursive(
    json_scalar,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
ARG_KEYS = ["key", "value", "prefix", "lease", "ttl", "watch", "start_revision"]
fuzz_request = st.fixed_dictionaries(
    {
        "v": st.just(1) | json_scalar,
        "t": st.sampled_from(["req", "hello", "events"]) | json_scalar,
        "id": st.integers(-1, 2**64) | json_scalar,
        "op": st.sampled_from(sorted(codec.OPS)) | json_scalar,
    },
    optional={
        **dict.fromkeys(ARG_KEYS, json_value),
        "compares": st.lists(json_value, max_size=2),
        "success": st.lists(json_value, max_size=2),
    },
)
FUZZ = settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@FUZZ
@given(payload=st.binary(max_size=512))
def test_random_bytes_never_hurt_the_server(fuzz_server: ServerProcess, payload: bytes) -> None:
    poke(fuzz_server, payload)
    assert fuzz_server.alive()


@FUZZ
@given(requests=st.lists(fuzz_request, min_size=1, max_size=4))
def test_malformed_requests_get_errors_not_crashes(
    fuzz_server: ServerProcess, requests: list[dict[str, Any]]
) -> None:
    payload = frame(codec.hello(None))
    for request in requests:
        with contextlib.suppress(ProtocolError, ValueError):
            payload += frame(request)
    replies = poke(fuzz_server, payload)
    assert replies and replies[0]["t"] == "hello"
    assert all(r["t"] in ("resp", "error", "events") for r in replies[1:])
    assert fuzz_server.alive()


@FUZZ
@given(data=st.data())
def test_truncated_and_oversized_frames(fuzz_server: ServerProcess, data: st.DataObject) -> None:
    whole = frame(codec.hello(None)) + frame(codec.encode_request(1, codec.PingRequest()))
    kind = data.draw(st.sampled_from(["truncated", "oversized", "lying-length"]))
    if kind == "truncated":
        payload = whole[: data.draw(st.integers(0, len(whole) - 1))]
    elif kind == "oversized":
        length = data.draw(st.integers(codec.MAX_FRAME + 1, 2**32 - 1))
        payload = frame(codec.hello(None)) + struct.pack(">I", length) + b"{" * 100
    else:
        payload = struct.pack(">I", data.draw(st.integers(1, 10_000))) + b'{"v":1}'
    replies = poke(fuzz_server, payload)
    if kind == "oversized":
        assert replies[-1]["t"] == "error" and "exceeds" in replies[-1]["message"]
    assert fuzz_server.alive()


def test_server_still_serves_after_fuzzing(fuzz_server: ServerProcess) -> None:
    poke(fuzz_server, b"\xff" * 10_000)
    poke(fuzz_server, struct.pack(">I", 20) + b"not json at all!!!!!")
    assert_server_healthy(fuzz_server)


def test_idle_handshake_is_closed_after_the_hello_deadline() -> None:
    async def body() -> None:
        async with StoreServer("127.0.0.1", 0, hello_timeout=0.3) as server:
            host, port = server.address or ("", 0)
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(frame(codec.hello(None))[:5])  # a partial hello, then silence
            data = await asyncio.wait_for(reader.read(), 5)
            replies = codec.FrameDecoder().feed(data)
            assert replies[0]["code"] == "protocol" and "hello" in replies[0]["message"]
            writer.close()
            store = await TcpStore.connect(host, port, timeout=5)  # others unaffected
            assert await store.ping() == 0
            await store.close()

    run(body)


# -- slow readers, reconnects -----------------------------------------------------
async def raw_watcher(host: str, port: int, key: str, start: int | None = None) -> Any:
    """A raw connection with one prefix watch on ``key``, answered; returns
    (reader, writer, decoder, frames read so far after the answer)."""
    reader, writer = await asyncio.open_connection(host, port)
    req = codec.encode_request(1, codec.WatchRequest(7, key, True, start))
    writer.write(frame(codec.hello(None)) + frame(req))
    decoder = codec.FrameDecoder()
    got: list[dict[str, Any]] = []
    while not any(f.get("t") == "resp" for f in got):
        got += decoder.feed(await asyncio.wait_for(reader.read(65536), 5))
    answer = next(f for f in got if f.get("t") == "resp")
    assert answer["ok"] is True, answer
    return reader, writer, decoder, got[got.index(answer) + 1 :]


def small_output_limits(stall: float = 60.0) -> StoreLimits:
    return StoreLimits(output_high_water=256 * 1024, stall_timeout=stall)


def test_a_watcher_that_never_reads_holds_bounded_output_and_is_dropped() -> None:
    async def body() -> None:
        # The stall timeout: longer than the puts below take on a loaded machine.
        limits = small_output_limits(stall=8.0)
        async with StoreServer("127.0.0.1", 0, limits=limits) as server:
            host, port = server.address or ("", 0)
            # a watcher that stops reading after its watch is set up
            _reader, writer, _, _ = await raw_watcher(host, port, "/slow/")
            store = await TcpStore.connect(host, port, timeout=5)
            watch = await store.watch("/slow/", prefix=True)
            assert server.connection_count == 2
            slow = next(c for c in server._connections if 7 in c.watches)
            value = os.urandom(48 * 1024)
            n = 200  # about 13 MB of events, base64
            peak, lagged = 0, False
            for i in range(n):
                await store.put(f"/slow/{i:04d}", value)
                assert slow.transport is not None
                peak = max(peak, slow.output_size())
                lagged = lagged or 7 in slow.lagging
            for i in range(n):  # the reading client gets every event, in order
                event = await asyncio.wait_for(watch.__anext__(), 10)
                assert event.kv.key == f"/slow/{i:04d}" and event.kv.value == value
            # What the server queued for the never-reading one stayed bounded:
            # the high-water mark plus at most one revision's frame.
            assert peak <= limits.output_high_water + 100 * 1024, peak
            assert lagged  # it fell back to catching up from history
            # and once it has not read for the stall timeout it is dropped
            deadline = time.monotonic() + 30
            while server.connection_count != 1:
                assert time.monotonic() < deadline, "the stalled watcher was not dropped"
                await asyncio.sleep(0.1)
            writer.close()
            assert await store.ping() > 0
            await store.close()

    run(body)


def test_a_slow_reader_catches_up_with_every_event_in_order() -> None:
    async def body() -> None:
        async with StoreServer("127.0.0.1", 0, limits=small_output_limits()) as server:
            host, port = server.address or ("", 0)
            store = await TcpStore.connect(host, port, timeout=5)
            first = await store.put("/c/0000", b"before")
            # One watch from the past (history replay) and one live; the
            # reader reads nothing until every write is done.
            reader, writer, decoder, got = await raw_watcher(host, port, "/c/", start=first)
            value = os.urandom(32 * 1024)
            n = 150
            for i in range(1, n):
                await store.put(f"/c/{i:04d}", value)
            await store.txn([], [Put(f"/c/t{j}", b"x") for j in range(3)])  # one revision, 3 keys
            events: list[tuple[str, int]] = []
            while True:
                for f in got:
                    assert f["t"] == "events", f
                    events += [(e["kv"]["key"], e["kv"]["mod"]) for e in f["events"]]
                if len(events) >= n + 3:
                    break
                await asyncio.sleep(0.001)  # a slow reader
                got = decoder.feed(await asyncio.wait_for(reader.read(1 << 16), 10))
            keys = [k for k, _ in events]
            assert keys == [f"/c/{i:04d}" for i in range(n)] + [f"/c/t{j}" for j in range(3)]
            revisions = [r for _, r in events]
            assert revisions == sorted(revisions) and revisions[0] == first
            writer.close()
            await store.close()

    run(body)


def test_a_watch_from_the_first_revision_gets_the_whole_history() -> None:
    async def body() -> None:
        async with StoreServer("127.0.0.1", 0) as server:
            host, port = server.address or ("", 0)
            store = await TcpStore.connect(host, port, timeout=5)
            for i in range(3):
                await store.put(f"/h/{i}", b"")
            for start in (0, 1):
                watch = await store.watch("/h/", prefix=True, start_revision=start)
                got = [(await asyncio.wait_for(watch.__anext__(), 5)).kv.key for _ in range(3)]
                assert got == ["/h/0", "/h/1", "/h/2"]
                await watch.close()
            await store.close()

    run(body)


def test_reconnect_resumes_watches_without_gaps_or_repeats() -> None:
    async def body() -> None:
        server = StoreServer("127.0.0.1", 0)
        host, port = await server.start()
        watcher = await TcpStore.connect(host, port, timeout=5)
        writer = await TcpStore.connect(host, port, timeout=5)
        watch = await watcher.watch("/r/", prefix=True)

        async def expect(*keys: str) -> None:
            for key in keys:
                event = await asyncio.wait_for(watch.__anext__(), 10)
                assert event.kv.key == key

        await writer.put("/r/1", b"")
        await expect("/r/1")
        # 1. the server drops every connection
        server.disconnect_all()
        # A write in flight when a connection drops fails (it may or may not
        # have been applied); once the client noticed, the next one reconnects.
        await asyncio.sleep(0.2)
        await writer.put("/r/2", b"")
        await watcher.put("/r/3", b"")
        await expect("/r/2", "/r/3")
        # 2. the server restarts on the same port, with its state
        engine = server.engine
        await server.stop()
        server = StoreServer("127.0.0.1", port, engine=engine)
        await server.start()
        await writer.put("/r/4", b"")
        await expect("/r/4")
        kv = await watcher.get("/r/1")
        assert kv is not None
        # 3. a fresh store on the same port: the watch cannot resume, and says so
        await server.stop()
        server = StoreServer("127.0.0.1", port)
        await server.start()
        assert await writer.get("/r/1") is None
        with pytest.raises(RevisionCompacted, match="restarted"):
            await asyncio.wait_for(watch.__anext__(), 15)
        await watcher.close()
        await writer.close()
        await server.stop()

    run(body)
