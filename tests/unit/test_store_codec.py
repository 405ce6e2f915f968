"""The embedded store's wire codec: values in base64."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from elastrun.errors import ProtocolError
from elastrun.store import codec
from elastrun.store.base import Compare, Count, Get, KeyValue, Put, TxnResult


def test_large_values_are_encoded_and_decoded_right_when_reused() -> None:
    """A large value is base64-encoded once for the many answers carrying
    it; equal texts decode to equal bytes, and another value of the same
    size is never taken for it."""
    a, b = b"a" * 200_000, b"b" * 200_000
    kv_a = KeyValue("k", a, 1, 1, 1)
    first = codec.encode_kv(kv_a)
    assert codec.encode_kv(kv_a)["value"] == first["value"]
    assert codec.encode_kv(KeyValue("k", b, 1, 2, 2))["value"] != first["value"]
    for value in (a, b, a):
        wire = json.loads(json.dumps(codec.encode_kv(KeyValue("k", value, 1, 1, 1))))
        assert codec.decode_kv(wire).value == value


def test_count_ops_and_counts_round_trip_and_bad_counts_are_refused() -> None:
    op = codec.decode_op(json.loads(json.dumps(codec.encode_op(Count("p/")))))
    assert op == Count("p/")
    result = TxnResult(True, 7, [[]], [3, 0])
    wire = json.loads(json.dumps(codec.encode_txn_result(result)))
    assert codec.decode_txn_result(wire) == result
    # A txn without Count ops answers as before (no "counts" field).
    plain = codec.encode_txn_result(TxnResult(False, 7, []))
    assert "counts" not in plain and codec.decode_txn_result(plain).counts == []
    for bad in ([-1], ["3"], [True], 3, [2**63]):
        with pytest.raises(ProtocolError, match="counts"):
            codec.decode_txn_result({**plain, "counts": bad})


KV = KeyValue("p/a", b"\x00v", 1, 1, 1, 0)
# Each request as the client writes it, and its frame's JSON, byte for byte:
# the wire is the protocol (docs/store-protocol.md), whatever the classes.
WIRE_REQUESTS: list[tuple[codec.Request, str]] = [
    (codec.GetRequest("k"), '"op":"get","key":"k"'),
    (codec.RangeRequest("p/"), '"op":"range","key":"p/"'),
    (codec.RangePageRequest("p/"), '"op":"range","key":"p/","page":true,"after":null,"limit":0'),
    (
        codec.RangePageRequest("p/", "p/a", 5),
        '"op":"range","key":"p/","page":true,"after":"p/a","limit":5',
    ),
    (codec.RangeNewestRequest("p/", 9, 2), '"op":"range","key":"p/","max_create":9,"limit":2'),
    (codec.PutRequest("k", b"\x00v", 3), '"op":"put","key":"k","value":"AHY=","lease":3'),
    (codec.DeleteRequest("p/", True), '"op":"delete","key":"p/","prefix":true'),
    (
        codec.TxnRequest([Compare("k", "mod", "==", 4)], [Put("k", b"x", 0)], [Get("k")]),
        '"op":"txn","compares":[{"key":"k","target":"mod","op":"==","value":4}],'
        '"success":[{"op":"put","key":"k","value":"eA==","lease":0}],'
        '"failure":[{"op":"get","key":"k","prefix":false}]',
    ),
    (codec.LeaseGrantRequest(10.0), '"op":"lease_grant","ttl":10.0'),
    (codec.LeaseKeepaliveRequest(5), '"op":"lease_keepalive","lease":5'),
    (codec.LeaseRevokeRequest(5), '"op":"lease_revoke","lease":5'),
    (
        codec.WatchRequest(2, "p/", True),
        '"op":"watch","watch":2,"key":"p/","prefix":true,"start_revision":null',
    ),
    (
        codec.WatchRequest(2, "k", False, 8),
        '"op":"watch","watch":2,"key":"k","prefix":false,"start_revision":8',
    ),
    (codec.WatchCancelRequest(2), '"op":"watch_cancel","watch":2'),
    (codec.CompactRequest(6), '"op":"compact","revision":6'),
    (codec.PingRequest(), '"op":"ping"'),
]


@pytest.mark.parametrize(("request_", "fields"), WIRE_REQUESTS)
def test_each_request_is_written_as_the_protocol_says_and_read_back(
    request_: codec.Request, fields: str
) -> None:
    wire = codec.encode_frame(codec.encode_request(7, request_))[4:]
    assert wire == ('{"v":1,"t":"req","id":7,' + fields + "}").encode()
    assert codec.decode_request(json.loads(wire)) == (7, request_)


def test_every_operation_has_a_request_class() -> None:
    assert {r.OP for r, _ in WIRE_REQUESTS} == codec.OPS


@pytest.mark.parametrize(
    ("answer", "result"),
    [
        (codec.GetAnswer(KV, 2), {"kv": codec.encode_kv(KV), "revision": 2}),
        (codec.GetAnswer(None, 2), {"kv": None, "revision": 2}),
        (codec.RangeAnswer([KV], 2), {"kvs": [codec.encode_kv(KV)], "revision": 2}),
        (codec.RangeAnswer([], 2, more=True), {"kvs": [], "revision": 2, "more": True}),
        (
            codec.RangeAnswer([KV], 2, count=4),
            {"kvs": [codec.encode_kv(KV)], "count": 4, "revision": 2},
        ),
        (codec.RevisionAnswer(3), {"revision": 3}),
        (codec.DeleteAnswer(2, 4), {"deleted": 2, "revision": 4}),
        (codec.LeaseGrantAnswer(9, 10.0), {"lease": 9, "ttl": 10.0}),
        (codec.LeaseKeepaliveAnswer(1.5), {"ttl": 1.5}),
        (codec.CompactAnswer(4, 2), {"revision": 4, "compact_revision": 2}),
        (codec.EmptyAnswer(), {}),
        (
            TxnResult(True, 3, [[KV]], [1]),
            {"succeeded": True, "revision": 3, "gets": [[codec.encode_kv(KV)]], "counts": [1]},
        ),
    ],
)
def test_each_answer_is_written_as_the_protocol_says_and_read_back(
    answer: codec.Answer, result: dict[str, object]
) -> None:
    written = codec.encode_response(4, answer)
    assert json.dumps(written) == json.dumps(
        {"v": 1, "t": "resp", "id": 4, "ok": True, "result": result}
    )
    read = codec.decode_txn_result if isinstance(answer, TxnResult) else type(answer).from_json
    assert read(json.loads(json.dumps(written["result"]))) == answer


@pytest.mark.parametrize(
    ("read", "result", "message"),
    [
        (codec.RangeAnswer.from_json, {"kvs": {}, "revision": 1}, "kvs is not a list"),
        (
            codec.RangeAnswer.from_json,
            {"kvs": [], "revision": 1, "count": -1},
            "count is not an integer",
        ),
        (codec.LeaseKeepaliveAnswer.from_json, {"ttl": "5"}, "ttl is not a finite number"),
        (
            codec.LeaseGrantAnswer.from_json,
            {"lease": 0, "ttl": 1.0},
            "lease is not an integer from 1",
        ),
        (codec.GetAnswer.from_json, {"kv": 3, "revision": 1}, "key-value"),
    ],
)
def test_malformed_answers_are_protocol_errors(
    read: Callable[[dict[str, object]], object], result: dict[str, object], message: str
) -> None:
    with pytest.raises(ProtocolError, match=message):
        read(result)
