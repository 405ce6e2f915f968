"""The embedded store's requests, executed on the engine (no I/O here):
:func:`execute` turns one decoded request into its response frame (an
answer, or an error with its code), given what a request needs: the engine,
the owner of the leases it grants or keeps alive (the connection), the answer
limit, and whom to tell when a lease deadline may have moved (the server's
lease reaper). Watches, which stream, are the connection's own
(:mod:`elastrun.store.server_watch`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, assert_never

from elastrun.errors import (
    LeaseNotFound,
    LimitExceeded,
    ProtocolError,
    RevisionCompacted,
    StoreError,
)
from elastrun.store import codec
from elastrun.store.codec import (
    CompactAnswer,
    CompactRequest,
    DeleteAnswer,
    DeleteRequest,
    EmptyAnswer,
    GetAnswer,
    GetRequest,
    LeaseGrantAnswer,
    LeaseGrantRequest,
    LeaseKeepaliveAnswer,
    LeaseKeepaliveRequest,
    LeaseRevokeRequest,
    PingRequest,
    PutRequest,
    RangeAnswer,
    RangeNewestRequest,
    RangePageRequest,
    RangeRequest,
    RevisionAnswer,
    TxnRequest,
)
from elastrun.store.engine import Engine
from elastrun.store.limits import encoded_size

__all__ = ["execute", "failure_response"]

_ERROR_CODES: Mapping[type[Exception], str] = {
    LeaseNotFound: "lease_not_found",
    RevisionCompacted: "compacted",
    LimitExceeded: "limit",
    ProtocolError: "protocol",
    ValueError: "invalid",
    TypeError: "invalid",
}


def failure_response(request_id: int, exc: Exception) -> dict[str, Any]:
    code = next((c for t, c in _ERROR_CODES.items() if isinstance(exc, t)), "error")
    extra: dict[str, Any] = {}
    if isinstance(exc, RevisionCompacted):
        extra["compact_revision"] = exc.compact_revision
    return codec.error_response(request_id, code, str(exc), **extra)


def execute(
    engine: Engine,
    request_id: int,
    request: codec.EngineRequest,
    *,
    owner: object,
    max_response: int,
    leases_moved: Callable[[], None],
) -> dict[str, Any]:
    """The response frame to ``request`` (not a watch): leases granted or
    kept alive are ``owner``'s; answers are at most ``max_response`` bytes;
    ``leases_moved`` is called after a lease was granted, kept alive or
    revoked."""
    try:
        answer = _execute(engine, request, owner, max_response, leases_moved)
    except (StoreError, ValueError, TypeError) as exc:
        return failure_response(request_id, exc)
    return codec.encode_response(request_id, answer)


def _execute(
    engine: Engine,
    request: codec.EngineRequest,
    owner: object,
    max_response: int,
    leases_moved: Callable[[], None],
) -> codec.Answer:
    match request:
        # The most frequent first (each case is one isinstance check).
        case GetRequest(key=key):
            return GetAnswer(engine.get(key), engine.revision)
        case TxnRequest(compares=compares, success=success, failure=failure):
            return engine.txn(compares, success, failure, max_answer=max_response)
        case RangePageRequest(key=key, after=after, limit=limit):
            kvs, more = engine.range_page(key, after, limit, max_response)
            return RangeAnswer(kvs, engine.revision, more=more)
        case PutRequest(key=key, value=value, lease=lease):
            return RevisionAnswer(engine.put(key, value, lease))
        case LeaseKeepaliveRequest(lease=lease):
            engine.expire_leases()  # an expired lease must not be revived
            kept = engine.lease_keepalive(lease, owner=owner)
            leases_moved()
            return LeaseKeepaliveAnswer(kept)
        case RangeNewestRequest(key=key, max_create=max_create, limit=limit):
            kvs, count = engine.range_newest(key, max_create, limit)
            if sum(encoded_size(kv) for kv in kvs) > max_response:
                raise LimitExceeded(
                    f"the answer ({len(kvs)} keys) exceeds {max_response} bytes "
                    "(max_response); ask for fewer (limit)"
                )
            return RangeAnswer(kvs, engine.revision, count=count)
        case DeleteRequest(key=key, prefix=prefix):
            deleted = engine.delete(key, prefix)
            return DeleteAnswer(deleted, engine.revision)
        case LeaseGrantRequest(ttl=ttl):
            lease = engine.lease_grant(ttl, owner=owner)
            leases_moved()
            return LeaseGrantAnswer(lease, ttl)
        case LeaseRevokeRequest(lease=lease):
            engine.lease_revoke(lease)
            leases_moved()
            return EmptyAnswer()
        case PingRequest():
            return RevisionAnswer(engine.revision)
        case CompactRequest(revision=revision):
            engine.compact(revision)
            return CompactAnswer(engine.revision, engine.compact_revision)
        case RangeRequest(key=key):
            kvs, more = engine.range_page(key, None, 0, max_response)
            if more:
                raise LimitExceeded(
                    f"the keys under {key[:200]!r} exceed {max_response} bytes "
                    "(max_response) in one answer; read them in pages (a newer client does)"
                )
            return RangeAnswer(kvs, engine.revision)
    assert_never(request)
