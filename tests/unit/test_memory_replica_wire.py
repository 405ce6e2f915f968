"""The replica port of the agent (agent/replica.py), on a real loopback socket:
a snapshot sent whole takes its rank's place; a transfer cut mid-way, a
stranger's garbage, an offer over a bound or with a wrong key, a header over
its bound are refused, bounded, and leave the previous replica intact; silent
strangers holding connections leave the neighbour's slot free."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from elastrun.agent.replica import (
    DEFAULT_MAX_HEADER,
    GREETING,
    HEADER_BASE,
    HEADER_PER_TENSOR,
    MAX_CONNECTIONS,
    MAX_OFFER,
    NONCE,
    Offer,
    ReplicaError,
    ReplicaHold,
    header_bound,
    replica_key,
    send_snapshot,
)
from elastrun.safefs import private_dir
from elastrun.worker.snapshot import ENV, MAGIC, SlotView, open_slot

torch = pytest.importorskip("torch")

RUN = "job1"
KEY = replica_key("secret-token", RUN)


def make_snapshot(
    tmp: Path,
    step: int,
    value: float,
    monkeypatch: pytest.MonkeyPatch,
    rank: int = 0,
    extra: Any = None,
) -> str:
    """A real memory checkpoint slot of ``rank`` at ``step`` (its state:
    one tensor, and ``extra``); its path."""
    from elastrun.train import MemoryCheckpoint

    folder = tmp / f"worker-{rank}-{step}"
    folder.mkdir(mode=0o700)
    monkeypatch.setenv(ENV, str(folder))
    monkeypatch.setenv("RANK", str(rank))
    mem = MemoryCheckpoint(log=None)
    mem.save({"w": torch.full((4096,), value), "extra": extra}, step=step)
    mem.close()
    (slot,) = [p for p in folder.iterdir() if p.name.startswith("slot-") and p.stat().st_size]
    return str(slot)


def view_of(path: str) -> SlotView:
    view = open_slot(path)
    assert view is not None
    return view


class Server:
    def __init__(self, tmp: Path, key: bytes = KEY, max_bytes: int = 1 << 30) -> None:
        folder = private_dir(str(tmp / "replica"))
        self.hold = ReplicaHold(folder, run=RUN, key=key, max_bytes=max_bytes)
        self.refused: list[str] = []
        self.received: list[tuple[int, int]] = []
        self.hold.on_refused = lambda _peer, why: self.refused.append(why)
        self.hold.on_received = lambda got: self.received.append((got.rank, got.step))
        self.port = 0

    def replica(self, rank: int) -> bytes:
        return (Path(self.hold.folder) / f"rank-{rank}").read_bytes()

    def stray(self) -> list[str]:
        return [n for n in os.listdir(self.hold.folder) if n.startswith("incoming")]


def serve(tmp: Path, body: Callable[[Server], Awaitable[None]], **kw: Any) -> Server:
    """Run ``body`` against a replica port listening on loopback."""

    async def main() -> Server:
        s = Server(tmp, **kw)
        s.port = await s.hold.serve("127.0.0.1")
        try:
            await body(s)
        finally:
            await s.hold.close()
        return s

    return asyncio.run(main())


@pytest.fixture
def snaps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, str]]:
    yield (
        make_snapshot(tmp_path, 5, 1.0, monkeypatch),
        make_snapshot(tmp_path, 10, 2.0, monkeypatch),
    )


async def send(
    server: Server,
    path: str,
    key: bytes = KEY,
    run: str = RUN,
    node: str = "node-b",
    source: str = "",
) -> None:
    view = view_of(path)
    try:
        await asyncio.to_thread(
            send_snapshot,
            ("127.0.0.1", server.port),
            view,
            run=run,
            node=node,
            key=key,
            source=source,
        )
    finally:
        view.close()


async def raw(server: Server, payload: bytes, *, close: bool = True) -> bytes:
    """What the port answers a stranger who sends ``payload``."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    hello = await asyncio.wait_for(reader.readexactly(len(GREETING) + NONCE), 10)
    assert hello.startswith(GREETING)
    writer.write(payload)
    await writer.drain()
    if close:
        writer.write_eof()
    answer = await asyncio.wait_for(reader.read(), 20)
    writer.close()
    return answer


def refusal(answer: bytes) -> str:
    (n,) = struct.unpack(">I", answer[:4])
    obj = json.loads(answer[4 : 4 + n])
    assert obj["ok"] is False
    return str(obj["error"])


def test_a_snapshot_sent_whole_is_held_as_its_rank_s_replica(
    tmp_path: Path, snaps: tuple[str, str]
) -> None:
    serve(tmp_path, lambda server: sent_whole(server, snaps))


async def sent_whole(server: Server, snaps: tuple[str, str]) -> None:
    await send(server, snaps[0])
    assert server.received == [(0, 5)]
    assert server.replica(0) == Path(snaps[0]).read_bytes()[: len(server.replica(0))]
    view = view_of(os.path.join(server.hold.folder, "rank-0"))
    with view:
        view.verify()
        assert view.header.step == 5
    await send(server, snaps[1])  # a newer step takes its place
    with view_of(os.path.join(server.hold.folder, "rank-0")) as v:
        assert v.header.step == 10
    assert server.stray() == []


def test_a_transfer_cut_mid_way_leaves_the_previous_replica_intact(
    tmp_path: Path, snaps: tuple[str, str]
) -> None:
    serve(tmp_path, lambda server: cut(server, snaps))


async def cut(server: Server, snaps: tuple[str, str]) -> None:
    await send(server, snaps[0])
    before = server.replica(0)
    view = view_of(snaps[1])
    try:
        offer = Offer(RUN, 0, 10, view.header.generation, view.size, "0" * 64, 1, "node-b")
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        hello = await reader.readexactly(len(GREETING) + NONCE)
        body = offer.signed(KEY, hello[len(GREETING) :]).encode()
        writer.write(struct.pack(">I", len(body)) + body + bytes(view.whole[: view.size // 2]))
        await writer.drain()
        writer.close()  # cut: half the bytes sent
    finally:
        view.close()
    await wait_until(lambda: server.refused)
    assert "transfer cut" in server.refused[0]
    assert server.replica(0) == before and server.stray() == []


async def wait_until(pred: object, bound: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound
    while not pred():  # type: ignore[operator]
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_a_stranger_s_garbage_and_huge_offers_are_refused(tmp_path: Path) -> None:
    serve(tmp_path, garbage)


async def garbage(server: Server) -> None:
    assert "over the bound" in refusal(await raw(server, struct.pack(">I", 2**31)))
    assert str(MAX_OFFER) in server.refused[-1]
    garbage = b"\x00\xff not json"
    assert "JSON" in refusal(await raw(server, struct.pack(">I", len(garbage)) + garbage))
    nested = b"[" * 100 + b"]" * 100
    refusal(await raw(server, struct.pack(">I", len(nested)) + nested))
    assert os.listdir(server.hold.folder) == []


def test_an_offer_without_the_run_s_key_is_refused_before_its_data(
    tmp_path: Path, snaps: tuple[str, str]
) -> None:
    serve(tmp_path, lambda server: wrong_key(server, snaps))


async def wrong_key(server: Server, snaps: tuple[str, str]) -> None:
    with pytest.raises(ReplicaError, match="not signed with this run's key"):
        await send(server, snaps[0], key=replica_key("another-token", RUN))
    with pytest.raises(ReplicaError, match="not signed"):
        await send(server, snaps[0], key=b"")
    assert os.listdir(server.hold.folder) == []


def test_an_offer_over_the_size_bound_is_refused(tmp_path: Path, snaps: tuple[str, str]) -> None:
    async def body(s: Server) -> None:
        with pytest.raises(ReplicaError, match="over the bound of 1000"):
            await send(s, snaps[0])

    s = serve(tmp_path, body, max_bytes=1000)
    assert os.listdir(s.hold.folder) == []


def test_a_silent_stranger_is_dropped_within_the_offer_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import elastrun.agent.replica as replica

    monkeypatch.setattr(replica, "OFFER_TIMEOUT", 0.3)

    async def body(server: Server) -> None:
        got = await asyncio.to_thread(silent, server.port)
        assert got.startswith(GREETING)
        await wait_until(lambda: server.refused and server.hold.active == 0)

    serve(tmp_path, body)


def silent(port: int) -> bytes:
    """Connect, send nothing: what comes back before the port closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.settimeout(10)
        got = b""
        while chunk := sock.recv(4096):  # the greeting, the refusal, then the end
            got += chunk
    return got


def test_one_neighbour_s_state_at_one_step_is_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    r0_5, r1_5, r0_10 = (
        make_snapshot(tmp_path, 5, 1.0, monkeypatch, rank=0),
        make_snapshot(tmp_path, 5, 1.0, monkeypatch, rank=1),
        make_snapshot(tmp_path, 10, 2.0, monkeypatch, rank=0),
    )

    async def body(server: Server) -> None:
        await send(server, r0_5)
        await send(server, r1_5)
        assert server.hold.held() == ["rank-0", "rank-1"]
        await send(server, r0_10)  # a newer step: rank 1's older one goes
        assert server.hold.held() == ["rank-0"]
        await send(server, r1_5, node="node-c")  # another node: node-b's go
        assert server.hold.held() == ["rank-1"]

    serve(tmp_path, body)


def test_a_header_over_its_bound_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """A stranger (no token) offers a snapshot whose header is 60 MB, for one
    tensor: refused on its first 16 bytes (the header itself is never sent
    here, so an answer proves it was not waited for), nothing stored."""
    hlen = 60 << 20

    async def body(server: Server) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        await asyncio.wait_for(reader.readexactly(len(GREETING) + NONCE), 20)
        offer = Offer(RUN, 0, 5, 1, 64 + hlen, "0" * 64, 1, "x").encode()
        writer.write(struct.pack(">I", len(offer)) + offer + MAGIC + hlen.to_bytes(8, "little"))
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 20)
        writer.close()
        bound = HEADER_BASE + HEADER_PER_TENSOR
        assert f"its header of {hlen} bytes is over the bound of {bound} for 1 tensors" in refusal(
            answer
        )

    s = serve(tmp_path, body, key=b"")
    assert os.listdir(s.hold.folder) == []
    assert header_bound(10**9) == DEFAULT_MAX_HEADER  # never more, whatever the count claimed


def test_a_header_that_is_not_the_offer_s_is_refused(
    tmp_path: Path, snaps: tuple[str, str]
) -> None:
    """The header is decoded (within bounds) and must name the offer's
    tensor count; a sender's own state over the bound is refused before
    it connects, with the setting that raises it."""

    async def body(server: Server) -> None:
        view = view_of(snaps[0])
        try:
            h = view.header
            offer = Offer(RUN, 0, h.step, h.generation, view.size, "0" * 64, 2, "x").encode()
            payload = struct.pack(">I", len(offer)) + offer + bytes(view.whole)
        finally:
            view.close()
        assert "its header lists 1 tensors, not the offer's" in refusal(await raw(server, payload))

    s = serve(tmp_path, body, key=b"")
    assert os.listdir(s.hold.folder) == []


def test_a_state_whose_header_is_over_the_bound_is_not_sent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    big = make_snapshot(
        tmp_path, 5, 1.0, monkeypatch, extra="x" * (HEADER_BASE + HEADER_PER_TENSOR)
    )

    async def body(server: Server) -> None:
        with pytest.raises(ReplicaError, match="ELASTRUN_REPLICA_MAX_HEADER on every node"):
            await send(server, big)
        assert server.refused == []  # never connected

    serve(tmp_path, body)


def hold_silent(port: int, count: int, *, offer: bool) -> list[socket.socket]:
    """``count`` connections from 127.0.0.1 that read the greeting and then
    stay silent (after an offer of 1 GB, when ``offer``: no token needed)."""
    socks = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=20)
        socks.append(sock)
        got = b""
        while len(got) < len(GREETING) + NONCE and (chunk := sock.recv(64)):
            got += chunk
        if offer and got:
            body = Offer(RUN, 0, 5, 1, 1 << 30, "0" * 64, 1, "x").encode()
            sock.sendall(struct.pack(">I", len(body)) + body)
    return socks


@pytest.mark.parametrize("key", [KEY, b""], ids=["token", "no-token"])
def test_silent_strangers_leave_the_neighbour_s_slot_free(
    tmp_path: Path, snaps: tuple[str, str], monkeypatch: pytest.MonkeyPatch, key: bytes
) -> None:
    """Four strangers on 127.0.0.1 hold connections (silent after the
    greeting with a token; after an offer of theirs without one), their
    timeouts made long enough to outlast the test: the neighbour's replica
    (from 127.0.0.5, the address the rendezvous names) still arrives; a
    fifth sender from another address is refused at once."""
    import elastrun.agent.replica as replica

    monkeypatch.setattr(replica, "OFFER_TIMEOUT", 120.0)
    monkeypatch.setattr(replica, "READ_TIMEOUT", 120.0)

    async def body(server: Server) -> None:
        server.hold.expect(["127.0.0.5"])
        socks = await asyncio.to_thread(hold_silent, server.port, MAX_CONNECTIONS, offer=not key)
        try:
            await wait_until(lambda: server.hold.active + len(server.refused) == MAX_CONNECTIONS)
            await send(server, snaps[0], key=key, source="127.0.0.5")
            assert server.received == [(0, 5)]
            assert "one is kept for it" in server.refused[0]
            with pytest.raises(ReplicaError, match="closed the connection"):
                await send(server, snaps[1], key=key)  # not the neighbour's address
            assert server.hold.active == MAX_CONNECTIONS - 1
        finally:
            for sock in socks:
                sock.close()

    serve(tmp_path, body, key=key)
