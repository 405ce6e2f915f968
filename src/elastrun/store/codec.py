"""The embedded store's wire codec (no sockets here).

Framing: every message is one **frame**: a 4-byte big-endian length, then that
many bytes of UTF-8 JSON holding one object. Frames larger than
:data:`MAX_FRAME` are refused (before the hello, larger than
:data:`~elastrun.store.limits.PRE_HELLO_FRAME`). Byte values travel as base64
strings.

Messages (every one carries ``"v": PROTOCOL_VERSION``): the client's hello
and the server's answer, requests (``"t": "req"``) and their responses
(``"t": "resp"``), a watch's events (``"t": "events"``; one frame never
splits a revision), the server ending a watch (``"t": "cancel"``) or the
connection (``"t": "error"``): docs/store-protocol.md has each one's fields.

Decoding is strict: a wrong type, an unknown op or a missing field raises
:class:`~elastrun.errors.ProtocolError`; nothing else escapes.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast

from elastrun.errors import ProtocolError
from elastrun.store.base import (
    NO_LEASE,
    Compare,
    Count,
    Delete,
    Get,
    KeyValue,
    Op,
    Put,
    TxnResult,
    WatchEvent,
)
from elastrun.store.limits import MAX_FRAME

__all__ = [
    "MAX_FRAME",
    "OPS",
    "PROTOCOL_VERSION",
    "FrameDecoder",
    "Request",
    "b64",
    "decode_compare",
    "decode_event",
    "decode_kv",
    "decode_op",
    "decode_request",
    "decode_txn_result",
    "encode_cancel",
    "encode_compare",
    "encode_error",
    "encode_event",
    "encode_events",
    "encode_frame",
    "encode_kv",
    "encode_op",
    "encode_request",
    "encode_response",
    "encode_txn_result",
    "error_response",
    "expect_bool",
    "expect_int",
    "expect_str",
    "hello",
]

PROTOCOL_VERSION = 1
_HEADER = struct.Struct(">I")
_MAX_INT = (1 << 63) - 1

OPS = frozenset(
    {
        "get",
        "range",
        "put",
        "delete",
        "txn",
        "lease_grant",
        "lease_keepalive",
        "lease_revoke",
        "watch",
        "watch_cancel",
        "compact",
        "ping",
    }
)

Json = dict[str, Any]


# -- framing ------------------------------------------------------------------
def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


# One encoder and one decoder for every frame: json.dumps and json.loads with
# options build a new one at each call (a cost per request on the store host).
_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def encode_frame(message: Mapping[str, Any]) -> bytes:
    body = _ENCODER.encode(message).encode("utf-8")
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"message of {len(body)} bytes exceeds the {MAX_FRAME}-byte limit")
    return _HEADER.pack(len(body)) + body


class FrameDecoder:
    """Incremental decoder: :meth:`feed` bytes as they arrive, get whole frames.

    Keeps at most one partial frame. A length over ``max_frame``, bytes that
    are not UTF-8 JSON, or JSON that is not an object raise ProtocolError;
    after that the decoder is unusable (close the connection).
    """

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()

    @property
    def pending(self) -> int:
        """Bytes received that do not yet form a whole frame."""
        return len(self._buf)

    def clear(self) -> None:
        """Drop what is buffered (the connection is closing)."""
        self._buf = bytearray()

    def push(self, data: bytes) -> None:
        """Buffer received bytes; take frames out with :meth:`pop`."""
        self._buf += data

    def pop(self) -> Json | None:
        """The next whole frame, or None until more bytes arrive. Raises
        ProtocolError for an oversized or malformed frame."""
        if len(self._buf) < _HEADER.size:
            return None
        (length,) = _HEADER.unpack_from(self._buf)
        if length > self.max_frame:
            raise ProtocolError(f"frame of {length} bytes exceeds the {self.max_frame}-byte limit")
        end = _HEADER.size + length
        if len(self._buf) < end:
            return None
        body = self._buf[_HEADER.size : end]
        del self._buf[:end]
        return _parse(body)

    def feed(self, data: bytes) -> list[Json]:
        """:meth:`push`, then every whole frame. A bad frame raises, losing
        the good frames before it in ``data``: use push/pop to keep them."""
        self.push(data)
        frames: list[Json] = []
        while (frame := self.pop()) is not None:
            frames.append(frame)
        return frames


def _parse(body: bytes | bytearray) -> Json:
    try:
        obj = _DECODER.decode(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"frame is not UTF-8 JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"frame must hold a JSON object, got {type(obj).__name__}")
    version = obj.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"unsupported elastrun store protocol version {version!r} "
            f"(this side speaks version {PROTOCOL_VERSION}); upgrade the older side"
        )
    return obj


# -- field validation ---------------------------------------------------------
def expect_int(obj: Mapping[str, Any], name: str, *, minimum: int = 0) -> int:
    value = obj.get(name)
    if type(value) is not int or not minimum <= value <= _MAX_INT:
        raise ProtocolError(f"field {name!r} must be an integer >= {minimum}, got {value!r:.80}")
    return value


def expect_str(obj: Mapping[str, Any], name: str) -> str:
    value = obj.get(name)
    if not isinstance(value, str):
        raise ProtocolError(f"field {name!r} must be a string, got {type(value).__name__}")
    return value


def expect_bool(obj: Mapping[str, Any], name: str, default: bool | None = None) -> bool:
    value = obj.get(name, default)
    if not isinstance(value, bool):
        raise ProtocolError(f"field {name!r} must be a boolean, got {type(value).__name__}")
    return value


def _expect_obj(value: Any, what: str) -> Json:
    if not isinstance(value, dict):
        raise ProtocolError(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def _expect_list(obj: Mapping[str, Any], name: str) -> list[Any]:
    value = obj.get(name, [])
    if not isinstance(value, list):
        raise ProtocolError(f"field {name!r} must be a list, got {type(value).__name__}")
    return value


# A value at least this large is encoded (and decoded) once for the many
# answers and events that carry it: every member of a round of thousands of
# nodes reads the same result record of hundreds of KiB.
_REUSED = 64 * 1024


class _LastBase64:
    """The last large value encoded, (bytes object, text), and the last
    large text decoded, (text, bytes): each pair swapped in one assignment,
    reused only for the same bytes object, or an equal text."""

    encoded: tuple[bytes, str] = (b"", "")
    decoded: tuple[str, bytes] = ("", b"")


def b64(data: bytes) -> str:
    if len(data) < _REUSED:
        return base64.b64encode(data).decode("ascii")
    data_seen, text = _LastBase64.encoded
    if data is not data_seen:
        text = base64.b64encode(data).decode("ascii")
        _LastBase64.encoded = (data, text)
    return text


def _unb64(obj: Mapping[str, Any], name: str) -> bytes:
    text = expect_str(obj, name)
    large = len(text) >= _REUSED
    if large:
        text_seen, data = _LastBase64.decoded
        if text == text_seen:
            return data
    try:
        data = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise ProtocolError(f"field {name!r} is not valid base64") from None
    if large:
        _LastBase64.decoded = (text, data)
    return data


# -- values -------------------------------------------------------------------
def encode_kv(kv: KeyValue) -> Json:
    return {
        "key": kv.key,
        "value": b64(kv.value),
        "create": kv.create_revision,
        "mod": kv.mod_revision,
        "version": kv.version,
        "lease": kv.lease,
    }


def decode_kv(value: Any) -> KeyValue:
    obj = _expect_obj(value, "key-value")
    return KeyValue(
        key=expect_str(obj, "key"),
        value=_unb64(obj, "value"),
        create_revision=expect_int(obj, "create"),
        mod_revision=expect_int(obj, "mod"),
        version=expect_int(obj, "version"),
        lease=expect_int(obj, "lease"),
    )


def encode_event(event: WatchEvent) -> Json:
    return {"type": event.type, "kv": encode_kv(event.kv)}


def decode_event(value: Any) -> WatchEvent:
    obj = _expect_obj(value, "watch event")
    kind = obj.get("type")
    if kind not in ("put", "delete"):
        raise ProtocolError(f"unknown watch event type {kind!r:.40}")
    return WatchEvent(cast(Literal["put", "delete"], kind), decode_kv(obj.get("kv")))


_TARGETS = ("mod", "create", "version", "value", "lease")
_CMP_OPS = ("==", "!=", "<", ">")


def encode_compare(compare: Compare) -> Json:
    value: Any = b64(compare.value) if isinstance(compare.value, bytes) else compare.value
    return {"key": compare.key, "target": compare.target, "op": compare.op, "value": value}


def decode_compare(value: Any) -> Compare:
    obj = _expect_obj(value, "compare")
    target = obj.get("target")
    if target not in _TARGETS:
        raise ProtocolError(f"unknown compare target {target!r:.40}")
    op = obj.get("op")
    if op not in _CMP_OPS:
        raise ProtocolError(f"unknown compare operator {op!r:.40}")
    operand: int | bytes = _unb64(obj, "value") if target == "value" else expect_int(obj, "value")
    return Compare(expect_str(obj, "key"), target, op, operand)


def encode_op(op: Op) -> Json:
    if isinstance(op, Put):
        return {"op": "put", "key": op.key, "value": b64(op.value), "lease": op.lease}
    if isinstance(op, Delete):
        return {"op": "delete", "key": op.key, "prefix": op.prefix}
    if isinstance(op, Count):
        return {"op": "count", "key": op.prefix}
    return {"op": "get", "key": op.key, "prefix": op.prefix}


def decode_op(value: Any) -> Op:
    obj = _expect_obj(value, "txn operation")
    kind = obj.get("op")
    if kind == "put":
        return Put(expect_str(obj, "key"), _unb64(obj, "value"), expect_int(obj, "lease"))
    if kind == "delete":
        return Delete(expect_str(obj, "key"), expect_bool(obj, "prefix", False))
    if kind == "get":
        return Get(expect_str(obj, "key"), expect_bool(obj, "prefix", False))
    if kind == "count":
        return Count(expect_str(obj, "key"))
    raise ProtocolError(f"unknown txn operation {kind!r:.40}")


def encode_txn_result(result: TxnResult) -> Json:
    out: Json = {
        "succeeded": result.succeeded,
        "revision": result.revision,
        "gets": [[encode_kv(kv) for kv in kvs] for kvs in result.gets],
    }
    if result.counts:  # only with count ops: the answers of older clients' txns are as they were
        out["counts"] = list(result.counts)
    return out


def decode_txn_result(value: Any) -> TxnResult:
    obj = _expect_obj(value, "txn result")
    gets = []
    for kvs in _expect_list(obj, "gets"):
        if not isinstance(kvs, list):
            raise ProtocolError("txn result 'gets' must be a list of lists")
        gets.append([decode_kv(kv) for kv in kvs])
    counts = obj.get("counts", [])
    if not isinstance(counts, list) or not all(
        type(c) is int and 0 <= c <= _MAX_INT for c in counts
    ):
        raise ProtocolError("txn result 'counts' must be a list of counts")
    return TxnResult(expect_bool(obj, "succeeded"), expect_int(obj, "revision"), gets, counts)


# -- messages -----------------------------------------------------------------
def hello(token: str | None) -> Json:
    return {"v": PROTOCOL_VERSION, "t": "hello", "token": token}


def encode_request(request_id: int, op: str, **args: Any) -> Json:
    return {"v": PROTOCOL_VERSION, "t": "req", "id": request_id, "op": op, **args}


def encode_response(request_id: int, result: Any) -> Json:
    return {"v": PROTOCOL_VERSION, "t": "resp", "id": request_id, "ok": True, "result": result}


def error_response(request_id: int, code: str, message: str, **extra: Any) -> Json:
    return {
        "v": PROTOCOL_VERSION,
        "t": "resp",
        "id": request_id,
        "ok": False,
        "error": {"code": code, "message": message, **extra},
    }


def encode_cancel(
    watch_id: int, code: str, message: str, compact_revision: int = 0, next_revision: int = 0
) -> Json:
    return {
        "v": PROTOCOL_VERSION,
        "t": "cancel",
        "watch": watch_id,
        "code": code,
        "message": message,
        "compact_revision": compact_revision,
        "next_revision": next_revision,
    }


def encode_events(watch_id: int, events: list[WatchEvent]) -> Json:
    return {
        "v": PROTOCOL_VERSION,
        "t": "events",
        "watch": watch_id,
        "events": [encode_event(e) for e in events],
    }


def encode_events_body(events: list[WatchEvent]) -> bytes:
    """The ``events`` array of an ``events`` frame, encoded once for every
    watch it goes to (see :func:`events_frame`)."""
    return json.dumps([encode_event(e) for e in events], separators=(",", ":")).encode()


def events_frame(watch_id: int, body: bytes, partial: bool = False) -> bytes:
    """The frame of :func:`encode_events` (with ``"partial": true`` when
    ``partial``), from its array as :func:`encode_events_body` made it.
    ProtocolError if it exceeds the frame limit."""
    return b"".join(events_frame_parts(watch_id, body, partial))


def events_frame_parts(
    watch_id: int, body: bytes, partial: bool = False
) -> tuple[bytes, bytes, bytes]:
    """:func:`events_frame` in three parts, to be sent one after the other:
    the length and the watch's own fields, ``body`` itself (the same object,
    not a copy: every watch of a revision sends the same one), and the end.
    ProtocolError if the frame exceeds the frame limit."""
    head = b'{"v":%d,"t":"events","watch":%d,"events":' % (PROTOCOL_VERSION, watch_id)
    tail = b',"partial":true}' if partial else b"}"
    length = len(head) + len(body) + len(tail)
    if length > MAX_FRAME:
        raise ProtocolError(f"message of {length} bytes exceeds the {MAX_FRAME}-byte limit")
    return _HEADER.pack(length) + head, body, tail


def encode_error(code: str, message: str) -> Json:
    return {"v": PROTOCOL_VERSION, "t": "error", "code": code, "message": message}


@dataclass(frozen=True, slots=True)
class Request:
    """A validated request. ``args`` holds typed arguments for ``op``."""

    id: int
    op: str
    args: dict[str, Any]


def decode_request(obj: Mapping[str, Any]) -> Request:
    """Validate a ``req`` frame into typed arguments (ProtocolError if malformed).

    When the frame's ``id`` is readable, the server answers a malformed request
    with an error response (and keeps the connection); otherwise it hangs up.
    """
    if obj.get("t") != "req":
        raise ProtocolError(f"expected a request frame, got type {obj.get('t')!r:.40}")
    request_id = expect_int(obj, "id")
    op = obj.get("op")
    if op not in OPS:
        raise ProtocolError(f"unknown store operation {op!r:.40}")
    args: dict[str, Any] = {}
    if op in ("get", "range", "delete"):
        args["key"] = expect_str(obj, "key")
        if op == "delete":
            args["prefix"] = expect_bool(obj, "prefix", False)
        if op == "range" and "max_create" in obj:
            # Optional (a server that ignores it answers every key): up to
            # ``limit`` keys created at or before ``max_create``, newest first,
            # and the ``count`` of all keys under the prefix.
            args["max_create"] = expect_int(obj, "max_create")
            args["limit"] = expect_int(obj, "limit") if "limit" in obj else 0
        elif op == "range" and obj.get("page") is True:
            # Paged (the answer says ``more``): keys after ``after``, at most
            # ``limit`` of them (0: any number), within the server's page size.
            args["page"] = True
            args["after"] = expect_str(obj, "after") if obj.get("after") is not None else None
            args["limit"] = expect_int(obj, "limit") if "limit" in obj else 0
    elif op == "put":
        args["key"] = expect_str(obj, "key")
        args["value"] = _unb64(obj, "value")
        args["lease"] = expect_int(obj, "lease") if "lease" in obj else NO_LEASE
    elif op == "txn":
        args["compares"] = [decode_compare(c) for c in _expect_list(obj, "compares")]
        args["success"] = [decode_op(o) for o in _expect_list(obj, "success")]
        args["failure"] = [decode_op(o) for o in _expect_list(obj, "failure")]
    elif op == "lease_grant":
        ttl = obj.get("ttl")
        if not isinstance(ttl, int | float) or isinstance(ttl, bool) or not math.isfinite(ttl):
            raise ProtocolError(f"field 'ttl' must be a finite number, got {ttl!r:.40}")
        args["ttl"] = float(ttl)
    elif op in ("lease_keepalive", "lease_revoke"):
        args["lease"] = expect_int(obj, "lease", minimum=1)
    elif op == "watch":
        args["watch"] = expect_int(obj, "watch", minimum=1)
        args["key"] = expect_str(obj, "key")
        args["prefix"] = expect_bool(obj, "prefix", False)
        start = obj.get("start_revision")
        args["start_revision"] = None if start is None else expect_int(obj, "start_revision")
    elif op == "watch_cancel":
        args["watch"] = expect_int(obj, "watch", minimum=1)
    elif op == "compact":
        args["revision"] = expect_int(obj, "revision")
    return Request(request_id, op, args)
