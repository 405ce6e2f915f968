"""Replicas of memory checkpoints: each agent holds its neighbour node's newest
replicated snapshots, sent over TCP in the background.

Each node's agent listens on a TCP port of its member address (``--local-addr``
or the address the rendezvous names for it) and publishes the port in the job
note ``replica_{G}`` (:class:`~elastrun.rendezvous.notes.ReplicaNote`, checked
against the round's records: a note counts only from the member at that group
rank). When a worker marks a snapshot (every ``replicate_every`` steps, see
:mod:`elastrun.train.memory`), its agent sends it to the next node in group
rank order (the last node to the first).

The wire, one snapshot per connection::

    receiver -> sender   b"ELREPL01" and a 32-byte random nonce
    sender -> receiver   4-byte length (big endian, at most MAX_OFFER) and the
                         offer: JSON (:class:`Offer`: version, run, origin rank,
                         step, generation, size, SHA-256 of the bytes, its
                         header's tensor count, sending node, and an
                         HMAC-SHA256 over the nonce and the rest)
                         then exactly ``size`` bytes: the snapshot as it lies
                         in the slot (magic, header length, header, data)
    receiver -> sender   4-byte length and a JSON answer {"ok": ..., "error": ...}

Authentication: with a store token, the key is derived from it and the run id
(:func:`replica_key`); an offer whose HMAC does not match is refused before a
byte of data is read, and the data must match the SHA-256 the HMAC covers.
Without a token the port is unauthenticated, as the store is: anyone who can
reach it can offer a replica (documented in docs/reliability.md).

Bounds (what a stranger can make the receiver hold):

* the greeting and the offer (at most ``MAX_OFFER`` bytes of JSON) within
  ``OFFER_TIMEOUT`` s in all: a silent or trickling stranger is dropped then;
* the snapshot's header at most :func:`header_bound` bytes: ``HEADER_BASE``
  plus ``HEADER_PER_TENSOR`` per tensor the offer names, never more than
  ``max_header`` (``ELASTRUN_REPLICA_MAX_HEADER``, default 4 MiB), checked on
  its first 16 bytes, before the header is read; it is decoded in a thread,
  one header at a time (what decoding costs, up to ~28 times its bytes, is
  that of one header), never on the agent's event loop, and must name the
  offered rank, step, generation and tensor count, and a size equal to the
  offer's;
* the data at most ``max_bytes`` (``ELASTRUN_REPLICA_MAX_BYTES``, default
  64 GiB) and never more than the shared memory folder has free; each read
  within ``READ_TIMEOUT`` s;
* at most ``MAX_CONNECTIONS`` connections at once, of which at most
  ``MAX_CONNECTIONS - 1`` from addresses other than the neighbour node's (the
  previous node in the round, :meth:`ReplicaHold.expect`; the sender binds
  its connection to its member address): one is kept for the neighbour.
  A stranger cannot take it from another host (a TCP peer's address is not
  forged off-path); one that shares the neighbour's address (its host) can,
  and with a token is dropped at its offer (within ``OFFER_TIMEOUT`` s);
* at most ``MAX_FILES`` snapshots held.

A transfer is written to a new file (``incoming-*``) and takes the place of
the rank's previous replica only once complete and checked (its SHA-256, its
header): a transfer cut mid-way leaves the previous replica intact. A
complete transfer removes the replicas of other nodes and of other steps, so
that a node holds one neighbour's state at one step (never a mix of steps
from before and after a restart that went back to an older step).

Standard library only: the agent copies bytes, it never imports torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import hmac
import ipaddress
import json
import os
import re
import secrets
import socket
import struct
from collections.abc import Iterable
from typing import Any

from elastrun.agent.spec import DEFAULT_REPLICA_MAX_BYTES, DEFAULT_REPLICA_MAX_HEADER
from elastrun.fields import Fields
from elastrun.frozen import frozen
from elastrun.safefs import create_new
from elastrun.untrusted import UntrustedData, loads, printable
from elastrun.worker.snapshot import (
    HASH_CHUNK,
    MAGIC,
    PREFIX,
    SlotView,
    SnapshotError,
    parse_header,
)

__all__ = [
    "MAX_CONNECTIONS",
    "MAX_FILES",
    "MAX_OFFER",
    "Offer",
    "ReplicaError",
    "ReplicaHold",
    "header_bound",
    "replica_key",
    "send_snapshot",
]

GREETING = b"ELREPL01"
NONCE = 32
VERSION = 2  # 2: the offer names its header's tensor count
MAX_OFFER = 4096  # the offer's JSON
MAX_ANSWER = 4096
MAX_CONNECTIONS = 4  # at once, one of them kept for the neighbour; more are closed at once
OFFER_TIMEOUT = 2.0  # s for the greeting and the offer, in all
READ_TIMEOUT = 10.0  # s for each read of the snapshot's bytes
IO_TIMEOUT = 30.0  # s for each of the sender's reads and writes, and the answer
CONNECT_TIMEOUT = 5.0
MAX_FILES = 64  # snapshots held (one per rank of the neighbour node)
MAX_BYTES_ENV = "ELASTRUN_REPLICA_MAX_BYTES"  # MemorySettings.replica_max_bytes
DEFAULT_MAX_BYTES = DEFAULT_REPLICA_MAX_BYTES
# A real header: ~150 bytes per tensor in its list, its key and place in the
# tree, its parameter id in an optimizer's groups (~300 bytes in all for a
# model's and its optimizer's tensors); plus the state's plain values.
HEADER_BASE = 1 << 20
HEADER_PER_TENSOR = 512
MAX_HEADER_ENV = "ELASTRUN_REPLICA_MAX_HEADER"  # MemorySettings.replica_max_header
DEFAULT_MAX_HEADER = DEFAULT_REPLICA_MAX_HEADER
FREE_MARGIN = 64 << 20  # left free in the shared memory folder
MAX_REFUSALS_LOGGED = 100
_FILE = re.compile(r"^rank-(\d{1,9})$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_NODE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_MAX_INT = 2**63 - 1  # the offer's counts


class ReplicaError(Exception):
    """A replica transfer that failed or was refused; the message says why."""


def replica_key(token: str | None, run_id: str) -> bytes:
    """The per-run key that authenticates replica transfers (b"": no token)."""
    if not token:
        return b""
    return hashlib.sha256(
        b"elastrun-replica-v1\0" + token.encode() + b"\0" + run_id.encode()
    ).digest()


def header_bound(tensors: int, max_header: int = DEFAULT_MAX_HEADER) -> int:
    """The most header bytes a replica of ``tensors`` tensors may have."""
    return min(max_header, HEADER_BASE + HEADER_PER_TENSOR * tensors)


@frozen
class Offer:
    """What a sender offers: one snapshot of ``rank`` at ``step``."""

    run: str
    rank: int
    step: int
    generation: int
    size: int
    sha256: str
    tensors: int
    node: str
    mac: str = ""

    def signed_text(self, nonce: bytes) -> bytes:
        fields = [
            self.run,
            self.rank,
            self.step,
            self.generation,
            self.size,
            self.sha256,
            self.tensors,
            self.node,
        ]
        return nonce + json.dumps(fields, separators=(",", ":")).encode()

    def signed(self, key: bytes, nonce: bytes) -> Offer:
        if not key:
            return self
        mac = hmac.new(key, self.signed_text(nonce), hashlib.sha256).hexdigest()
        return Offer(**{**self.to_json(), "mac": mac})

    def authentic(self, key: bytes, nonce: bytes) -> bool:
        if not key:
            return True
        want = hmac.new(key, self.signed_text(nonce), hashlib.sha256).hexdigest()
        return hmac.compare_digest(want, self.mac)

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "rank": self.rank,
            "step": self.step,
            "generation": self.generation,
            "size": self.size,
            "sha256": self.sha256,
            "tensors": self.tensors,
            "node": self.node,
            "mac": self.mac,
        }

    def encode(self) -> bytes:
        return json.dumps({**self.to_json(), "v": VERSION}, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Offer:
        try:
            obj = loads(raw, max_bytes=MAX_OFFER, max_depth=2, what="replica offer")
        except UntrustedData as e:
            raise ReplicaError(str(e)) from None
        f = Fields.versioned(obj, VERSION, "the replica offer", ReplicaError)
        sha256, node = f.text("sha256", 256), f.text("node", 256)
        if not _SHA256.match(sha256) or not _NODE.match(node):
            raise ReplicaError("the offer has no valid sha256 or node")
        return cls(
            run=f.text("run", 256),
            rank=f.integer("rank", high=_MAX_INT),
            step=f.integer("step", high=_MAX_INT),
            generation=f.integer("generation", high=_MAX_INT),
            size=f.integer("size", high=_MAX_INT),
            sha256=sha256,
            tensors=f.integer("tensors", high=_MAX_INT),
            node=node,
            mac=f.text("mac", 256),
        )


def _frame(obj: bytes) -> bytes:
    return struct.pack(">I", len(obj)) + obj


# ------------------------------------------------------------------ sending


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ReplicaError("the receiver closed the connection")
        buf += chunk
    return bytes(buf)


def _connect(addr: tuple[str, int], source: str) -> socket.socket:
    """A connection to ``addr`` from the address ``source`` (this node's
    member address: the receiver keeps a slot for it), or from any address
    when ``source`` cannot be bound (another family, not local)."""
    if source:
        try:
            return socket.create_connection(addr, CONNECT_TIMEOUT, source_address=(source, 0))
        except socket.gaierror:
            pass
        except OSError as e:
            if e.errno not in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT, errno.EINVAL):
                raise
    return socket.create_connection(addr, CONNECT_TIMEOUT)


def send_snapshot(
    addr: tuple[str, int],
    view: SlotView,
    *,
    run: str,
    node: str,
    key: bytes,
    source: str = "",
    max_header: int = DEFAULT_MAX_HEADER,
) -> None:
    """Send the snapshot ``view`` holds to the replica port at ``addr``
    (blocking, every step within a timeout), from the address ``source``
    when given. ReplicaError: refused or failed."""
    whole = view.whole
    try:
        h = view.header
        hlen = int.from_bytes(whole[len(MAGIC) : PREFIX], "little")
        bound = header_bound(len(h.tensors), max_header)
        if hlen > bound:
            raise ReplicaError(
                f"its header of {hlen} bytes is over the replicas' bound of {bound} for "
                f"{len(h.tensors)} tensors ({MAX_HEADER_ENV} on every node raises it)"
            )
        digest = hashlib.sha256()
        for i in range(0, view.size, HASH_CHUNK):
            digest.update(whole[i : i + HASH_CHUNK])
        offer = Offer(
            run, h.rank, h.step, h.generation, view.size, digest.hexdigest(), len(h.tensors), node
        )
        try:
            with _connect(addr, source) as sock:
                sock.settimeout(IO_TIMEOUT)
                hello = _recv_exact(sock, len(GREETING) + NONCE)
                if hello[: len(GREETING)] != GREETING:
                    raise ReplicaError("the peer is not an elastrun replica port")
                sock.sendall(_frame(offer.signed(key, hello[len(GREETING) :]).encode()))
                for i in range(0, view.size, HASH_CHUNK):
                    sock.sendall(whole[i : min(i + HASH_CHUNK, view.size)])
                (n,) = struct.unpack(">I", _recv_exact(sock, 4))
                if n > MAX_ANSWER:
                    raise ReplicaError("the receiver's answer is over its bound")
                answer = loads(_recv_exact(sock, n), max_bytes=MAX_ANSWER, what="replica answer")
        except (OSError, UntrustedData) as e:
            raise ReplicaError(f"{type(e).__name__}: {e}") from None
        if not isinstance(answer, dict) or answer.get("ok") is not True:
            why = answer.get("error") if isinstance(answer, dict) else answer
            raise ReplicaError(f"refused: {printable(why, limit=300)}")
    finally:
        whole.release()


# ------------------------------------------------------------------ receiving


@frozen
class Received:
    rank: int
    step: int
    node: str
    size: int


def _ip(addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """An address as compared with a peer's (an IPv4-mapped one as IPv4)."""
    try:
        ip = ipaddress.ip_address(addr.split("%", 1)[0])
    except ValueError:
        return None
    mapped = getattr(ip, "ipv4_mapped", None)
    return mapped if mapped is not None else ip


def _check_header(head: bytes, offer: Offer) -> None:
    """The snapshot's header (its first bytes ``head``: magic, length, header)
    decoded within the snapshot format's bounds and checked against the
    offer. Run in a thread, one at a time (ReplicaHold._decoding)."""
    try:
        header, start = parse_header(head, offer.size)
    except SnapshotError as e:
        raise ReplicaError(f"not a snapshot: {e}") from None
    if (header.rank, header.step, header.generation) != (offer.rank, offer.step, offer.generation):
        raise ReplicaError("its header's rank, step or generation is not the offer's")
    if len(header.tensors) != offer.tensors:
        raise ReplicaError(f"its header lists {len(header.tensors)} tensors, not the offer's")
    if start + header.data_size != offer.size:
        raise ReplicaError("its header's data size does not make the offer's size")


class ReplicaHold:
    """The folder of the replicas this agent holds, and the TCP server that
    fills it (see the module doc)."""

    def __init__(
        self,
        folder: str,
        *,
        run: str,
        key: bytes,
        max_bytes: int,
        max_header: int = DEFAULT_MAX_HEADER,
    ) -> None:
        self.folder = folder
        self.run = run
        self.key = key
        self.max_bytes = max_bytes
        self.max_header = max_header
        self.senders: dict[int, tuple[str, int]] = {}  # origin rank -> (node, step) held
        self.active = 0  # connections at once
        self.others = 0  # of which from addresses other than the neighbour's
        self.neighbour: frozenset[ipaddress.IPv4Address | ipaddress.IPv6Address] = frozenset()
        self.refusals = 0
        self.on_received: Any = None  # Callable[[Received], None]
        self.on_refused: Any = None  # Callable[[str, str], None]: peer, reason
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._decoding = asyncio.Lock()  # one header decoded at a time

    def held(self) -> list[str]:
        try:
            return sorted(n for n in os.listdir(self.folder) if _FILE.match(n))
        except OSError:
            return []

    def expect(self, addrs: Iterable[str]) -> None:
        """The neighbour node's addresses (the previous node in this round):
        a connection from one of them may take the slot kept for it."""
        self.neighbour = frozenset(ip for ip in map(_ip, addrs) if ip is not None)

    async def serve(self, host: str) -> int:
        """Listen on ``host`` (port chosen by the system); the port."""
        self._server = await asyncio.start_server(self._connection, host, 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for t in list(self._tasks):
                t.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5.0)
            self._server = None

    def _admit(self, peer: Any) -> tuple[bool, str]:
        """Whether a connection from ``peer`` is the neighbour's address, and
        why it is refused ("": taken)."""
        host = peer[0] if isinstance(peer, tuple) and peer and isinstance(peer[0], str) else ""
        ip = _ip(host)
        neighbour = ip is not None and ip in self.neighbour
        if self.active >= MAX_CONNECTIONS:
            return neighbour, f"over {MAX_CONNECTIONS} connections at once"
        if not neighbour and self.others >= MAX_CONNECTIONS - 1:
            return neighbour, (
                f"over {MAX_CONNECTIONS - 1} connections at once from addresses other than the "
                "neighbour node's (one is kept for it)"
            )
        return neighbour, ""

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        address = writer.get_extra_info("peername")
        peer = printable(address, limit=100)
        neighbour, why = self._admit(address)
        if why:
            self._refused(peer, why)
            writer.close()
            return
        self.active += 1
        self.others += not neighbour
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            got = await self._receive(reader, writer)
            answer: dict[str, Any] = {"ok": True}
            if self.on_received is not None:
                self.on_received(got)
        except ReplicaError as e:
            self._refused(peer, str(e))
            answer = {"ok": False, "error": str(e)[:300]}
        except (OSError, TimeoutError, asyncio.IncompleteReadError) as e:
            self._refused(peer, f"transfer cut: {type(e).__name__}")
            answer = {"ok": False, "error": "transfer cut"}
        finally:
            self.active -= 1
            self.others -= not neighbour
            if task is not None:
                self._tasks.discard(task)
        with contextlib.suppress(OSError, TimeoutError):
            writer.write(_frame(json.dumps(answer).encode()))
            await asyncio.wait_for(writer.drain(), IO_TIMEOUT)
        writer.close()

    def _refused(self, peer: str, why: str) -> None:
        self.refusals += 1
        if self.on_refused is not None and self.refusals <= MAX_REFUSALS_LOGGED:
            self.on_refused(peer, why)

    async def _offer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Offer:
        """The greeting and the offer, within OFFER_TIMEOUT s in all."""
        nonce = secrets.token_bytes(NONCE)
        try:
            async with asyncio.timeout(OFFER_TIMEOUT):
                writer.write(GREETING + nonce)
                await writer.drain()
                (n,) = struct.unpack(">I", await reader.readexactly(4))
                if n > MAX_OFFER:
                    raise ReplicaError(f"offer of {n} bytes, over the bound of {MAX_OFFER}")
                raw = await reader.readexactly(n)
        except TimeoutError:
            raise ReplicaError(f"no offer within {OFFER_TIMEOUT:g} s") from None
        offer = Offer.decode(raw)
        if not offer.authentic(self.key, nonce):
            raise ReplicaError("the offer is not signed with this run's key")
        if offer.run != self.run:
            raise ReplicaError(f"the offer is for another run ({printable(offer.run)})")
        self._check_room(offer)
        return offer

    def _check_room(self, offer: Offer) -> None:
        if offer.size > self.max_bytes:
            raise ReplicaError(f"{offer.size} bytes, over the bound of {self.max_bytes}")
        st = os.statvfs(self.folder)
        free = st.f_bavail * st.f_frsize
        if offer.size + FREE_MARGIN > free:
            raise ReplicaError(f"{offer.size} bytes, more than the {free} bytes free")
        name = f"rank-{offer.rank}"
        if name not in self.held() and len(self.held()) >= MAX_FILES:
            raise ReplicaError(f"already {MAX_FILES} replicas held")

    def _header_length(self, prefix: bytes, offer: Offer) -> int:
        """The header's length from the snapshot's first 16 bytes, refused
        over its bound before a byte of the header is read."""
        if prefix[: len(MAGIC)] != MAGIC:
            raise ReplicaError("not a snapshot (no magic)")
        hlen = int.from_bytes(prefix[len(MAGIC) : PREFIX], "little")
        bound = header_bound(offer.tensors, self.max_header)
        if hlen > bound:
            raise ReplicaError(
                f"its header of {hlen} bytes is over the bound of {bound} for {offer.tensors} "
                f"tensors ({MAX_HEADER_ENV})"
            )
        if PREFIX + hlen > offer.size:
            raise ReplicaError("its header runs past the offered size")
        return hlen

    async def _receive(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> Received:
        offer = await self._offer(reader, writer)
        incoming = os.path.join(self.folder, f"incoming-{secrets.token_hex(8)}")
        fd = create_new(incoming)
        digest = hashlib.sha256()

        async def copy(n: int, head: bytearray | None = None) -> None:
            """The next ``n`` bytes into the file (and ``head``), each read
            within READ_TIMEOUT s. Shared memory: a write is a copy, it does
            not block on a disk."""
            while n:
                chunk = await asyncio.wait_for(reader.read(min(n, 1 << 20)), READ_TIMEOUT)
                if not chunk:
                    raise ReplicaError(f"transfer cut with {n} bytes to come")
                digest.update(chunk)
                if head is not None:
                    head += chunk
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view) :]
                n -= len(chunk)

        try:
            try:
                head = bytearray()
                await copy(PREFIX, head)
                hlen = self._header_length(bytes(head), offer)
                await copy(hlen, head)
                async with self._decoding:  # off the loop; one at a time bounds the memory
                    await asyncio.to_thread(_check_header, bytes(head), offer)
                del head
                await copy(offer.size - PREFIX - hlen)
            finally:
                os.close(fd)
            if digest.hexdigest() != offer.sha256:
                raise ReplicaError("its bytes do not match the offer's SHA-256")
            os.replace(incoming, os.path.join(self.folder, f"rank-{offer.rank}"))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(incoming)
            raise
        self._keep_one_node(offer)
        return Received(offer.rank, offer.step, offer.node, offer.size)

    def _keep_one_node(self, offer: Offer) -> None:
        """The replicas of other nodes, and of other steps, go: one
        neighbour's state of one step is held (a replica of another step
        could only be older, or from before a restart that went back)."""
        self.senders[offer.rank] = (offer.node, offer.step)
        for name in self.held():
            m = _FILE.match(name)
            assert m is not None
            rank = int(m.group(1))
            if self.senders.get(rank) != (offer.node, offer.step):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.folder, name))
                self.senders.pop(rank, None)
