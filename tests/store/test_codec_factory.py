"""The wire codec (no sockets) and the backend factory's endpoint parsing."""

from __future__ import annotations

import asyncio
import struct

import pytest

from elastrun.errors import ConfigError, ProtocolError
from elastrun.store import codec
from elastrun.store.base import Compare, Delete, Get, KeyValue, Op, Put, TxnResult, WatchEvent
from elastrun.store.factory import open_store, parse_endpoint
from elastrun.store.memory import MemoryStore

KV = KeyValue("k/\u00e9", b"\x00\xffdata", 3, 7, 2, 99)


def test_values_round_trip_through_json_frames() -> None:
    ops: list[Op] = [Put("a", b"\x00", 4), Delete("p/", True), Get("a")]
    compares = [Compare.absent("a"), Compare("b", "value", "!=", b"\x01")]
    txn = codec.encode_request(5, codec.TxnRequest(compares, ops, []))
    decoder = codec.FrameDecoder()
    data = codec.encode_frame(txn) + codec.encode_frame(
        codec.encode_events(3, [WatchEvent("put", KV)])
    )
    frames = []
    for i in range(len(data)):  # one byte at a time: partial frames are kept
        frames += decoder.feed(data[i : i + 1])
    request_id, request = codec.decode_request(frames[0])
    assert request_id == 5 and isinstance(request, codec.TxnRequest)
    assert request.compares == [Compare.absent("a"), Compare("b", "value", "!=", b"\x01")]
    assert request.success == [Put("a", b"\x00", 4), Delete("p/", True), Get("a")]
    assert [codec.decode_event(e) for e in frames[1]["events"]] == [WatchEvent("put", KV)]
    result = TxnResult(True, 9, [[KV], []])
    assert codec.decode_txn_result(codec.encode_txn_result(result)) == result


def test_an_events_frame_encoded_once_decodes_as_encoded_per_watch() -> None:
    events = [
        WatchEvent("put", KeyValue("/a", bytes(range(256)) * 9, 5, 7, 2, 0)),
        WatchEvent("delete", KeyValue("/b\u00e9", b"", 3, 7, 0, 0)),
    ]
    body = codec.encode_events_body(events)
    for watch_id, partial in ((1, False), (2**40, True)):
        expected = codec.encode_events(watch_id, events)
        if partial:
            expected["partial"] = True
        decoded = codec.FrameDecoder().feed(codec.events_frame(watch_id, body, partial))
        assert decoded == [expected]
    with pytest.raises(ProtocolError, match="exceeds"):
        codec.events_frame(1, b'["' + b"x" * codec.MAX_FRAME + b'"]')


@pytest.mark.parametrize(
    "frame",
    [
        {"v": 1, "t": "req", "id": 1, "op": "explode"},
        {"v": 1, "t": "req", "id": "1", "op": "get", "key": "k"},
        {"v": 1, "t": "req", "id": 1, "op": "get", "key": 5},
        {"v": 1, "t": "req", "id": 1, "op": "put", "key": "k", "value": "not base64!"},
        {"v": 1, "t": "req", "id": 1, "op": "lease_grant", "ttl": True},
        {"v": 1, "t": "req", "id": 1, "op": "lease_keepalive", "lease": -3},
        {"v": 1, "t": "req", "id": 1, "op": "txn", "compares": [{"key": "k", "target": "x"}]},
        {"v": 1, "t": "req", "id": 1, "op": "txn", "success": [{"op": "rm", "key": "k"}]},
        {"v": 1, "t": "req", "id": 1, "op": "watch", "watch": 0, "key": "k"},
    ],
)
def test_malformed_requests_are_protocol_errors(frame: dict[str, object]) -> None:
    with pytest.raises(ProtocolError):
        codec.decode_request(frame)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (struct.pack(">I", codec.MAX_FRAME + 1), "exceeds"),
        (struct.pack(">I", 3) + b"\xff\xfe\xfd", "not UTF-8 JSON"),
        (struct.pack(">I", 2) + b"[]", "JSON object"),
        (struct.pack(">I", 8) + b'{"v":99}', "version 99"),
        (struct.pack(">I", 9) + b'{"v":NaN}', "not UTF-8 JSON"),
    ],
)
def test_bad_frames_are_protocol_errors(data: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        codec.FrameDecoder().feed(data)


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("node1", ("node1", 29400)),
        ("node1:1234", ("node1", 1234)),
        ("10.0.0.1:0", ("10.0.0.1", 0)),
        ("[::1]:29500", ("::1", 29500)),
        ("[fe80::1]", ("fe80::1", 29400)),
        ("::1", ("::1", 29400)),
    ],
)
def test_parse_endpoint(endpoint: str, expected: tuple[str, int]) -> None:
    assert parse_endpoint(endpoint, 29400) == expected


@pytest.mark.parametrize(
    "endpoint", ["", ":80", "host:http", "host:70000", "[::1", "[x]:1", "a:b:c"]
)
def test_parse_endpoint_rejects_malformed(endpoint: str) -> None:
    with pytest.raises(ConfigError, match=r"endpoint|empty"):
        parse_endpoint(endpoint, 29400)


def test_open_store_picks_backends_and_names_unknown_ones() -> None:
    async def body() -> None:
        store = await open_store("memory", "")
        assert isinstance(store, MemoryStore)
        await store.close()
        with pytest.raises(ConfigError, match="'zookeeper'"):
            await open_store("zookeeper", "h:1")

    asyncio.run(body())
