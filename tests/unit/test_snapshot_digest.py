"""A snapshot's data digest (worker/snapshot_digest): chunk digests computed
in parallel, or streamed by the agent in pieces of any size, agree; any
change of the data changes them; an unknown algorithm, or one whose library
is missing, is refused with the reason; a header without a ``digest`` is the
plain SHA-256 of the snapshots written before chunk digests."""

from __future__ import annotations

import hashlib
import os
import sys

import pytest

from elastrun.worker.snapshot import (
    SnapshotError,
    SnapshotHeader,
    TensorEntry,
    check_data,
    parse_header,
)
from elastrun.worker.snapshot_digest import (
    CHUNK,
    SHA256,
    SHA256_CHUNKS,
    XXH3_CHUNKS,
    DataDigest,
    UnknownDigest,
    data_digest,
    preferred,
)

SIZES = (0, 1, CHUNK - 1, CHUNK, 2 * CHUNK + 5)
DATA = os.urandom(2 * CHUNK + 5)


def _algorithms() -> list[str]:
    try:
        import xxhash  # type: ignore[import-not-found,unused-ignore]  # noqa: F401
    except ImportError:
        return [SHA256, SHA256_CHUNKS]
    return [SHA256, SHA256_CHUNKS, XXH3_CHUNKS]


@pytest.mark.parametrize("algorithm", _algorithms())
def test_parallel_serial_and_streamed_digests_agree(algorithm: str) -> None:
    for size in SIZES:
        data = memoryview(DATA)[:size]
        want = data_digest(data, algorithm, parallel=False)
        assert data_digest(data, algorithm) == want
        streamed = DataDigest(algorithm)
        for i in range(0, size, 3 << 20):  # pieces across the chunks' edges
            streamed.update(data[i : i + (3 << 20)])
        assert streamed.hexdigest() == want, size
    if algorithm == SHA256:  # the snapshots written before chunk digests
        assert data_digest(memoryview(DATA), SHA256) == hashlib.sha256(DATA).hexdigest()


@pytest.mark.parametrize("algorithm", _algorithms())
def test_any_change_of_the_data_changes_its_digest(algorithm: str) -> None:
    want = data_digest(memoryview(DATA), algorithm)
    flipped = bytearray(DATA)
    flipped[CHUNK + 7] ^= 1
    swapped = DATA[CHUNK : 2 * CHUNK] + DATA[:CHUNK] + DATA[2 * CHUNK :]
    for changed in (bytes(flipped), swapped, DATA[:-1], DATA + b"\0", DATA[: 2 * CHUNK]):
        assert data_digest(memoryview(changed), algorithm) != want


def test_a_digest_unknown_or_without_its_library_is_refused_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(UnknownDigest, match="not one of"):
        data_digest(memoryview(b"x"), "md5")
    monkeypatch.setitem(sys.modules, "xxhash", None)  # not installed here
    assert preferred() == SHA256_CHUNKS
    header = _header(XXH3_CHUNKS, "0" * 64)
    with pytest.raises(SnapshotError, match="xxhash package is not installed"):
        check_data(header, memoryview(b"\0" * 64))


def _header(digest: str, sha: str) -> SnapshotHeader:
    return SnapshotHeader(
        step=1,
        rank=0,
        world_size=1,
        generation=1,
        data_size=64,
        sha256=sha,
        tensors=(TensorEntry("state", "uint8", (64,), 0, 64),),
        tree={"t": 0},
        digest=digest,
    )


def test_the_header_names_its_digest_and_an_unknown_one_is_refused() -> None:
    data = memoryview(bytes(range(64)))
    header = _header(SHA256_CHUNKS, data_digest(data, SHA256_CHUNKS))
    check_data(header, data)
    with pytest.raises(SnapshotError, match="its data's digest"):
        check_data(header, memoryview(bytes(64)))
    for digest, ok in ((SHA256_CHUNKS, True), ("crc32", False)):
        body = header.encode().replace(b'"digest":"sha256-chunks"', f'"digest":"{digest}"'.encode())
        raw = b"ELMCKPT1" + len(body).to_bytes(8, "little") + body
        blob = raw + bytes(-len(raw) % 64) + bytes(data)
        if ok:
            assert parse_header(blob, len(blob), sealed=False)[0].digest == digest
        else:
            with pytest.raises(SnapshotError, match="no known data digest"):
                parse_header(blob, len(blob), sealed=False)
