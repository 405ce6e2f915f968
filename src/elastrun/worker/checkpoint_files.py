"""The files of a checkpoint directory: names, atomic writes, checksum records, damage.

Layout of a checkpoint directory::

    ckpt-000000000042.pt        one checkpoint per step (torch.save of your state)
    ckpt-000000000042.pt.json   its checksum record: {"v": 1, "file": ..., "step": 42,
                                "size": N, "sha256": "..."}
    latest                      the file name of the newest checkpoint, one line
    corrupt/                    damaged checkpoints moved aside (never deleted by us)

Writing one checkpoint (:func:`write_checkpoint`), in this order: the data to a
temporary file (hashed as it is written), fsync; the record to a temporary
file, fsync, renamed into place, directory fsync; then the data renamed into
place, directory fsync. A ``ckpt-*.pt`` name therefore only ever appears
after its record, and a kill at any moment leaves the previous checkpoints
(and their records) untouched: at worst a temporary file (removed by a later
save on this host once its writer is dead) or a record without its data
(ignored, removed once older than every kept checkpoint).

The agent writes the disk copies of memory checkpoints through the same
functions (it never imports torch): they live here, in the worker layer, for
both; training scripts use them through :mod:`elastrun.train` (``list_checkpoints``,
``latest_checkpoint``, ``CheckpointInfo``).

A checkpoint without a record was written by an older elastrun (or copied
without it): it is *unverified*; :mod:`elastrun.train.checkpoint` uses it only
if it loads. One whose size or SHA-256 differs from its record, or whose
record is unreadable, is *damaged*: :func:`move_aside` renames it (and its
record) into ``corrupt/``.

Only the standard library is used here (no torch).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from elastrun.fields import Fields, is_int
from elastrun.frozen import frozen
from elastrun.procs import pid_alive
from elastrun.safefs import UnsafePath, read_regular
from elastrun.untrusted import UntrustedData, loads

__all__ = [
    "CORRUPT_DIR",
    "LATEST",
    "RECORD_SUFFIX",
    "CheckpointInfo",
    "Record",
    "RecordError",
    "Verdict",
    "check",
    "checkpoint_path",
    "latest_checkpoint",
    "list_checkpoints",
    "move_aside",
    "publish",
    "read_record",
    "record_path",
    "write_checkpoint",
]

LATEST = "latest"
RECORD_SUFFIX = ".json"
CORRUPT_DIR = "corrupt"
RECORD_VERSION = 1
MAX_RECORD_BYTES = 64 * 1024  # a record is ~150 bytes; anything this big is not one
MAX_ASIDE_NAMES = 1000  # corrupt/NAME, NAME.1 ... NAME.999, then a time-stamped name
_NAME = re.compile(r"^ckpt-(\d{12,})\.pt$")
_RECORD = re.compile(r"^ckpt-(\d{12,})\.pt\.json$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# Temp files of interrupted saves: of a checkpoint or its record, or of the ``latest`` pointer.
_TMP = re.compile(r"^\.(?:ckpt-.*|latest)\.(?P<host>[^.]+)\.(?P<pid>\d+)\.tmp$")


@frozen(slots=True)
class CheckpointInfo:
    step: int
    path: Path


@frozen(slots=True)
class Verdict:
    """What :func:`check` found: ``verified`` (matches its record), ``unverified``
    (no record) or ``damaged`` (``why`` says how)."""

    status: str
    sha256: str
    why: str = ""


def checkpoint_path(directory: str | os.PathLike[str], step: int) -> Path:
    """Where the checkpoint for ``step`` lives in ``directory``."""
    return Path(directory) / f"ckpt-{step:012d}.pt"


def record_path(path: Path) -> Path:
    """The checksum record of the checkpoint at ``path``."""
    return path.with_name(path.name + RECORD_SUFFIX)


def list_checkpoints(directory: str | os.PathLike[str]) -> list[CheckpointInfo]:
    """Checkpoints in ``directory`` by name, oldest first (none if it does not exist)."""
    d = Path(directory)
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        m = _NAME.match(name)
        if m:
            found.append(CheckpointInfo(int(m.group(1)), d / name))
    return sorted(found, key=lambda c: c.step)


def latest_checkpoint(directory: str | os.PathLike[str]) -> CheckpointInfo | None:
    """The checkpoint with the highest step in ``directory`` (by name), or None.

    A ``ckpt-*.pt`` name only appears by an atomic rename after fsync, so the
    highest step wins even where ``latest`` lags behind. Whether its bytes are
    intact is checked when it is loaded.
    """
    found = list_checkpoints(directory)
    return found[-1] if found else None


# ----------------------------------------------------------------- writing


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname()) or "host"


def _tmp_for(final: Path) -> Path:
    return final.parent / f".{final.name}.{_host()}.{os.getpid()}.tmp"


class _HashingWriter(io.RawIOBase):
    """A write-only, non-seekable file that hashes what goes through it."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.sha = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = self._f.write(view)
        self.sha.update(view[:n])
        self.size += n
        return n

    def flush(self) -> None:
        self._f.flush()


def _hash_file(f: BinaryIO) -> tuple[str, int]:
    f.seek(0)
    sha, size = hashlib.sha256(), 0
    while chunk := f.read(1 << 20):
        sha.update(chunk)
        size += len(chunk)
    return sha.hexdigest(), size


def _new_tmp(tmp: Path) -> BinaryIO:
    """``tmp`` made anew: a leftover of an earlier process with this pid is
    removed first; a link or a FIFO at the name is never opened."""
    tmp.unlink(missing_ok=True)
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.fdopen(os.open(tmp, flags, 0o666), "w+b")


def _write_data(tmp: Path, write: Callable[[BinaryIO], object]) -> tuple[str, int]:
    """Write the data to ``tmp`` through ``write``, fsync; its SHA-256 and size."""
    with _new_tmp(tmp) as f:
        hasher = _HashingWriter(f)
        try:
            write(hasher)  # type: ignore[arg-type]
            hasher.flush()
            digest, size = hasher.sha.hexdigest(), hasher.size
        except io.UnsupportedOperation:
            # The writer wanted to seek: write the file directly, then hash it.
            f.seek(0)
            f.truncate()
            write(f)
            f.flush()
            digest, size = _hash_file(f)
        os.fsync(f.fileno())
    return digest, size


def _write_small(final: Path, data: bytes) -> None:
    """Atomically replace ``final`` with ``data`` (temp file, fsync, rename)."""
    tmp = _tmp_for(final)
    try:
        with _new_tmp(tmp) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _record_bytes(final: Path, step: int, size: int, digest: str) -> bytes:
    record = {"v": RECORD_VERSION, "file": final.name, "step": step, "size": size, "sha256": digest}
    return json.dumps(record).encode() + b"\n"


def write_checkpoint(
    directory: Path, step: int, write: Callable[[BinaryIO], object]
) -> tuple[Path, str]:
    """Write checkpoint ``step`` (its data produced by ``write(file)``) and its
    record, crash-safely (see the module docstring). Returns (path, SHA-256)."""
    final = checkpoint_path(directory, step)
    tmp = _tmp_for(final)
    try:
        digest, size = _write_data(tmp, write)
        _write_small(record_path(final), _record_bytes(final, step, size, digest))
        _fsync_dir(directory)  # the record is durable before the data's name appears
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(directory)
    return final, digest


def _prune(d: Path, keep: int) -> None:
    found = list_checkpoints(d)
    if keep > 0:
        for old in found[:-keep]:
            old.path.unlink(missing_ok=True)  # the data first: never data without its record
            record_path(old.path).unlink(missing_ok=True)
        found = found[-keep:]
    oldest = found[0].step if found else None
    host = _host()
    for name in os.listdir(d):
        m = _TMP.match(name)
        if m and m.group("host") == host and not pid_alive(int(m.group("pid"))):
            (d / name).unlink(missing_ok=True)  # a save killed on this host
            continue
        r = _RECORD.match(name)
        stale = r is not None and oldest is not None and int(r.group(1)) < oldest
        if stale and not (d / name[: -len(RECORD_SUFFIX)]).exists():
            (d / name).unlink(missing_ok=True)  # a record whose save never finished


def publish(d: Path, final: Path, keep: int) -> None:
    """After a save: point ``latest`` at ``final`` if it is the newest, prune."""
    newest = latest_checkpoint(d)
    if newest is not None and newest.path == final:
        _write_small(d / LATEST, final.name.encode() + b"\n")
        _fsync_dir(d)
    _prune(d, keep)


# ----------------------------------------------------------------- checking


class RecordError(Exception):
    """A checksum record that cannot be trusted (the message says why)."""


@frozen(slots=True)
class Record:
    step: int
    size: int
    sha256: str


def read_record(path: Path) -> Record | None:
    """The checksum record of the checkpoint at ``path``; None if it has none.
    Raises RecordError when the record is unreadable or not about this file
    (a link, a FIFO or another special file there is unreadable: never
    followed, never waited on)."""
    try:
        raw = read_regular(str(record_path(path)), MAX_RECORD_BYTES + 1)
    except FileNotFoundError:
        return None
    except UnsafePath as e:
        raise RecordError(f"its checksum record {e.problem}") from e
    except OSError as e:
        raise RecordError(f"its checksum record cannot be read: {e.strerror or e}") from e
    try:  # within the bounds: a planted record nested deep is refused, not a RecursionError
        obj = loads(raw, max_bytes=MAX_RECORD_BYTES, what="its checksum record")
    except UntrustedData as e:
        raise RecordError(str(e)) from None
    obj = Fields.versioned(obj, RECORD_VERSION, "its checksum record", RecordError).raw
    step, size, sha = obj.get("step"), obj.get("size"), obj.get("sha256")
    if obj.get("file") != path.name or not is_int(step):
        raise RecordError("its checksum record is about another file")
    if not is_int(size) or size < 0:
        raise RecordError("its checksum record has no valid size")
    if not isinstance(sha, str) or not _SHA256.match(sha):
        raise RecordError("its checksum record has no valid sha256")
    return Record(step, size, sha)


def check(info: CheckpointInfo, data: bytes | bytearray) -> Verdict:
    """Compare a checkpoint's bytes with its record."""
    digest = hashlib.sha256(data).hexdigest()
    try:
        record = read_record(info.path)
    except RecordError as e:
        return Verdict("damaged", digest, str(e))
    if record is None:
        return Verdict("unverified", digest)
    if record.step != info.step:
        return Verdict("damaged", digest, f"its checksum record is for step {record.step}")
    if len(data) != record.size:
        why = f"{len(data)} bytes where its checksum record says {record.size}"
        return Verdict("damaged", digest, why)
    if digest != record.sha256:
        why = f"SHA-256 {digest[:16]}... where its checksum record says {record.sha256[:16]}..."
        return Verdict("damaged", digest, why)
    return Verdict("verified", digest)


def _free_name(target: Path) -> Path:
    if not target.exists():
        return target
    for n in range(1, MAX_ASIDE_NAMES):
        candidate = target.with_name(f"{target.name}.{n}")
        if not candidate.exists():
            return candidate
    return target.with_name(f"{target.name}.{os.getpid()}.{time.time_ns()}")


def move_aside(info: CheckpointInfo) -> Path:
    """Rename a damaged checkpoint (and its record, if any) into ``corrupt/``
    beside it; returns where the data went. FileNotFoundError: it is gone
    already (another rank sharing the directory moved it); OSError otherwise."""
    aside = info.path.parent / CORRUPT_DIR
    aside.mkdir(exist_ok=True)
    dest = _free_name(aside / info.path.name)
    os.rename(info.path, dest)
    with contextlib.suppress(FileNotFoundError):
        os.rename(record_path(info.path), dest.with_name(dest.name + RECORD_SUFFIX))
    latest = info.path.parent / LATEST
    with contextlib.suppress(OSError):
        pointer = read_regular(str(latest), MAX_RECORD_BYTES)  # never blocked by a FIFO
        if pointer.decode("utf-8", errors="replace").strip() == info.path.name:
            newest = latest_checkpoint(info.path.parent)
            if newest is None:
                latest.unlink()
            else:
                _write_small(latest, newest.path.name.encode() + b"\n")
    _fsync_dir(aside)
    _fsync_dir(info.path.parent)
    return dest
