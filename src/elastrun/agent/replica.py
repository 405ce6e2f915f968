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
                         step, generation, size, SHA-256 of the bytes, sending
                         node, and an HMAC-SHA256 over the nonce and the rest)
                         then exactly ``size`` bytes: the snapshot as it lies
                         in the slot (magic, header, data)
    receiver -> sender   4-byte length and a JSON answer {"ok": ..., "error": ...}

Authentication: with a store token, the key is derived from it and the run id
(:func:`replica_key`); an offer whose HMAC does not match is refused before a
byte of data is read, and the data must match the SHA-256 the HMAC covers.
Without a token the port is unauthenticated, as the store is: anyone who can
reach it can offer a replica (documented in docs/reliability.md).

Bounds: an offer's JSON is at most ``MAX_OFFER`` bytes, read within
``OFFER_TIMEOUT`` s; the data at most ``max_bytes`` (``ELASTRUN_REPLICA_MAX_BYTES``,
default 64 GiB) and never more than the shared memory folder has free; every
read and write of the data within ``IO_TIMEOUT`` s; at most
``MAX_CONNECTIONS`` transfers at once (more are closed at once); at most
``MAX_FILES`` snapshots held. A transfer is written to a new file
(``incoming-*``) and takes the place of the rank's previous replica only
once complete and checked (its SHA-256, its header's rank and step): a
transfer cut mid-way leaves the previous replica intact. A complete transfer
removes the replicas of other nodes and of other steps, so that a node holds
one neighbour's state at one step (never a mix of steps from before and
after a restart that went back to an older step).

Standard library only: the agent copies bytes, it never imports torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import os
import re
import secrets
import socket
import struct
from dataclasses import dataclass
from typing import Any

from elastrun.errors import ConfigError
from elastrun.safefs import create_new
from elastrun.untrusted import UntrustedData, ascii_int, loads, printable
from elastrun.worker.snapshot import HASH_CHUNK, SlotView, SnapshotError, open_slot

__all__ = [
    "MAX_CONNECTIONS",
    "MAX_FILES",
    "MAX_OFFER",
    "Offer",
    "ReplicaError",
    "ReplicaHold",
    "replica_key",
    "send_snapshot",
]

GREETING = b"ELREPL01"
NONCE = 32
VERSION = 1
MAX_OFFER = 4096  # the offer's JSON
MAX_ANSWER = 4096
MAX_CONNECTIONS = 4  # transfers at once; more are closed at once
MAX_FILES = 64  # snapshots held (one per rank of the neighbour node)
OFFER_TIMEOUT = 5.0  # s for the greeting and the offer
IO_TIMEOUT = 30.0  # s for each read or write of the data
CONNECT_TIMEOUT = 5.0
MAX_BYTES_ENV = "ELASTRUN_REPLICA_MAX_BYTES"
DEFAULT_MAX_BYTES = 64 << 30
FREE_MARGIN = 64 << 20  # left free in the shared memory folder
MAX_REFUSALS_LOGGED = 100
_FILE = re.compile(r"^rank-(\d{1,9})$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_NODE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


class ReplicaError(Exception):
    """A replica transfer that failed or was refused; the message says why."""


def replica_key(token: str | None, run_id: str) -> bytes:
    """The per-run key that authenticates replica transfers (b"": no token)."""
    if not token:
        return b""
    return hashlib.sha256(
        b"elastrun-replica-v1\0" + token.encode() + b"\0" + run_id.encode()
    ).digest()


def max_bytes_from_env() -> int:
    """``ELASTRUN_REPLICA_MAX_BYTES`` (unset or empty: 64 GiB): a positive
    whole number in ASCII digits; else ConfigError naming the variable."""
    raw = os.environ.get(MAX_BYTES_ENV, "")
    if not raw.strip():
        return DEFAULT_MAX_BYTES
    value = ascii_int(raw)
    if value is None or value < 1:
        raise ConfigError(
            f"{MAX_BYTES_ENV}: expected a positive whole number of bytes (ASCII digits), "
            f"got {printable(repr(raw[:64]))}"
        )
    return value


@dataclass(frozen=True)
class Offer:
    """What a sender offers: one snapshot of ``rank`` at ``step``."""

    run: str
    rank: int
    step: int
    generation: int
    size: int
    sha256: str
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
        if not isinstance(obj, dict) or obj.get("v") != VERSION:
            raise ReplicaError(f"not a version-{VERSION} replica offer")
        for name in ("rank", "step", "generation", "size"):
            v = obj.get(name)
            if type(v) is not int or not 0 <= v < 2**63:
                raise ReplicaError(f"the offer has no valid {name!r}")
        text: dict[str, str] = {}
        for name in ("run", "sha256", "node", "mac"):
            v = obj.get(name)
            if not isinstance(v, str) or len(v) > 256:
                raise ReplicaError(f"the offer's {name!r} is not a short string")
            text[name] = v
        if not _SHA256.match(text["sha256"]) or not _NODE.match(text["node"]):
            raise ReplicaError("the offer has no valid sha256 or node")
        return cls(
            run=text["run"],
            rank=obj["rank"],
            step=obj["step"],
            generation=obj["generation"],
            size=obj["size"],
            sha256=text["sha256"],
            node=text["node"],
            mac=text["mac"],
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


def send_snapshot(
    addr: tuple[str, int], view: SlotView, *, run: str, node: str, key: bytes
) -> None:
    """Send the snapshot ``view`` holds to the replica port at ``addr``
    (blocking, every step within a timeout). ReplicaError: refused or failed."""
    whole = view.whole
    try:
        digest = hashlib.sha256()
        for i in range(0, view.size, HASH_CHUNK):
            digest.update(whole[i : i + HASH_CHUNK])
        h = view.header
        offer = Offer(run, h.rank, h.step, h.generation, view.size, digest.hexdigest(), node)
        try:
            with socket.create_connection(addr, timeout=CONNECT_TIMEOUT) as sock:
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


@dataclass(frozen=True)
class Received:
    rank: int
    step: int
    node: str
    size: int


class ReplicaHold:
    """The folder of the replicas this agent holds, and the TCP server that
    fills it (see the module doc)."""

    def __init__(self, folder: str, *, run: str, key: bytes, max_bytes: int) -> None:
        self.folder = folder
        self.run = run
        self.key = key
        self.max_bytes = max_bytes
        self.senders: dict[int, tuple[str, int]] = {}  # origin rank -> (node, step) held
        self.active = 0
        self.refusals = 0
        self.on_received: Any = None  # Callable[[Received], None]
        self.on_refused: Any = None  # Callable[[str, str], None]: peer, reason
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def held(self) -> list[str]:
        try:
            return sorted(n for n in os.listdir(self.folder) if _FILE.match(n))
        except OSError:
            return []

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

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = printable(writer.get_extra_info("peername"), limit=100)
        if self.active >= MAX_CONNECTIONS:
            self._refused(peer, f"over {MAX_CONNECTIONS} transfers at once")
            writer.close()
            return
        self.active += 1
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
        nonce = secrets.token_bytes(NONCE)
        writer.write(GREETING + nonce)
        await asyncio.wait_for(writer.drain(), OFFER_TIMEOUT)
        (n,) = struct.unpack(">I", await asyncio.wait_for(reader.readexactly(4), OFFER_TIMEOUT))
        if n > MAX_OFFER:
            raise ReplicaError(f"offer of {n} bytes, over the bound of {MAX_OFFER}")
        offer = Offer.decode(await asyncio.wait_for(reader.readexactly(n), OFFER_TIMEOUT))
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

    async def _receive(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> Received:
        offer = await self._offer(reader, writer)
        incoming = os.path.join(self.folder, f"incoming-{secrets.token_hex(8)}")
        fd = create_new(incoming)
        try:
            try:  # shared memory: a write is a copy, it does not block on a disk
                digest = hashlib.sha256()
                left = offer.size
                while left:
                    chunk = await asyncio.wait_for(reader.read(min(left, 1 << 20)), IO_TIMEOUT)
                    if not chunk:
                        raise ReplicaError(f"transfer cut with {left} bytes to come")
                    digest.update(chunk)
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(fd, view) :]
                    left -= len(chunk)
            finally:
                os.close(fd)
            if digest.hexdigest() != offer.sha256:
                raise ReplicaError("its bytes do not match the offer's SHA-256")
            self._check_snapshot(incoming, offer)
            os.replace(incoming, os.path.join(self.folder, f"rank-{offer.rank}"))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(incoming)
            raise
        self._keep_one_node(offer)
        return Received(offer.rank, offer.step, offer.node, offer.size)

    @staticmethod
    def _check_snapshot(path: str, offer: Offer) -> None:
        try:
            view = open_slot(path)
        except (SnapshotError, OSError) as e:
            raise ReplicaError(f"not a snapshot: {e}") from None
        if view is None:
            raise ReplicaError("not a snapshot")
        with view:
            h = view.header
            if (h.rank, h.step, h.generation) != (offer.rank, offer.step, offer.generation):
                raise ReplicaError("its header's rank, step or generation is not the offer's")

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
