"""The etcd v3 store (``--rdzv-backend=etcd``), over etcd's gRPC-JSON gateway.

``open_etcd_store("host1:2379,host2:2379", options=EtcdOptions(...))`` returns a
:class:`~elastrun.store.base.Store` whose keys all live under ``key_prefix``
(so several jobs share one etcd cleanly), whose leases are etcd leases and
whose watches are real etcd watches that survive the loss of the member they
were connected to. Wire details, failover and error translation live in
:mod:`elastrun.store.etcd_conn`; see docs/etcd.md.

``conf`` keys (from ``--rdzv-conf``): ``cacert``, ``cert``, ``key`` (TLS),
``user``, ``password``, ``key_prefix``. Other keys are ignored here.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

from elastrun.errors import (
    ConfigError,
    LeaseNotFound,
    RevisionCompacted,
    StoreError,
    StoreUnavailable,
)
from elastrun.store.base import (
    NO_LEASE,
    Compare,
    Count,
    Delete,
    EtcdRevoke,
    Get,
    KeyValue,
    Op,
    Put,
    RevokeSpec,
    Store,
    TxnResult,
    Watch,
)
from elastrun.store.etcd_conn import (
    Endpoint,
    EtcdConnection,
    EtcdSettings,
    Json,
    int_field,
    settings_from_options,
)
from elastrun.store.etcd_options import EtcdOptions
from elastrun.store.etcd_watch import EtcdWatch

__all__ = ["EtcdStore", "EtcdWatch", "open_etcd_store"]

MAX_TTL = 9_000_000_000  # etcd's own limit is about 9e9 s (math.MaxInt64 / 1e9)

_TARGETS = {
    "mod": "MOD",
    "create": "CREATE",
    "version": "VERSION",
    "value": "VALUE",
    "lease": "LEASE",
}
_FIELDS = {
    "mod": "mod_revision",
    "create": "create_revision",
    "version": "version",
    "value": "value",
    "lease": "lease",
}
_RESULTS = {"==": "EQUAL", "!=": "NOT_EQUAL", "<": "LESS", ">": "GREATER"}


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_end(prefix: bytes) -> bytes:
    """The etcd ``range_end`` that selects every key starting with ``prefix``."""
    data = bytearray(prefix)
    while data and data[-1] == 0xFF:
        data.pop()
    if not data:
        return b"\0"  # every key
    data[-1] += 1
    return bytes(data)


async def open_etcd_store(
    endpoints: str | Sequence[Endpoint],
    *,
    options: EtcdOptions | None = None,
    timeout: float = 30.0,
    request_timeout: float | None = None,
) -> Store:
    """Connect (authenticating if ``user`` is set) and check that etcd answers.

    ``endpoints``: the members, typed, or as ``host:port[,host:port...]``
    (``http://`` / ``https://`` prefixes allowed).

    ``timeout`` bounds this call, and every later operation unless
    ``request_timeout`` is given (each gets its own deadline, spent failing
    over between endpoints). Raises ConfigError, AuthenticationError or
    StoreUnavailable (naming the endpoints).
    """
    for name, value in (("timeout", timeout), ("request timeout", request_timeout)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ConfigError(f"etcd {name} must be a positive number of seconds, got {value}")
    settings = settings_from_options(endpoints, options or EtcdOptions())
    store = EtcdStore(settings, timeout=timeout)
    try:
        await store.connect()
    except BaseException:
        await store.close()
        raise
    if request_timeout is not None:
        store.conn.set_timeout(request_timeout)
    return store


class EtcdStore(Store):
    """A :class:`Store` on etcd v3. Build it with :func:`open_etcd_store`."""

    def __init__(self, settings: EtcdSettings, *, timeout: float = 30.0) -> None:
        self.conn = EtcdConnection(settings, timeout=timeout)
        self._prefix = settings.key_prefix.encode()
        self._watches: set[EtcdWatch] = set()
        self._closed = False

    @property
    def endpoint(self) -> Endpoint:
        """The member currently in use."""
        return self.conn.endpoint

    def describe(self) -> str:
        """``etcd at host:port, ...`` (for messages)."""
        return f"etcd at {self.conn.describe()}"

    async def connect(self) -> None:
        await self.conn.authenticate()
        await self._call("kv/range", {"key": _b64(self._prefix or b"\0"), "count_only": True})

    # -- encoding ------------------------------------------------------------
    def _key(self, key: str) -> bytes:
        return self._prefix + key.encode()

    def _range(self, key: str, prefix: bool) -> Json:
        raw = self._key(key)
        body: Json = {"key": _b64(raw)}
        if prefix:
            body["range_end"] = _b64(prefix_end(raw))
        return body

    def _kv(self, data: Mapping[str, Any]) -> KeyValue:
        raw = _unb64(data.get("key", ""))
        return KeyValue(
            key=raw[len(self._prefix) :].decode(errors="replace"),
            value=_unb64(data.get("value", "")),
            create_revision=int_field(data, "create_revision"),
            mod_revision=int_field(data, "mod_revision"),
            version=int_field(data, "version"),
            lease=int_field(data, "lease"),
        )

    def _kvs(self, data: Mapping[str, Any]) -> list[KeyValue]:
        return [self._kv(kv) for kv in data.get("kvs", [])]

    def _compare(self, c: Compare) -> Json:
        if c.target == "value":
            if not isinstance(c.value, bytes):
                raise StoreError(f"compare value of {c.key!r} needs bytes, got {c.value!r}")
            value: str = _b64(c.value)
        else:
            if not isinstance(c.value, int) or isinstance(c.value, bool):
                raise StoreError(f"compare {c.target} of {c.key!r} needs an int, got {c.value!r}")
            value = str(c.value)
        return {
            "key": _b64(self._key(c.key)),
            "target": _TARGETS[c.target],
            "result": _RESULTS[c.op],
            _FIELDS[c.target]: value,
        }

    def _op(self, op: Op) -> Json:
        if isinstance(op, Put):
            put: Json = {"key": _b64(self._key(op.key)), "value": _b64(op.value)}
            if op.lease != NO_LEASE:
                put["lease"] = str(op.lease)
            return {"request_put": put}
        if isinstance(op, Delete):
            return {"request_delete_range": self._range(op.key, op.prefix)}
        if isinstance(op, Count):
            return {"request_range": {**self._range(op.prefix, True), "count_only": True}}
        return {"request_range": self._range(op.key, op.prefix)}

    async def _call(self, path: str, body: Json, *, idempotent: bool = True) -> Json:
        if self._closed:
            raise StoreUnavailable(f"the etcd store ({self.conn.describe()}) is closed")
        return await self.conn.call(path, body, idempotent=idempotent)

    # -- reads ---------------------------------------------------------------
    async def get(self, key: str) -> KeyValue | None:
        kvs = self._kvs(await self._call("kv/range", self._range(key, False)))
        return kvs[0] if kvs else None

    async def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        data = await self._call("kv/range", self._range(prefix, True))
        return self._kvs(data), int_field(data.get("header", {}), "revision")

    async def get_prefix_newest(
        self, prefix: str, max_create_revision: int, limit: int = 1
    ) -> tuple[list[KeyValue], int, int]:
        """One range request that etcd answers with only the selected keys:
        sorted by create revision, newest first, filtered by
        ``max_create_revision`` and cut to ``limit``; its ``count`` is every
        key under the prefix (etcd counts before it filters)."""
        body = self._range(prefix, True)
        if max_create_revision <= 0:
            # etcd reads max_create_revision 0 as "no bound"; none is that old.
            data = await self._call("kv/range", {**body, "count_only": True})
            return [], int_field(data, "count"), int_field(data.get("header", {}), "revision")
        body |= {
            "sort_target": "CREATE",
            "sort_order": "DESCEND",
            "max_create_revision": str(max_create_revision),
        }
        if limit > 0:
            body["limit"] = str(limit)
        data = await self._call("kv/range", body)
        # etcd's sort is not stable: keys created by one txn (one create
        # revision) come back in key order, as from the other stores.
        kvs = sorted(self._kvs(data), key=lambda kv: (-kv.create_revision, kv.key))
        return kvs, int_field(data, "count"), int_field(data.get("header", {}), "revision")

    # -- writes --------------------------------------------------------------
    async def put(self, key: str, value: bytes, lease: int = NO_LEASE) -> int:
        body: Json = {"key": _b64(self._key(key)), "value": _b64(value)}
        if lease != NO_LEASE:
            body["lease"] = str(lease)
        data = await self._call("kv/put", body)
        return int_field(data.get("header", {}), "revision")

    async def delete(self, key: str, prefix: bool = False) -> int:
        data = await self._call("kv/deleterange", self._range(key, prefix))
        return int_field(data, "deleted")

    async def txn(
        self, compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> TxnResult:
        body: Json = {
            "compare": [self._compare(c) for c in compares],
            "success": [self._op(op) for op in success],
            "failure": [self._op(op) for op in failure],
        }
        read_only = all(isinstance(op, Get | Count) for op in (*success, *failure))
        data = await self._call("kv/txn", body, idempotent=read_only)
        succeeded = bool(data.get("succeeded", False))
        ops = success if succeeded else failure
        responses = data.get("responses", [])
        if len(responses) == len(ops):  # one answer per op, in order
            pairs = [
                (op, r.get("response_range", {})) for op, r in zip(ops, responses, strict=True)
            ]
            gets = [self._kvs(r) for op, r in pairs if isinstance(op, Get)]
            counts = [int_field(r, "count") for op, r in pairs if isinstance(op, Count)]
        elif any(isinstance(op, Count) for op in ops):
            raise StoreError(
                f"etcd at {self.conn.describe()} answered a txn of {len(ops)} operations "
                f"with {len(responses)} answers"
            )
        else:
            gets = [self._kvs(r["response_range"]) for r in responses if "response_range" in r]
            # An empty range answer may come back as {"response_range": {...}} or,
            # in old gateways, be dropped; pad so there is one entry per Get op.
            wanted = sum(isinstance(op, Get) for op in ops)
            gets += [[] for _ in range(wanted - len(gets))]
            counts = []
        return TxnResult(succeeded, int_field(data.get("header", {}), "revision"), gets, counts)

    # -- leases --------------------------------------------------------------
    async def lease_grant(self, ttl: float) -> int:
        if not (math.isfinite(ttl) and 0 < ttl <= MAX_TTL):
            raise StoreError(f"lease TTL must be a positive number of seconds, got {ttl}")
        # etcd TTLs are whole seconds: round up, at least 1.
        data = await self._call("lease/grant", {"TTL": str(max(1, math.ceil(ttl)))})
        lease = int_field(data, "ID")
        if lease == NO_LEASE:
            raise StoreError(f"etcd at {self.conn.describe()} granted no lease: {data}")
        return lease

    async def lease_keepalive(self, lease: int) -> float:
        data = await self._call("lease/keepalive", {"ID": str(lease)})
        ttl = int_field(data.get("result", data), "TTL")
        if ttl <= 0:
            raise LeaseNotFound(f"lease {lease:x} not found in etcd (expired or revoked)")
        return float(ttl)

    async def lease_revoke(self, lease: int) -> None:
        with contextlib.suppress(LeaseNotFound):
            await self._call("lease/revoke", {"ID": str(lease)})

    def revoke_spec(self, lease: int) -> RevokeSpec | None:
        """etcd's address, TLS files and user for a plain HTTP(S) revoke of
        ``lease`` through the JSON gateway (see :meth:`Store.revoke_spec`)."""
        s = self.conn.settings
        return EtcdRevoke(
            lease,
            endpoints=s.endpoints,
            https=s.https,
            cacert=s.cacert,
            cert=s.cert,
            key=s.key,
            user=s.user,
            password=s.password,
        )

    # -- compaction ------------------------------------------------------------
    async def compact(self, revision: int) -> None:
        # Not retried blindly: a compaction applied before a lost answer would
        # come back as "already compacted".
        await self._call("kv/compaction", {"revision": str(revision)}, idempotent=False)

    # -- watches -------------------------------------------------------------
    async def watch(
        self, key: str, *, prefix: bool = False, start_revision: int | None = None
    ) -> Watch:
        body = self._range(key, prefix)
        if start_revision is not None and start_revision > 0:
            # Fail at once (not on the first event) if that history is gone.
            probe = {**body, "revision": str(start_revision), "count_only": True}
            try:
                await self._call("kv/range", probe)
            except RevisionCompacted as exc:
                raise await self._compacted(body, start_revision, exc) from None
            except StoreError as exc:
                if "future revision" not in str(exc):
                    raise  # unreachable, not allowed

        if self._closed:
            raise StoreUnavailable(f"the etcd store ({self.conn.describe()}) is closed")
        watch = EtcdWatch(self, body, start_revision)
        await watch.start()
        self._watches.add(watch)
        return watch

    def _forget(self, watch: EtcdWatch) -> None:
        self._watches.discard(watch)

    async def _compacted(
        self, body: Json, start_revision: int, error: RevisionCompacted
    ) -> RevisionCompacted:
        """``error`` with the compact revision, which only a watch reports:
        open one from ``start_revision`` and read its cancellation."""
        watch = EtcdWatch(self, body, start_revision)
        try:
            await watch.start()
            await asyncio.wait_for(watch.__anext__(), 5.0)
        except RevisionCompacted as exc:
            return exc
        except (StoreError, TimeoutError):
            pass
        finally:
            await watch.close()
        return error

    # -- lifecycle -----------------------------------------------------------
    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for watch in list(self._watches):
            await watch.close()
        await self.conn.aclose()
