"""A snapshot written as a ``torch.save`` file, without torch.

The agent writes the memory checkpoints marked for the disk
(:func:`~elastrun.agent.memory.persist_snapshot`) in torch's own file format,
so that a user's tools read them with a plain
``torch.load(path, weights_only=True)``: a zip archive (stored, not
compressed) of

* ``<name>/data.pkl``: the state's tree as a pickle (protocol 2) of dicts,
  lists, tuples, numbers, strings, None, and tensors rebuilt by
  ``torch._utils._rebuild_tensor_v3`` from their storages (the globals that
  ``weights_only=True`` allows);
* ``<name>/data/<i>``: tensor ``i``'s bytes, as the snapshot holds them;
* ``<name>/version``, ``.format_version``, ``byteorder``: what torch writes;
* ``<name>/elastrun-snapshot``: the snapshot's header (sealed JSON:
  :mod:`elastrun.worker.snapshot`), which torch ignores and elastrun reads to
  give back what a plain tensor cannot say: a DTensor's layout
  (:mod:`elastrun.worker.shard_layout`).

A DTensor's place holds its local shard, a plain tensor (``torch.load``
gives each rank's shards; ``elastrun checkpoint-convert`` puts the ranks'
shards together).

Standard library only: the agent never imports torch.
"""

from __future__ import annotations

import struct
import zipfile
from collections.abc import Callable, Iterator
from typing import IO, Any

from elastrun.untrusted import UntrustedData, loads
from elastrun.worker.snapshot import (
    MAX_DEPTH,
    SnapshotError,
    SnapshotHeader,
    TensorEntry,
    check_header_size,
)
from elastrun.worker.snapshot_bounds import MAX_HEADER, sealed_digest

__all__ = ["HEADER_RECORD", "header_record", "pickle_tree", "write_torch_file"]

HEADER_RECORD = "elastrun-snapshot"
_CHUNK = 8 << 20


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _int(v: int) -> bytes:
    if 0 <= v < 256:
        return b"K" + bytes([v])
    if 0 <= v < 65536:
        return b"M" + v.to_bytes(2, "little")
    if -(2**31) <= v < 2**31:
        return b"J" + v.to_bytes(4, "little", signed=True)
    raw = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw  # LONG1 (an int64's 9 bytes at most)


def _str(s: str) -> bytes:
    raw = s.encode("utf-8", "surrogatepass")
    return b"X" + len(raw).to_bytes(4, "little") + raw


def _tuple(items: list[bytes]) -> bytes:
    return b"(" + b"".join(items) + b"t"


def _tensor(i: int, e: TensorEntry) -> bytes:
    """``_rebuild_tensor_v3(storage, 0, shape, contiguous stride, False, OrderedDict(), dtype)``."""
    stride, acc = [], 1
    for d in reversed(e.shape):
        stride.append(acc)
        acc *= max(d, 1)
    stride.reverse()
    storage = _tuple(
        [
            _str("storage"),
            _global("torch.storage", "UntypedStorage"),
            _str(str(i)),
            _str("cpu"),
            _int(e.nbytes),
        ]
    )
    args = [
        storage + b"Q",  # BINPERSID: the storage record data/<i>
        _int(0),
        _tuple([_int(d) for d in e.shape]),
        _tuple([_int(s) for s in stride]),
        b"\x89",  # requires_grad False
        _global("collections", "OrderedDict") + b")R",
        _global("torch", e.dtype),
    ]
    return _global("torch._utils", "_rebuild_tensor_v3") + _tuple(args) + b"R"


def _plain(value: Any) -> bytes:
    """None, a bool, an int or a str, pickled."""
    if value is None:
        return b"N"
    if value is True or value is False:
        return b"\x88" if value else b"\x89"
    return _int(value) if isinstance(value, int) else _str(value)


def pickle_tree(header: SnapshotHeader) -> bytes:
    """The pickle (protocol 2) of the state a snapshot's tree describes."""
    out: list[bytes] = [b"\x80\x02"]

    def emit(node: Any) -> None:
        ((tag, value),) = node.items()
        if tag == "t":
            out.append(_tensor(value, header.tensors[value]))
        elif tag == "s":  # a DTensor: its local shard
            out.append(_tensor(value[0], header.tensors[value[0]]))
        elif tag == "v":
            out.append(_plain(value))
        elif tag == "f":
            out.append(b"G" + struct.pack(">d", float.fromhex(value)))
        elif tag == "d":
            out.append(b"}")
            if value:
                out.append(b"(")
                for k, v in value:
                    out.append(_int(k) if isinstance(k, int) else _str(k))
                    emit(v)
                out.append(b"u")
        elif tag == "l":
            out.append(b"]")
            if value:
                out.append(b"(")
                for v in value:
                    emit(v)
                out.append(b"e")
        else:  # "u": a tuple
            out.append(b"(")
            for v in value:
                emit(v)
            out.append(b"t")

    emit(header.tree)
    out.append(b".")
    return b"".join(out)


def write_torch_file(
    f: IO[bytes],
    name: str,
    header: SnapshotHeader,
    header_bytes: bytes,
    chunks: Callable[[TensorEntry], Iterator[memoryview]],
) -> None:
    """Write the state of ``header`` to ``f`` as a ``torch.save`` file whose
    records are under ``name``/; ``chunks(entry)`` yields a tensor's bytes."""
    with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as z:

        def record(path: str, data: bytes) -> None:
            z.writestr(zipfile.ZipInfo(f"{name}/{path}", date_time=(1980, 1, 1, 0, 0, 0)), data)

        record("data.pkl", pickle_tree(header))
        record(".format_version", b"1")
        record("byteorder", b"little")
        for i, e in enumerate(header.tensors):
            info = zipfile.ZipInfo(f"{name}/data/{i}", date_time=(1980, 1, 1, 0, 0, 0))
            info.file_size = e.nbytes  # zip64 when it needs it
            with z.open(info, "w") as out:
                for chunk in chunks(e):
                    out.write(chunk)
        record("version", b"3\n")
        record(HEADER_RECORD, header_bytes)


def header_record(data: bytes | bytearray) -> SnapshotHeader | None:
    """The snapshot header a file written by :func:`write_torch_file` holds
    (None: another ``torch.save`` file, or not a zip archive). SnapshotError:
    the record is there but damaged."""
    import io

    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            names = [n for n in z.namelist() if n.endswith("/" + HEADER_RECORD)]
            if len(names) != 1 or z.getinfo(names[0]).file_size > MAX_HEADER:
                return None
            raw = z.read(names[0])
    except (zipfile.BadZipFile, OSError, ValueError):
        return None
    why = check_header_size(raw)
    digests = sealed_digest(raw)
    if why is None and (digests is None or digests[0] != digests[1]):
        why = "it does not match its seal"
    if why is not None:
        raise SnapshotError(f"its snapshot header record: {why}")
    try:
        obj = loads(raw, max_bytes=MAX_HEADER, max_depth=MAX_DEPTH)
    except UntrustedData as e:
        raise SnapshotError(f"its snapshot header record: {e}") from None
    return SnapshotHeader.from_json(obj)
