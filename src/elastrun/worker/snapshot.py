"""Memory checkpoints without torch: the snapshot format and the slot files.

A worker's memory checkpoint (:mod:`elastrun.train.memory`) lives in shared
memory, in a private folder that the agent made for the worker's local rank
and named in ``ELASTRUN_MEMORY_CHECKPOINT_DIR``. The folder holds up to
``slots`` *slot files* (``slot-0``, ``slot-1``, ...), each one snapshot::

    offset 0    magic b"ELMCKPT1"      written last: no magic, no snapshot
    offset 8    header length H        8 bytes, little endian, at most MAX_HEADER
    offset 16   the header             JSON (UTF-8), H bytes, sealed: it begins
                                       {"hsha":"<SHA-256 of the header>",
    DATA        the tensors' bytes     DATA = 16 + H rounded up to 64; each tensor
                                       at DATA + its offset (64-byte aligned)

The header (:class:`SnapshotHeader`, version 1) names the step, the saving
rank, the world size, a generation (nanoseconds since the epoch at the save:
the newest snapshot has the highest), the data's size and digest (its
algorithm named in ``digest``: :mod:`elastrun.worker.snapshot_digest`), each
tensor (its key in the state, dtype, shape, offset, size), the rest of the
state as a JSON tree with the tensors' places in it, and whether (and where)
the agent should write it to disk. Every field is bounded, the tensors' places
and the tree checked, and the header's seal (its own SHA-256) verified before
it is used (:mod:`elastrun.worker.snapshot_bounds`).

**Writing** (the worker): take an exclusive ``flock`` on a slot that is not
the newest and nobody reads, zero its magic, copy the tensors, hash them
(a thread of the worker, its chunks in parallel),
write the header, then the magic, release the lock; then replace the
folder's ``committed`` note (:class:`CommitNote`, a small JSON file, renamed
into place), which is what the agent watches. The newest snapshot marked for
the disk is kept out of the rotation until the agent's ``persisted`` note
names its generation, so that fast saves never overwrite it before the
agent has read it. A worker killed at any moment leaves a slot without its
magic (never read: :class:`Torn`) and the previous snapshots intact; anything
else in place of the magic is damage. **Reading** (the agent, or a restarted
worker): a shared ``flock`` taken without waiting (a slot being written is
skipped), the header checked within bounds and against its seal
(:func:`parse_header`), the data checked against its digest. The agent writes
a snapshot to disk as a ``torch.save`` file (``ckpt-<step>.pt``, with the
usual checksum record: :mod:`elastrun.worker.checkpoint_files`) that also
holds this header (:mod:`elastrun.worker.torch_file`); older disk copies hold
the snapshot's bytes as they are, which :func:`header_of` still reads.

A DTensor's local shard is a tensor like any other, named in the tree with
its layout (:mod:`elastrun.worker.shard_layout`).

Standard library only (with the foundation): the agent reads and persists
snapshots without importing torch.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import re
import stat
from collections.abc import Iterator
from typing import Any

from elastrun.fields import Fields
from elastrun.frozen import frozen
from elastrun.safefs import read_regular, write_atomic
from elastrun.untrusted import UntrustedData, loads
from elastrun.worker.snapshot_bounds import (
    MAX_HEADER,
    MAX_VALUES,
    check_layout,
    check_tree,
    count_values,
    seal,
    sealed_digest,
)
from elastrun.worker.snapshot_digest import (
    ALGORITHMS,
    NAMES,
    SHA256,
    UnknownDigest,
    data_digest,
)

__all__ = [
    "DTYPE_SIZES",
    "ENV",
    "MAGIC",
    "MAX_HEADER",
    "MAX_SLOTS",
    "NOTE",
    "REPLICA_ENV",
    "CommitNote",
    "Marked",
    "Persist",
    "SaveTotals",
    "SlotView",
    "SnapshotError",
    "SnapshotHeader",
    "TensorEntry",
    "Torn",
    "check_data",
    "check_header_size",
    "data_offset",
    "header_of",
    "open_slot",
    "parse_header",
    "read_persisted",
    "slot_names",
    "snapshots",
    "write_persisted",
]

ENV = "ELASTRUN_MEMORY_CHECKPOINT_DIR"
# The agent's folder of the replicas it holds of its neighbour node's snapshots
# (files ``rank-<global rank>``, each one snapshot in this format).
REPLICA_ENV = "ELASTRUN_MEMORY_CHECKPOINT_REPLICAS"
MAGIC = b"ELMCKPT1"
PREFIX = 16  # the magic and the header's length
ALIGN = 64
VERSION = 1
MAX_DEPTH = 64  # the state's nesting (dicts and lists), plus the header's own
MAX_DIMS = 64
MAX_ELEMENTS = 1 << 62  # a shape's dimensions multiplied (its zeros as ones)
MAX_COUNT = 1 << 62  # a step, a generation, a size (they travel as int64)
MAX_WORLD = 1 << 24
MAX_SLOTS = 8
MAX_PATH = 4096
NOTE = "committed"
PERSISTED = "persisted"
MAX_NOTE = 4096
HASH_CHUNK = 8 << 20
_SLOT = re.compile(r"^(slot-\d|rank-\d{1,9})$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")

# The dtypes a snapshot may hold (torch's names), and their sizes in bytes.
DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "complex128": 16,
    "complex64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


class SnapshotError(Exception):
    """A snapshot that cannot be used; the message says why."""


class Torn(SnapshotError):
    """A slot without its magic (zeros, or empty): being written, or left by a
    worker killed while writing it. Not damage: nothing was committed there."""


def data_offset(header_len: int) -> int:
    """Where the tensor data starts after a header of ``header_len`` bytes."""
    return -(-(PREFIX + header_len) // ALIGN) * ALIGN


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _fields(obj: object, what: str) -> Fields:
    return Fields(obj, what, SnapshotError)


@frozen(slots=True)
class TensorEntry:
    """One tensor of a snapshot: its key in the state (for messages), dtype
    (torch's name), shape, and bytes at ``offset`` in the data."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "offset": self.offset,
            "nbytes": self.nbytes,
        }

    @classmethod
    def from_json(cls, obj: Any, data_size: int) -> TensorEntry:
        if not isinstance(obj, dict):
            raise SnapshotError("its header lists a tensor that is not an object")
        key, dtype, shape = obj.get("key"), obj.get("dtype"), obj.get("shape")
        if not isinstance(key, str) or not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
            raise SnapshotError(f"its header lists a tensor with no valid key or dtype ({dtype!r})")
        if not isinstance(shape, list) or len(shape) > MAX_DIMS:
            raise SnapshotError(f"tensor {key}: no valid shape")
        dims = []
        numel = elements = 1
        for d in shape:
            if not isinstance(d, int) or isinstance(d, bool) or not 0 <= d <= MAX_ELEMENTS:
                raise SnapshotError(f"tensor {key}: no valid shape")
            dims.append(d)
            numel, elements = numel * d, elements * max(d, 1)
            if elements > MAX_ELEMENTS:
                raise SnapshotError(f"tensor {key}: its shape is over {MAX_ELEMENTS} elements")
        f = _fields(obj, f"tensor {key}")
        offset = f.integer("offset", high=MAX_COUNT)
        nbytes = f.integer("nbytes", high=MAX_COUNT)
        if nbytes != numel * DTYPE_SIZES[dtype]:
            raise SnapshotError(f"tensor {key}: {nbytes} bytes do not fit its shape and dtype")
        if offset % ALIGN or offset + nbytes > data_size:
            raise SnapshotError(f"tensor {key}: its bytes lie outside the data")
        return cls(key, dtype, tuple(dims), offset, nbytes)


@frozen(slots=True)
class Persist:
    """Where the agent writes a snapshot to disk: a checkpoint folder
    (absolute) and how many checkpoints it keeps there (0: all)."""

    directory: str
    keep: int

    def to_json(self) -> dict[str, Any]:
        return {"dir": self.directory, "keep": self.keep}

    @classmethod
    def from_json(cls, obj: Any) -> Persist | None:
        if obj is None:
            return None
        f = _fields(obj, "its header's persist")
        d = f.text("dir", MAX_PATH)
        if not os.path.isabs(d) or "\0" in d:
            raise f.bad("dir", "not an absolute path")
        return cls(d, f.integer("keep", high=MAX_COUNT))


@frozen(slots=True)
class SnapshotHeader:
    """What a snapshot holds (see the module doc)."""

    step: int
    rank: int
    world_size: int
    generation: int
    data_size: int
    sha256: str
    tensors: tuple[TensorEntry, ...]
    tree: Any
    persist: Persist | None = None
    digest: str = SHA256  # how ``sha256`` was computed (snapshot_digest)

    def to_json(self) -> dict[str, Any]:
        return {
            "v": VERSION,
            "step": self.step,
            "rank": self.rank,
            "world_size": self.world_size,
            "generation": self.generation,
            "data_size": self.data_size,
            "sha256": self.sha256,
            "digest": self.digest,
            "persist": None if self.persist is None else self.persist.to_json(),
            "tensors": [t.to_json() for t in self.tensors],
            "tree": self.tree,
        }

    def encode(self) -> bytes:
        """The header's bytes, sealed (:func:`~elastrun.worker.snapshot_bounds.seal`)."""
        import json

        body = json.dumps(self.to_json(), separators=(",", ":"), allow_nan=False).encode()
        return seal(body)

    @classmethod
    def from_json(cls, obj: Any) -> SnapshotHeader:
        f = Fields.versioned(obj, VERSION, "its header", SnapshotError)
        data_size = f.integer("data_size", high=MAX_COUNT)
        sha = obj.get("sha256")
        if not isinstance(sha, str) or not _SHA256.match(sha):
            raise SnapshotError("its header has no valid sha256")
        digest = obj.get("digest", SHA256)
        if digest not in ALGORITHMS:
            raise SnapshotError(f"its header names no known data digest ({str(digest)[:40]!r})")
        tensors = obj.get("tensors")
        if not isinstance(tensors, list):
            raise SnapshotError("its header has no tensor list")
        world = f.integer("world_size", low=1, high=MAX_WORLD)
        header = cls(
            step=f.integer("step", high=MAX_COUNT),
            rank=f.integer("rank", high=MAX_WORLD),
            world_size=world,
            generation=f.integer("generation", high=MAX_COUNT),
            data_size=data_size,
            sha256=sha,
            tensors=tuple(TensorEntry.from_json(t, data_size) for t in tensors),
            tree=obj.get("tree"),
            persist=Persist.from_json(obj.get("persist")),
            digest=digest,
        )
        why = check_layout(header.tensors, data_size) or check_tree(
            header.tree, len(header.tensors)
        )
        if why is not None:
            raise SnapshotError(why)
        return header


def check_header_size(raw: bytes) -> str | None:
    """Why a header's bytes are over a bound of the format (None: within)."""
    if len(raw) > MAX_HEADER:
        return f"its header is {len(raw)} bytes (at most {MAX_HEADER})"
    values = count_values(raw)
    if values > MAX_VALUES:
        return f"its header holds {values} JSON values (at most {MAX_VALUES})"
    return None


def parse_header(buf: Any, size: int, *, sealed: bool = True) -> tuple[SnapshotHeader, int]:
    """The header of the snapshot in ``buf`` (a bytes-like object, or an mmap,
    of ``size`` bytes) and where its data starts. SnapshotError says why it
    is not a snapshot (:class:`Torn`: no magic, being written or torn).
    Every field is bounded before it is used, and the seal checked; a header
    without a seal is refused unless ``sealed`` is False (a disk copy written
    before seals)."""
    magic = bytes(buf[0:8]) if size >= 8 else b""
    if magic != MAGIC:
        if magic == bytes(8) or size == 0:
            raise Torn("it holds no complete snapshot (no magic)")
        raise SnapshotError(f"its magic is damaged, or it is cut short ({size} bytes)")
    if size < PREFIX:
        raise SnapshotError(f"it is cut short ({size} bytes)")
    hlen = int.from_bytes(bytes(buf[8:16]), "little")
    if hlen > MAX_HEADER or PREFIX + hlen > size:
        raise SnapshotError(
            f"its header length {hlen} is over a bound ({MAX_HEADER}) or past the end "
            f"of the file ({size} bytes)"
        )
    raw = bytes(buf[PREFIX : PREFIX + hlen])
    why = check_header_size(raw)
    if why is not None:
        raise SnapshotError(why)
    try:
        obj = loads(raw, max_bytes=MAX_HEADER, max_depth=MAX_DEPTH)
    except UntrustedData as e:
        raise SnapshotError(f"its header: {e}") from None
    start = data_offset(hlen)
    if isinstance(obj, dict):  # the data's size first: it bounds every tensor's place
        ds = obj.get("data_size")
        if type(ds) is int and start + ds > size:
            raise SnapshotError(
                f"its data ({ds} bytes) runs past the end of the file ({size} bytes)"
            )
    header = SnapshotHeader.from_json(obj)
    del obj
    digests = sealed_digest(raw)
    if digests is None and sealed:
        raise SnapshotError("its header has no seal (its own SHA-256)")
    if digests is not None and digests[0] != digests[1]:
        raise SnapshotError(
            f"its header does not match its seal (SHA-256 {digests[1][:16]}..., "
            f"sealed {digests[0][:16]}...): changed after it was written"
        )
    return header, start


def header_of(data: bytes | bytearray | memoryview) -> tuple[SnapshotHeader, int] | None:
    """The header of a snapshot held in memory (a disk copy's bytes), or None
    when ``data`` does not start with the magic (a ``torch.save`` file)."""
    if bytes(data[0:8]) != MAGIC:
        return None
    return parse_header(data, len(data), sealed=False)


def check_data(header: SnapshotHeader, data: memoryview) -> None:
    """SnapshotError unless ``data`` matches ``header``'s digest (its
    chunks hashed in parallel: :mod:`elastrun.worker.snapshot_digest`)."""
    try:
        got = data_digest(data, header.digest)
    except UnknownDigest as e:
        raise SnapshotError(str(e)) from None
    if got != header.sha256:
        raise SnapshotError(
            f"its data's digest ({NAMES[header.digest]}) {got[:16]}... is not the "
            f"header's {header.sha256[:16]}..."
        )


def _write_note(folder: str, name: str, obj: dict[str, Any]) -> None:
    import json

    write_atomic(os.path.join(folder, name), json.dumps(obj).encode())


def _read_note(folder: str, name: str, where: str) -> Fields | None:
    """A note's fields (``where`` names it in errors); None when there is
    none. SnapshotError: unusable."""
    try:
        raw = read_regular(os.path.join(folder, name), MAX_NOTE)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise SnapshotError(f"its note {name!r} cannot be read: {e}") from None
    try:
        obj = loads(raw, max_bytes=MAX_NOTE, what=f"note {name!r}")
    except UntrustedData as e:
        raise SnapshotError(str(e)) from None
    return Fields.versioned(obj, VERSION, where, SnapshotError)


@frozen(slots=True)
class Marked:
    """A snapshot marked for the disk: its slot, generation and step."""

    slot: int
    generation: int
    step: int


MAX_SAVE_SECONDS = 1e12  # a total of seconds blocked read from a note is at most this


@frozen(slots=True)
class SaveTotals:
    """The saves a worker process made so far (its ``pid``): how many, the
    seconds they kept training waiting, and the bytes of state they copied.
    Counted from the process's start; the agent adds what grew since it last
    looked (agent/memory.py), for its metrics."""

    pid: int
    saves: int
    blocked_s: float
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "saves": self.saves,
            "blocked_s": round(self.blocked_s, 6),
            "bytes": self.nbytes,
        }

    @classmethod
    def from_json(cls, raw: object) -> SaveTotals:
        f = Fields(raw, "its commit note's saves", SnapshotError)
        return cls(
            f.integer("pid", high=MAX_COUNT),
            f.integer("saves", high=MAX_COUNT),
            f.number("blocked_s", high=MAX_SAVE_SECONDS),
            f.integer("bytes", high=MAX_COUNT),
        )


@frozen(slots=True)
class CommitNote:
    """What the worker committed last (the ``committed`` note): the newest
    snapshot's slot, generation and step, the newest one marked for the
    disk (``marked``), which the worker keeps until the agent has written it
    (the ``persisted`` note says so), and the process's saves so far
    (``saves``; None in a note written without them)."""

    slot: int
    generation: int
    step: int
    marked: Marked | None = None
    saves: SaveTotals | None = None

    def write(self, folder: str) -> None:
        m = self.marked
        _write_note(
            folder,
            NOTE,
            {
                "v": VERSION,
                "slot": self.slot,
                "generation": self.generation,
                "step": self.step,
                "marked": None if m is None else [m.slot, m.generation, m.step],
                "saves": None if self.saves is None else self.saves.to_json(),
            },
        )

    @classmethod
    def read(cls, folder: str) -> CommitNote | None:
        f = _read_note(folder, NOTE, "its commit note")
        if f is None:
            return None
        slot, m = f.integer("slot", high=MAX_COUNT), f.raw.get("marked")
        marked = None
        if m is not None:
            ok = isinstance(m, list) and len(m) == 3
            if not ok or not all(type(v) is int and v >= 0 for v in m) or m[0] >= MAX_SLOTS:
                raise SnapshotError("its commit note has no valid 'marked'")
            marked = Marked(m[0], m[1], m[2])
        if slot >= MAX_SLOTS:
            raise SnapshotError("its commit note has no valid slot")
        saves = None if f.absent("saves") else SaveTotals.from_json(f.raw["saves"])
        return cls(
            slot,
            f.integer("generation", high=MAX_COUNT),
            f.integer("step", high=MAX_COUNT),
            marked,
            saves,
        )


def write_persisted(folder: str, generation: int) -> None:
    """The agent's answer: the marked snapshot of ``generation`` is done with
    (written to disk, or given up on: the event log says which)."""
    _write_note(folder, PERSISTED, {"v": VERSION, "generation": generation})


def read_persisted(folder: str) -> int:
    """The generation the agent is done with (-1: none, or an unusable note)."""
    try:
        f = _read_note(folder, PERSISTED, "its persisted note")
    except SnapshotError:
        return -1
    g = None if f is None else f.maybe_int("generation")
    return -1 if g is None else g


# ------------------------------------------------------------------ slots


def slot_names(folder: str) -> list[str]:
    """The slot files in ``folder`` (missing folder: none)."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if _SLOT.match(n))


def open_fd(path: str, flags: int) -> int:
    """``path`` opened with no link followed and never blocked; a regular file
    of this user (another's, a link, a FIFO: SnapshotError)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO):
            raise SnapshotError(f"{path} is a link or a special file") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise SnapshotError(f"{path} is not a regular file of this user")
    os.set_blocking(fd, True)
    return fd


class SlotView:
    """One slot opened to read, under a shared lock (no writer meanwhile):
    its header, its data (``data``: a memoryview of the mapping), ``close``."""

    def __init__(self, path: str, fd: int, mm: mmap.mmap, header: SnapshotHeader, start: int):
        self.path = path
        self.header = header
        self.start = start
        self._fd = fd
        self._mm = mm
        self.data = memoryview(mm)[start : start + header.data_size]
        self.size = start + header.data_size  # the snapshot's bytes in the file

    @property
    def whole(self) -> memoryview:
        """The snapshot's bytes, from the magic to the end of its data."""
        return memoryview(self._mm)[: self.size]

    def verify(self) -> None:
        """SnapshotError unless the data matches the header's digest."""
        check_data(self.header, self.data)

    def close(self) -> None:
        with contextlib.suppress(BufferError, ValueError):
            self.data.release()
        with contextlib.suppress(BufferError):
            self._mm.close()
        with contextlib.suppress(OSError):
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)

    def __enter__(self) -> SlotView:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_slot(path: str) -> SlotView | None:
    """The snapshot in slot ``path``, locked for reading; None when it is
    being written (locked) or missing. SnapshotError: no complete snapshot."""
    try:
        fd = open_fd(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        size = os.fstat(fd).st_size
        if size < PREFIX:
            parse_header(os.pread(fd, PREFIX, 0), size)  # Torn or damaged: raises
        mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise
    try:
        header, start = parse_header(mm, size)
    except BaseException:
        mm.close()
        os.close(fd)
        raise
    return SlotView(path, fd, mm, header, start)


def snapshots(folder: str) -> Iterator[SlotView | SnapshotError]:
    """Each slot of ``folder`` that holds a snapshot, opened and locked
    (close them), or the reason one cannot be read (its path first; a
    :class:`Torn` one without its magic); slots being written are left out."""
    for name in slot_names(folder):
        path = os.path.join(folder, name)
        try:
            view = open_slot(path)
        except (SnapshotError, OSError) as e:
            yield (Torn if isinstance(e, Torn) else SnapshotError)(f"{path}: {e}")
            continue
        if view is not None:
            yield view
