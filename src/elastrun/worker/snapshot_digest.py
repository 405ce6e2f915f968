"""The digest of a snapshot's data (:mod:`elastrun.worker.snapshot`): what the
header's ``sha256`` field holds, by the algorithm its ``digest`` field names.

* ``sha256``: the SHA-256 of the data, in one pass (snapshots written before
  chunk digests; a header without a ``digest`` field).
* ``sha256-chunks``: the data cut into ``CHUNK`` bytes (the last one
  shorter), each chunk's SHA-256, and the digest is the SHA-256 of the
  algorithm's name, the data's size and the chunks' digests in order. As
  strong as one SHA-256 against any change (a chunk changed, moved, cut or
  added changes its digest or the list), and the chunks are hashed in
  parallel (hashlib lets other threads run while it hashes).
* ``xxh3-chunks``: the same with each chunk's XXH3-128 (the ``xxhash``
  package, an optional dependency: ``pip install elastrun[fast-hash]``),
  ~6x faster than SHA-256 on one core; a random change goes unseen with
  probability 2^-128 per chunk. Not a defence against a forger, and neither
  is the other: anyone who can write a snapshot can write its header and
  seal too (the folder is private to the worker's user).

A writer takes ``xxh3-chunks`` when ``xxhash`` can be imported, else
``sha256-chunks`` (:func:`preferred`). A reader without ``xxhash`` refuses an
``xxh3-chunks`` snapshot with a line saying so (SnapshotError, raised by the
caller). The chunk size is fixed here, never read from a header, so that the
work a header can ask for is bounded by the data's size, like the hash of
one pass.

Standard library only (``xxhash`` when it is installed).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = [
    "ALGORITHMS",
    "CHUNK",
    "NAMES",
    "SHA256",
    "DataDigest",
    "UnknownDigest",
    "data_digest",
    "preferred",
]

SHA256 = "sha256"
SHA256_CHUNKS = "sha256-chunks"
XXH3_CHUNKS = "xxh3-chunks"
ALGORITHMS = (SHA256, SHA256_CHUNKS, XXH3_CHUNKS)
NAMES = {SHA256: "SHA-256", SHA256_CHUNKS: "chunked SHA-256", XXH3_CHUNKS: "chunked XXH3-128"}
CHUNK = 8 << 20  # bytes per chunk digest (HASH_CHUNK's size: the agent's pieces)
MAX_THREADS = 4  # threads one process hashes with


class UnknownDigest(ValueError):
    """A digest this process cannot compute: the message says why."""


def _xxh3() -> Callable[[Any], bytes] | None:
    try:
        import xxhash  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    fn: Callable[[Any], bytes] = xxhash.xxh3_128_digest
    return fn


def _sha256(chunk: Any) -> bytes:
    return hashlib.sha256(chunk).digest()


def _chunk_hash(algorithm: str) -> Callable[[Any], bytes]:
    if algorithm == SHA256_CHUNKS:
        return _sha256
    if algorithm == XXH3_CHUNKS:
        fn = _xxh3()
        if fn is None:
            raise UnknownDigest(
                "its data digest is xxh3-chunks, and the xxhash package is not installed "
                "here (pip install elastrun[fast-hash])"
            )
        return fn
    raise UnknownDigest(f"its data digest {algorithm[:40]!r} is not one of {', '.join(ALGORITHMS)}")


def preferred() -> str:
    """The algorithm a writer uses: ``xxh3-chunks`` with ``xxhash``, else ``sha256-chunks``."""
    return XXH3_CHUNKS if _xxh3() is not None else SHA256_CHUNKS


def _combined(algorithm: str, size: int, digests: list[bytes]) -> str:
    h = hashlib.sha256()
    h.update(f"{algorithm}:{size}:".encode())
    for d in digests:
        h.update(d)
    return h.hexdigest()


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_pool_pid = 0


def _threads() -> ThreadPoolExecutor:
    """The process's hashing threads (made at the first digest, made again
    in a forked child, which has none of its parent's threads)."""
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            workers = max(1, min(MAX_THREADS, len(os.sched_getaffinity(0))))
            _pool = ThreadPoolExecutor(workers, thread_name_prefix="elastrun-digest")
            _pool_pid = os.getpid()
        return _pool


def data_digest(data: memoryview, algorithm: str, *, parallel: bool = True) -> str:
    """The digest of ``data`` by ``algorithm`` (64 hex digits), its chunks
    hashed on up to ``MAX_THREADS`` threads. UnknownDigest: not computable here."""
    if algorithm == SHA256:
        h = hashlib.sha256()
        for i in range(0, len(data), CHUNK):
            h.update(data[i : i + CHUNK])
        return h.hexdigest()
    fn = _chunk_hash(algorithm)
    pieces = [data[i : i + CHUNK] for i in range(0, len(data), CHUNK)]
    try:
        if parallel and len(pieces) > 1:
            digests = list(_threads().map(fn, pieces))
        else:
            digests = [fn(p) for p in pieces]
    finally:
        for p in pieces:
            p.release()
    return _combined(algorithm, len(data), digests)


class DataDigest:
    """The same digest computed as the data streams by (the agent's disk
    write): ``update`` with pieces of any size, then ``hexdigest``."""

    def __init__(self, algorithm: str) -> None:
        self.algorithm = algorithm
        self.size = 0
        self._one = hashlib.sha256() if algorithm == SHA256 else None
        self._fn = None if algorithm == SHA256 else _chunk_hash(algorithm)
        self._part = bytearray()
        self._digests: list[bytes] = []

    def update(self, piece: Any) -> None:
        view = memoryview(piece).cast("B")
        self.size += len(view)
        if self._one is not None:
            self._one.update(view)
            return
        assert self._fn is not None
        i = 0
        while i < len(view):
            if not self._part and len(view) - i >= CHUNK:
                self._digests.append(self._fn(view[i : i + CHUNK]))
                i += CHUNK
                continue
            take = min(CHUNK - len(self._part), len(view) - i)
            self._part += view[i : i + take]
            i += take
            if len(self._part) == CHUNK:
                self._digests.append(self._fn(self._part))
                self._part.clear()

    def hexdigest(self) -> str:
        if self._one is not None:
            return self._one.hexdigest()
        assert self._fn is not None
        digests = self._digests + ([self._fn(self._part)] if self._part else [])
        return _combined(self.algorithm, self.size, digests)
