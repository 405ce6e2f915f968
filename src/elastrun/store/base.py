"""The store interface: a tiny, etcd-shaped key-value store.

Everything elastrun coordinates (rendezvous, restart budget, job status) goes
through this interface, so one algorithm runs on every implementation: the
in-memory store, the embedded TCP store and etcd v3.

Model (the same as etcd v3's):

* The store has one global **revision** counter. Every write (put, delete,
  lease expiry deleting keys, a successful txn) increments it by one; a txn's
  writes share one revision.
* Each key holds ``bytes`` and carries ``create_revision``, ``mod_revision``,
  ``version`` (writes since creation) and an optional ``lease``.
  ``mod_revision == 0`` in a :class:`Compare` means "the key does not exist".
* A **lease** has a TTL. Keys put with a lease are deleted (with delete events)
  when it expires or is revoked. ``lease_keepalive`` resets its TTL.
* A **watch** delivers put/delete events for a key or prefix in revision order,
  starting at ``start_revision`` (history included, unless compacted) or, by
  default, with the next write. No polling anywhere.
* A **txn** compares keys atomically and then applies either the success or the
  failure operations: compare-and-set on revisions is a txn.
* The history of past revisions is bounded: **compaction** discards it before a
  revision (:meth:`Store.compact`, or the store itself when its history bound is
  reached). A watch that asks for compacted history, or falls that far behind,
  raises :class:`~elastrun.errors.RevisionCompacted` (with the oldest revision
  still kept): read the current state and watch again from after that read.

Values are opaque bytes; structured data on top is versioned JSON (never pickle).
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Sequence
from dataclasses import field
from typing import Literal

from elastrun.endpoint import Endpoint
from elastrun.fields import Fields, is_int
from elastrun.frozen import frozen

__all__ = [
    "NO_LEASE",
    "Compare",
    "Count",
    "Delete",
    "EmbeddedRevoke",
    "EtcdRevoke",
    "Get",
    "KeyValue",
    "Op",
    "Put",
    "RevokeSpec",
    "Store",
    "TxnResult",
    "Watch",
    "WatchEvent",
    "newest_created",
]

NO_LEASE = 0


@frozen(slots=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int = NO_LEASE


@frozen(slots=True)
class WatchEvent:
    """A change to one key. For ``delete``, ``kv.value`` is empty and
    ``kv.mod_revision`` is the revision of the deletion."""

    type: Literal["put", "delete"]
    kv: KeyValue


CompareTarget = Literal["mod", "create", "version", "value", "lease"]
CompareOp = Literal["==", "!=", "<", ">"]


@frozen(slots=True)
class Compare:
    """One condition of a txn, e.g. ``Compare("k", "mod", "==", 0)`` (k absent)."""

    key: str
    target: CompareTarget
    op: CompareOp
    value: int | bytes

    @staticmethod
    def absent(key: str) -> Compare:
        return Compare(key, "mod", "==", 0)

    @staticmethod
    def unchanged(key: str, mod_revision: int) -> Compare:
        return Compare(key, "mod", "==", mod_revision)

    def holds(self, kv: KeyValue | None) -> bool:
        """Evaluate against a key's current state (``None`` = absent)."""
        actual: int | bytes
        if self.target == "value":
            actual = kv.value if kv is not None else b""
            if kv is None:
                # etcd: a value comparison against a missing key is false.
                return False
        elif self.target == "mod":
            actual = kv.mod_revision if kv else 0
        elif self.target == "create":
            actual = kv.create_revision if kv else 0
        elif self.target == "version":
            actual = kv.version if kv else 0
        else:
            actual = kv.lease if kv else NO_LEASE
        expected = self.value
        if type(actual) is not type(expected):
            raise TypeError(f"compare {self.target} needs {type(actual).__name__}")
        if self.op == "==":
            return actual == expected
        if self.op == "!=":
            return actual != expected
        if self.op == "<":
            return actual < expected  # type: ignore[operator]
        return actual > expected  # type: ignore[operator]


@frozen(slots=True)
class Put:
    key: str
    value: bytes
    lease: int = NO_LEASE


@frozen(slots=True)
class Delete:
    key: str
    prefix: bool = False


@frozen(slots=True)
class Get:
    key: str
    prefix: bool = False


@frozen(slots=True)
class Count:
    """A txn read of how many keys are under ``prefix`` (etcd's range with
    ``count_only``): one number, a few bytes whatever the count. It sees the
    writes of the ops before it in its txn."""

    prefix: str


Op = Put | Delete | Get | Count


@frozen(slots=True)
class TxnResult:
    succeeded: bool
    revision: int
    # One entry per Get op of the branch taken (in order): the matching keys.
    gets: list[list[KeyValue]] = field(default_factory=list)
    # One entry per Count op of the branch taken (in order): how many keys.
    counts: list[int] = field(default_factory=list)


def newest_created(kvs: Sequence[KeyValue], max_create_revision: int, limit: int) -> list[KeyValue]:
    """The keys of ``kvs`` created at or before ``max_create_revision``, the
    most recently created first (keys created by one txn, which share a create
    revision, in key order), at most ``limit`` of them (``limit <= 0``: all,
    as in etcd). What :meth:`Store.get_prefix_newest` selects; on etcd, which
    keys of one create revision a limit cuts off is unspecified."""
    older = [kv for kv in kvs if kv.create_revision <= max_create_revision]
    if limit == 1:  # the common case; max() keeps the first of equals
        return [max(older, key=_created)] if older else []
    older.sort(key=_created, reverse=True)  # stable: ties stay in key order
    return older[:limit] if limit > 0 else older


def _created(kv: KeyValue) -> int:
    return kv.create_revision


class Watch(abc.ABC):
    """An open watch: iterate it for events; close it when done.

    Iteration ends (``StopAsyncIteration``) after :meth:`close`. If the store
    becomes unreachable for longer than the implementation can hide by
    reconnecting, iteration raises :class:`~elastrun.errors.StoreUnavailable`.
    """

    def __aiter__(self) -> AsyncIterator[WatchEvent]:
        return self

    @abc.abstractmethod
    async def __anext__(self) -> WatchEvent: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    async def __aenter__(self) -> Watch:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


@frozen(slots=True)
class RevokeSpec:
    """How another process could revoke lease ``lease`` once its holder is
    gone (the agent's orphan guard does, when the agent is killed): the
    store's address and credentials (:meth:`Store.revoke_spec`).

    Its JSON (:meth:`to_json`, one line on the guard's pipe; read by
    ``agent/_guard_main.py``, standard library only, with the same field
    reader, ``elastrun/fields.py``, loaded by its path) is an object with
    ``kind`` (``"elastrun"``: :class:`EmbeddedRevoke`, ``"etcd"``:
    :class:`EtcdRevoke`), ``lease`` and the kind's fields."""

    lease: int

    def to_json(self) -> dict[str, object]:
        raise NotImplementedError

    @staticmethod
    def from_json(raw: object) -> RevokeSpec:
        """The spec in ``raw`` (as :meth:`to_json` writes it); ValueError
        naming the problem when it is not one."""
        f = Fields(raw, "a revoke spec")
        lease = f.integer("lease", low=1, high=2**63 - 1)  # etcd: any int64
        kind = f.raw.get("kind")
        if kind == "elastrun":
            return EmbeddedRevoke(
                lease,
                host=f.text("host"),
                port=f.integer("port", low=1, high=65535),
                token=f.optional_text("token"),
            )
        if kind == "etcd":
            return EtcdRevoke(
                lease,
                endpoints=tuple(_endpoint(e) for e in f.items("endpoints", required=True)),
                https=f.raw.get("https") is True,
                cacert=f.optional_text("cacert"),
                cert=f.optional_text("cert"),
                key=f.optional_text("key"),
                user=f.optional_text("user"),
                password=f.optional_text("password"),
            )
        raise ValueError(f"a revoke spec's kind is 'elastrun' or 'etcd', not {kind!r}")


@frozen(slots=True)
class EmbeddedRevoke(RevokeSpec):
    """The embedded store's address and token: a ``lease_revoke`` request."""

    host: str
    port: int
    token: str | None = field(default=None, repr=False)

    def to_json(self) -> dict[str, object]:
        return {
            "kind": "elastrun",
            "lease": self.lease,
            "host": self.host,
            "port": self.port,
            "token": self.token,
        }


@frozen(slots=True)
class EtcdRevoke(RevokeSpec):
    """etcd's endpoints, TLS files and user: ``POST /v3/lease/revoke`` on its
    JSON gateway."""

    endpoints: tuple[Endpoint, ...]
    https: bool = False
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    def to_json(self) -> dict[str, object]:
        return {
            "kind": "etcd",
            "lease": self.lease,
            "endpoints": [[e.host, e.port] for e in self.endpoints],
            "https": self.https,
            "cacert": self.cacert,
            "cert": self.cert,
            "key": self.key,
            "user": self.user,
            "password": self.password,
        }


def _endpoint(value: object) -> Endpoint:
    if (
        not isinstance(value, list)
        or len(value) != 2
        or not isinstance(value[0], str)
        or not is_int(value[1])
        or not 0 < value[1] < 65536
    ):
        raise ValueError("an etcd revoke spec's endpoint is [host, port from 1 to 65535]")
    return Endpoint(value[0], value[1])


class Store(abc.ABC):
    """The interface every store implements. All methods may raise
    :class:`~elastrun.errors.StoreError` subclasses (and nothing else)."""

    # -- reads ---------------------------------------------------------------
    @abc.abstractmethod
    async def get(self, key: str) -> KeyValue | None: ...

    @abc.abstractmethod
    async def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """All keys starting with ``prefix`` (sorted by key), and the store's
        revision at the time of the read (watch from ``revision + 1`` to see
        every later change)."""

    async def get_prefix_newest(
        self, prefix: str, max_create_revision: int, limit: int = 1
    ) -> tuple[list[KeyValue], int, int]:
        """Up to ``limit`` keys under ``prefix`` created at or before
        ``max_create_revision``, the most recently created first (see
        :func:`newest_created`; ``limit <= 0``: no limit); how many keys are
        under ``prefix`` in all; and the store's revision of the read.

        This default reads the whole prefix; the embedded store's client and
        etcd override it with one request that carries only the selected keys
        (O(limit) bytes: a rendezvous joiner reads its predecessor with it)."""
        kvs, revision = await self.get_prefix(prefix)
        return newest_created(kvs, max_create_revision, limit), len(kvs), revision

    # -- writes --------------------------------------------------------------
    @abc.abstractmethod
    async def put(self, key: str, value: bytes, lease: int = NO_LEASE) -> int:
        """Write ``key``; returns the new revision."""

    @abc.abstractmethod
    async def delete(self, key: str, prefix: bool = False) -> int:
        """Delete ``key`` (or every key under the prefix); returns how many."""

    @abc.abstractmethod
    async def txn(
        self,
        compares: Sequence[Compare],
        success: Sequence[Op],
        failure: Sequence[Op] = (),
    ) -> TxnResult: ...

    # -- leases --------------------------------------------------------------
    @abc.abstractmethod
    async def lease_grant(self, ttl: float) -> int:
        """Grant a lease of ``ttl`` seconds; returns its id (never 0).
        Implementations may round ``ttl`` up (etcd: whole seconds)."""

    @abc.abstractmethod
    async def lease_keepalive(self, lease: int) -> float:
        """Reset the lease's TTL; returns the TTL. Raises LeaseNotFound."""

    @abc.abstractmethod
    async def lease_revoke(self, lease: int) -> None:
        """Revoke the lease, deleting its keys. Revoking a missing lease is a no-op."""

    # -- watches -------------------------------------------------------------
    @abc.abstractmethod
    async def watch(
        self, key: str, *, prefix: bool = False, start_revision: int | None = None
    ) -> Watch:
        """Watch ``key`` (or keys under it, with ``prefix``). Returns once the
        watch is established: every write after this call returns is seen."""

    @abc.abstractmethod
    async def compact(self, revision: int) -> None:
        """Discard the watch history before ``revision``: watches may start at
        ``revision`` or later. Raises RevisionCompacted if the store is
        already compacted that far, StoreError for a future revision. Keys'
        current values are never affected."""

    # -- lifecycle -----------------------------------------------------------
    @abc.abstractmethod
    async def close(self) -> None: ...

    def revoke_spec(self, lease: int) -> RevokeSpec | None:
        """How another process could revoke ``lease`` once this one is gone
        (the agent's orphan guard does, when the agent is killed): the
        store's address and credentials and the lease (:class:`RevokeSpec`),
        or None where that is not possible (the in-memory store)."""
        return None

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- conveniences built on the primitives --------------------------------
    async def create(self, key: str, value: bytes, lease: int = NO_LEASE) -> bool:
        """Create ``key`` only if absent; True if this call created it."""
        result = await self.txn([Compare.absent(key)], [Put(key, value, lease)])
        return result.succeeded

    async def compare_and_set(
        self, key: str, mod_revision: int, value: bytes, lease: int = NO_LEASE
    ) -> bool:
        """Write ``key`` only if its mod revision is still ``mod_revision``
        (0: only if absent); True if this call wrote it."""
        result = await self.txn([Compare.unchanged(key, mod_revision)], [Put(key, value, lease)])
        return result.succeeded
