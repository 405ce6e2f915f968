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

Each operation is one frozen request class (:data:`Request`: ``from_json``
reads a ``req`` frame's fields, ``to_json`` writes them) and each kind of
result one answer class (:data:`Answer`, a txn's being
:class:`~elastrun.store.base.TxnResult`): the server matches on the request
class, the client reads the answer class it expects. The JSON is the
protocol's, field for field.

Decoding is strict: a wrong type, an unknown op or a missing field raises
:class:`~elastrun.errors.ProtocolError`; nothing else escapes.
"""

from __future__ import annotations

import base64
import binascii
import json
import struct
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Literal, assert_never, cast

from elastrun.errors import ProtocolError
from elastrun.fields import Fields
from elastrun.frozen import frozen
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
    "Answer",
    "CompactAnswer",
    "CompactRequest",
    "DeleteAnswer",
    "DeleteRequest",
    "EmptyAnswer",
    "EngineRequest",
    "FrameDecoder",
    "GetAnswer",
    "GetRequest",
    "LeaseGrantAnswer",
    "LeaseGrantRequest",
    "LeaseKeepaliveAnswer",
    "LeaseKeepaliveRequest",
    "LeaseRevokeRequest",
    "PingRequest",
    "PutRequest",
    "RangeAnswer",
    "RangeNewestRequest",
    "RangePageRequest",
    "RangeRequest",
    "Request",
    "RevisionAnswer",
    "TxnRequest",
    "WatchCancelRequest",
    "WatchRequest",
    "b64",
    "decode_compare",
    "decode_event",
    "decode_kv",
    "decode_op",
    "decode_request",
    "decode_txn_result",
    "encode_answer",
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
    "hello",
]

PROTOCOL_VERSION = 1
_HEADER = struct.Struct(">I")
_MAX_INT = (1 << 63) - 1

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
        obj: Json = _DECODER.decode(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"frame is not UTF-8 JSON: {exc}") from None
    hint = "upgrade the older side"
    _Frame.versioned(
        obj, PROTOCOL_VERSION, "store frame", ProtocolError, what="protocol version", hint=hint
    )
    return obj


# -- field validation ---------------------------------------------------------
class _Frame(Fields):
    """A frame's fields (elastrun.fields), each problem a ProtocolError; its
    integers (revisions, leases, ids) up to 2**63 - 1."""

    __slots__ = ()
    INT_HIGH = _MAX_INT


def _read(obj: object, what: str = "store frame") -> _Frame:
    return _Frame(obj, what, ProtocolError)


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


def _unb64(f: _Frame, name: str) -> bytes:
    text = f.text(name)
    large = len(text) >= _REUSED
    if large:
        text_seen, data = _LastBase64.decoded
        if text == text_seen:
            return data
    try:
        data = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise f.bad(name, "not valid base64") from None
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
    f = _read(value, "key-value")
    return KeyValue(
        key=f.text("key"),
        value=_unb64(f, "value"),
        create_revision=f.integer("create"),
        mod_revision=f.integer("mod"),
        version=f.integer("version"),
        lease=f.integer("lease"),
    )


def encode_event(event: WatchEvent) -> Json:
    return {"type": event.type, "kv": encode_kv(event.kv)}


def decode_event(value: Any) -> WatchEvent:
    obj = _read(value, "watch event").raw
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
    obj = _read(value, "compare").raw
    target = obj.get("target")
    if target not in _TARGETS:
        raise ProtocolError(f"unknown compare target {target!r:.40}")
    op = obj.get("op")
    if op not in _CMP_OPS:
        raise ProtocolError(f"unknown compare operator {op!r:.40}")
    operand: int | bytes = (
        _unb64(_read(obj), "value") if target == "value" else _read(obj).integer("value")
    )
    return Compare(_read(obj).text("key"), target, op, operand)


def encode_op(op: Op) -> Json:
    match op:
        case Put():
            return {"op": "put", "key": op.key, "value": b64(op.value), "lease": op.lease}
        case Delete():
            return {"op": "delete", "key": op.key, "prefix": op.prefix}
        case Count():
            return {"op": "count", "key": op.prefix}
        case Get():
            return {"op": "get", "key": op.key, "prefix": op.prefix}
    assert_never(op)


def decode_op(value: Any) -> Op:
    obj = _read(value, "txn operation").raw
    match obj.get("op"):
        case "put":
            return Put(
                _read(obj).text("key"),
                _unb64(_read(obj), "value"),
                _read(obj).integer("lease"),
            )
        case "delete":
            return Delete(_read(obj).text("key"), _read(obj).flag("prefix"))
        case "get":
            return Get(_read(obj).text("key"), _read(obj).flag("prefix"))
        case "count":
            return Count(_read(obj).text("key"))
        case kind:
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
    obj = _read(value, "txn result").raw
    gets = []
    for kvs in _read(obj).items("gets"):
        if not isinstance(kvs, list):
            raise ProtocolError("txn result 'gets' must be a list of lists")
        gets.append([decode_kv(kv) for kv in kvs])
    counts = obj.get("counts", [])
    if not isinstance(counts, list) or not all(
        type(c) is int and 0 <= c <= _MAX_INT for c in counts
    ):
        raise ProtocolError("txn result 'counts' must be a list of counts")
    return TxnResult(
        _read(obj).flag("succeeded", None),
        _read(obj).integer("revision"),
        gets,
        counts,
    )


# -- messages -----------------------------------------------------------------
def hello(token: str | None) -> Json:
    return {"v": PROTOCOL_VERSION, "t": "hello", "token": token}


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


# -- requests -----------------------------------------------------------------
# One class per store operation: ``from_json`` validates the fields of a
# ``req`` frame (the server), ``to_json`` writes them (the client). ``OP`` is
# the wire name; ``RETRIED``: a request the client sends again on a new
# connection when the first one was lost (a read: no write applied twice).
@frozen(slots=True)
class GetRequest:
    """One key."""

    OP: ClassVar[str] = "get"
    RETRIED: ClassVar[bool] = True
    key: str

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> GetRequest:
        return cls(_read(obj).text("key"))

    def to_json(self) -> Json:
        return {"op": self.OP, "key": self.key}


@frozen(slots=True)
class RangeRequest:
    """Every key under ``key``, in one answer (an older client's read; an
    answer over the server's limit is refused)."""

    OP: ClassVar[str] = "range"
    RETRIED: ClassVar[bool] = True
    key: str

    def to_json(self) -> Json:
        return {"op": self.OP, "key": self.key}


@frozen(slots=True)
class RangePageRequest:
    """A page of the keys under ``key``: those after ``after`` (None: from
    the first), at most ``limit`` of them (0: any number), within the
    server's answer limit; the answer says whether there are ``more``."""

    OP: ClassVar[str] = "range"
    RETRIED: ClassVar[bool] = True
    key: str
    after: str | None = None
    limit: int = 0

    def to_json(self) -> Json:
        return {
            "op": self.OP,
            "key": self.key,
            "page": True,
            "after": self.after,
            "limit": self.limit,
        }


@frozen(slots=True)
class RangeNewestRequest:
    """Up to ``limit`` keys under ``key`` created at or before
    ``max_create``, newest first, and the ``count`` of all keys under it (a
    server that ignores the option answers every key)."""

    OP: ClassVar[str] = "range"
    RETRIED: ClassVar[bool] = True
    key: str
    max_create: int
    limit: int = 0

    def to_json(self) -> Json:
        return {
            "op": self.OP,
            "key": self.key,
            "max_create": self.max_create,
            "limit": self.limit,
        }


def _decode_range(obj: Mapping[str, Any]) -> RangeRequest | RangePageRequest | RangeNewestRequest:
    key = _read(obj).text("key")
    if "max_create" in obj:
        max_create = _read(obj).integer("max_create")
        return RangeNewestRequest(
            key, max_create, _read(obj).integer("limit") if "limit" in obj else 0
        )
    if obj.get("page") is True:
        after = _read(obj).text("after") if obj.get("after") is not None else None
        return RangePageRequest(key, after, _read(obj).integer("limit") if "limit" in obj else 0)
    return RangeRequest(key)


@frozen(slots=True)
class PutRequest:
    OP: ClassVar[str] = "put"
    RETRIED: ClassVar[bool] = False
    key: str
    value: bytes
    lease: int = NO_LEASE

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> PutRequest:
        key = _read(obj).text("key")
        value = _unb64(_read(obj), "value")
        return cls(key, value, _read(obj).integer("lease") if "lease" in obj else NO_LEASE)

    def to_json(self) -> Json:
        return {"op": self.OP, "key": self.key, "value": b64(self.value), "lease": self.lease}


@frozen(slots=True)
class DeleteRequest:
    OP: ClassVar[str] = "delete"
    RETRIED: ClassVar[bool] = False
    key: str
    prefix: bool = False

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> DeleteRequest:
        return cls(_read(obj).text("key"), _read(obj).flag("prefix"))

    def to_json(self) -> Json:
        return {"op": self.OP, "key": self.key, "prefix": self.prefix}


@frozen(slots=True)
class TxnRequest:
    OP: ClassVar[str] = "txn"
    RETRIED: ClassVar[bool] = False
    compares: list[Compare]
    success: list[Op]
    failure: list[Op]

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> TxnRequest:
        return cls(
            [decode_compare(c) for c in _read(obj).items("compares")],
            [decode_op(o) for o in _read(obj).items("success")],
            [decode_op(o) for o in _read(obj).items("failure")],
        )

    def to_json(self) -> Json:
        return {
            "op": self.OP,
            "compares": [encode_compare(c) for c in self.compares],
            "success": [encode_op(o) for o in self.success],
            "failure": [encode_op(o) for o in self.failure],
        }


@frozen(slots=True)
class LeaseGrantRequest:
    OP: ClassVar[str] = "lease_grant"
    RETRIED: ClassVar[bool] = False
    ttl: float

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> LeaseGrantRequest:
        return cls(_read(obj).number("ttl", low=None, high=None))

    def to_json(self) -> Json:
        return {"op": self.OP, "ttl": self.ttl}


@frozen(slots=True)
class LeaseKeepaliveRequest:
    OP: ClassVar[str] = "lease_keepalive"
    RETRIED: ClassVar[bool] = True
    lease: int

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> LeaseKeepaliveRequest:
        return cls(_read(obj).integer("lease", low=1))

    def to_json(self) -> Json:
        return {"op": self.OP, "lease": self.lease}


@frozen(slots=True)
class LeaseRevokeRequest:
    OP: ClassVar[str] = "lease_revoke"
    RETRIED: ClassVar[bool] = False
    lease: int

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> LeaseRevokeRequest:
        return cls(_read(obj).integer("lease", low=1))

    def to_json(self) -> Json:
        return {"op": self.OP, "lease": self.lease}


@frozen(slots=True)
class WatchRequest:
    """Stream the changes of ``key`` (or under it) from ``start_revision``
    (None: from now on), as ``events`` frames of watch id ``watch``."""

    OP: ClassVar[str] = "watch"
    RETRIED: ClassVar[bool] = False
    watch: int
    key: str
    prefix: bool = False
    start_revision: int | None = None

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> WatchRequest:
        watch = _read(obj).integer("watch", low=1)
        key = _read(obj).text("key")
        prefix = _read(obj).flag("prefix")
        start = None if obj.get("start_revision") is None else _read(obj).integer("start_revision")
        return cls(watch, key, prefix, start)

    def to_json(self) -> Json:
        return {
            "op": self.OP,
            "watch": self.watch,
            "key": self.key,
            "prefix": self.prefix,
            "start_revision": self.start_revision,
        }


@frozen(slots=True)
class WatchCancelRequest:
    OP: ClassVar[str] = "watch_cancel"
    RETRIED: ClassVar[bool] = True
    watch: int

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> WatchCancelRequest:
        return cls(_read(obj).integer("watch", low=1))

    def to_json(self) -> Json:
        return {"op": self.OP, "watch": self.watch}


@frozen(slots=True)
class CompactRequest:
    OP: ClassVar[str] = "compact"
    RETRIED: ClassVar[bool] = False
    revision: int

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> CompactRequest:
        return cls(_read(obj).integer("revision"))

    def to_json(self) -> Json:
        return {"op": self.OP, "revision": self.revision}


@frozen(slots=True)
class PingRequest:
    OP: ClassVar[str] = "ping"
    RETRIED: ClassVar[bool] = True

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> PingRequest:
        return cls()

    def to_json(self) -> Json:
        return {"op": self.OP}


#: What the engine answers (server_ops); watches are the connection's (server_watch).
EngineRequest = (
    GetRequest
    | RangeRequest
    | RangePageRequest
    | RangeNewestRequest
    | PutRequest
    | DeleteRequest
    | TxnRequest
    | LeaseGrantRequest
    | LeaseKeepaliveRequest
    | LeaseRevokeRequest
    | CompactRequest
    | PingRequest
)
Request = EngineRequest | WatchRequest | WatchCancelRequest

_DECODERS: Mapping[str, Callable[[Mapping[str, Any]], Request]] = {
    "get": GetRequest.from_json,
    "range": _decode_range,
    "put": PutRequest.from_json,
    "delete": DeleteRequest.from_json,
    "txn": TxnRequest.from_json,
    "lease_grant": LeaseGrantRequest.from_json,
    "lease_keepalive": LeaseKeepaliveRequest.from_json,
    "lease_revoke": LeaseRevokeRequest.from_json,
    "watch": WatchRequest.from_json,
    "watch_cancel": WatchCancelRequest.from_json,
    "compact": CompactRequest.from_json,
    "ping": PingRequest.from_json,
}
OPS = frozenset(_DECODERS)


def encode_request(request_id: int, request: Request) -> Json:
    return {"v": PROTOCOL_VERSION, "t": "req", "id": request_id, **request.to_json()}


def decode_request(obj: Mapping[str, Any]) -> tuple[int, Request]:
    """Validate a ``req`` frame: its id and its typed request (ProtocolError
    if malformed).

    When the frame's ``id`` is readable, the server answers a malformed request
    with an error response (and keeps the connection); otherwise it hangs up.
    """
    if obj.get("t") != "req":
        raise ProtocolError(f"expected a request frame, got type {obj.get('t')!r:.40}")
    request_id = _read(obj).integer("id")
    op = obj.get("op")
    decode = _DECODERS.get(op) if isinstance(op, str) else None
    if decode is None:
        raise ProtocolError(f"unknown store operation {op!r:.40}")
    return request_id, decode(obj)


# -- answers ------------------------------------------------------------------
# One class per kind of answer (a txn's is base.TxnResult): ``to_json`` writes
# a response's ``result`` (the server), ``from_json`` reads it (the client).
@frozen(slots=True)
class RevisionAnswer:
    """The store's revision after the request (put, ping, watch)."""

    revision: int

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> RevisionAnswer:
        return cls(_read(obj).integer("revision"))

    def to_json(self) -> Json:
        return {"revision": self.revision}


@frozen(slots=True)
class EmptyAnswer:
    """Done (lease_revoke, watch_cancel)."""

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> EmptyAnswer:
        return cls()

    def to_json(self) -> Json:
        return {}


@frozen(slots=True)
class GetAnswer:
    kv: KeyValue | None
    revision: int

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> GetAnswer:
        raw = obj.get("kv")
        return cls(None if raw is None else decode_kv(raw), _read(obj).integer("revision"))

    def to_json(self) -> Json:
        return {"kv": None if self.kv is None else encode_kv(self.kv), "revision": self.revision}


@frozen(slots=True)
class RangeAnswer:
    """Keys at ``revision``; ``more``: a page's answer (more keys follow);
    ``count``: a newest-first answer's count of every key under the prefix
    (None from a server that ignores the option)."""

    kvs: list[KeyValue]
    revision: int
    more: bool | None = None
    count: int | None = None

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> RangeAnswer:
        kvs = [decode_kv(kv) for kv in _read(obj).items("kvs", required=True)]
        count = _read(obj).integer("count") if "count" in obj else None
        more = obj.get("more")
        return cls(
            kvs,
            _read(obj).integer("revision"),
            more if isinstance(more, bool) else None,
            count,
        )

    def to_json(self) -> Json:
        out: Json = {"kvs": [encode_kv(kv) for kv in self.kvs]}
        if self.count is not None:
            out["count"] = self.count
        out["revision"] = self.revision
        if self.more is not None:
            out["more"] = self.more
        return out


@frozen(slots=True)
class DeleteAnswer:
    deleted: int
    revision: int

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> DeleteAnswer:
        return cls(
            _read(obj).integer("deleted"),
            _read(obj).integer("revision"),
        )

    def to_json(self) -> Json:
        return {"deleted": self.deleted, "revision": self.revision}


@frozen(slots=True)
class LeaseGrantAnswer:
    lease: int
    ttl: float

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> LeaseGrantAnswer:
        return cls(
            _read(obj).integer("lease", low=1),
            _read(obj).number("ttl", low=None, high=None),
        )

    def to_json(self) -> Json:
        return {"lease": self.lease, "ttl": self.ttl}


@frozen(slots=True)
class LeaseKeepaliveAnswer:
    ttl: float

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> LeaseKeepaliveAnswer:
        return cls(_read(obj).number("ttl", low=None, high=None))

    def to_json(self) -> Json:
        return {"ttl": self.ttl}


@frozen(slots=True)
class CompactAnswer:
    revision: int
    compact_revision: int

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> CompactAnswer:
        return cls(
            _read(obj).integer("revision"),
            _read(obj).integer("compact_revision"),
        )

    def to_json(self) -> Json:
        return {"revision": self.revision, "compact_revision": self.compact_revision}


Answer = (
    RevisionAnswer
    | EmptyAnswer
    | GetAnswer
    | RangeAnswer
    | DeleteAnswer
    | LeaseGrantAnswer
    | LeaseKeepaliveAnswer
    | CompactAnswer
    | TxnResult
)


def encode_answer(answer: Answer) -> Json:
    """A response's ``result``."""
    if isinstance(answer, TxnResult):
        return encode_txn_result(answer)
    return answer.to_json()


def encode_response(request_id: int, answer: Answer) -> Json:
    return {
        "v": PROTOCOL_VERSION,
        "t": "resp",
        "id": request_id,
        "ok": True,
        "result": encode_txn_result(answer) if isinstance(answer, TxnResult) else answer.to_json(),
    }
