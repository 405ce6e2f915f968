"""The embedded store's wire codec: values in base64."""

from __future__ import annotations

import json

import pytest

from elastrun.errors import ProtocolError
from elastrun.store import codec
from elastrun.store.base import Count, KeyValue, TxnResult


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
