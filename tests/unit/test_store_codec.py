"""The embedded store's wire codec: values in base64."""

from __future__ import annotations

import json

from elastrun.store import codec
from elastrun.store.base import KeyValue


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
