"""The embedded store's requests, executed on the engine (no I/O here):
:func:`execute` turns one decoded request into its response frame (an
answer, or an error with its code), given what a request needs: the engine,
the owner of the leases it grants or keeps alive (the connection), the answer
limit, and whom to tell when a lease deadline may have moved (the server's
lease reaper). Watches, which stream, are the connection's own
(:mod:`elastrun.store.server_watch`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from elastrun.errors import (
    LeaseNotFound,
    LimitExceeded,
    ProtocolError,
    RevisionCompacted,
    StoreError,
)
from elastrun.store import codec
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
    request: codec.Request,
    *,
    owner: object,
    max_response: int,
    leases_moved: Callable[[], None],
) -> dict[str, Any]:
    """The response to ``request`` (not a watch): leases granted or kept alive
    are ``owner``'s; answers are at most ``max_response`` bytes;
    ``leases_moved`` is called after a lease was granted, kept alive or
    revoked."""
    try:
        result = _execute(engine, request, owner, max_response, leases_moved)
    except (StoreError, ValueError, TypeError) as exc:
        return failure_response(request.id, exc)
    return codec.encode_response(request.id, result)


def _execute(
    engine: Engine,
    request: codec.Request,
    owner: object,
    max_response: int,
    leases_moved: Callable[[], None],
) -> Any:
    args = request.args
    op = request.op
    if op == "get":
        kv = engine.get(args["key"])
        return {"kv": None if kv is None else codec.encode_kv(kv), "revision": engine.revision}
    if op == "range":
        return _range(engine, args, max_response)
    if op == "put":
        return {"revision": engine.put(args["key"], args["value"], args["lease"])}
    if op == "delete":
        deleted = engine.delete(args["key"], args["prefix"])
        return {"deleted": deleted, "revision": engine.revision}
    if op == "txn":
        result = engine.txn(
            args["compares"], args["success"], args["failure"], max_answer=max_response
        )
        return codec.encode_txn_result(result)
    if op == "lease_grant":
        lease = engine.lease_grant(args["ttl"], owner=owner)
        leases_moved()
        return {"lease": lease, "ttl": args["ttl"]}
    if op == "lease_keepalive":
        engine.expire_leases()  # an expired lease must not be revived
        ttl = engine.lease_keepalive(args["lease"], owner=owner)
        leases_moved()
        return {"ttl": ttl}
    if op == "lease_revoke":
        engine.lease_revoke(args["lease"])
        leases_moved()
        return {}
    if op == "compact":
        engine.compact(args["revision"])
        return {"revision": engine.revision, "compact_revision": engine.compact_revision}
    return {"revision": engine.revision}  # ping


def _range(engine: Engine, args: Mapping[str, Any], max_response: int) -> Any:
    if "max_create" in args:
        kvs, count = engine.range_newest(args["key"], args["max_create"], args["limit"])
        if sum(encoded_size(kv) for kv in kvs) > max_response:
            raise LimitExceeded(
                f"the answer ({len(kvs)} keys) exceeds {max_response} bytes (max_response); "
                "ask for fewer (limit)"
            )
        kvs_json = [codec.encode_kv(kv) for kv in kvs]
        return {"kvs": kvs_json, "count": count, "revision": engine.revision}
    paged = args.get("page", False)
    after = args.get("after") if paged else None
    limit = args.get("limit", 0) if paged else 0
    kvs, more = engine.range_page(args["key"], after, limit, max_response)
    if more and not paged:
        raise LimitExceeded(
            f"the keys under {args['key'][:200]!r} exceed {max_response} bytes "
            "(max_response) in one answer; read them in pages (a newer client does)"
        )
    result: dict[str, Any] = {"kvs": [codec.encode_kv(kv) for kv in kvs]}
    result["revision"] = engine.revision
    if paged:
        result["more"] = more
    return result
