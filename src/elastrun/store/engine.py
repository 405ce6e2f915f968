"""The key-value engine behind the in-memory and embedded TCP stores.

Synchronous and free of I/O: a dict of keys, a revision counter, leases with
absolute monotonic deadlines (from an injected clock), a bounded history of
events for watches that start in the past, and watcher callbacks. Async
front-ends (:mod:`elastrun.store.memory`, :mod:`elastrun.store.server`) own the
event loop, call :meth:`Engine.expire_leases` at :meth:`Engine.next_deadline`,
and turn callbacks into queues or frames.

History and data are bounded in bytes (:class:`~elastrun.store.limits.StoreLimits`):
the oldest revisions are compacted when the history holds more than
``history_bytes`` (or ``history_revisions``), as etcd compacts; a watch that
asks for a compacted revision gets :class:`~elastrun.errors.RevisionCompacted`
carrying the oldest revision still kept. Writes beyond ``max_value``,
``max_key`` or ``max_data_bytes`` fail with
:class:`~elastrun.errors.LimitExceeded`, unapplied.

A watcher is *synced* (it gets each write's events as they happen) or
*catching up* (it reads history from the first revision it has not had, at
the front-end's pace: :meth:`Engine.catch_up`). A watcher that starts in the
past catches up; a synced watcher whose callback refuses events (returns
False: its consumer is too far behind) falls back to catching up from the
refused revision, so a slow consumer holds at most what its front-end queues
plus the bounded history. If compaction passes a watcher that is catching up,
:meth:`Engine.catch_up` raises RevisionCompacted and drops it.

A lease may have an *owner* (any hashable token; the TCP server uses the
connection that granted it or last kept it alive). When the owner goes away,
:meth:`Engine.lease_owner_gone` shortens its leases' deadlines to a short
grace; the front-end must then re-arm its timer (the deadline moved earlier).
"""

from __future__ import annotations

import bisect
import itertools
import math
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from elastrun.clock import SYSTEM_CLOCK, Clock
from elastrun.errors import LeaseNotFound, RevisionCompacted
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
    newest_created,
)
from elastrun.store.history import History
from elastrun.store.lease_table import LeaseTable
from elastrun.store.limits import (
    DEFAULT_LIMITS,
    KEY_OVERHEAD,
    StoreLimits,
    check_answer,
    check_puts,
    encoded_size,
)

__all__ = ["Engine", "WatchCallback"]

# Called with the events of one revision for the watcher; returns False when
# it cannot take them now (the watcher then catches up later), else True/None.
WatchCallback = Callable[[list[WatchEvent]], bool | None]

MIN_TTL = 0.05
MAX_TTL = 3600.0


@dataclass
class _Watcher:
    key: str
    prefix: bool
    callback: WatchCallback
    next_rev: int  # the first revision not delivered yet
    synced: bool  # False: catching up from history (see catch_up)

    def matches(self, key: str) -> bool:
        return key.startswith(self.key) if self.prefix else key == self.key


class Engine:
    def __init__(
        self,
        clock: Clock = SYSTEM_CLOCK,
        history: int | None = None,
        *,
        limits: StoreLimits = DEFAULT_LIMITS,
    ) -> None:
        self.clock = clock
        self.limits = limits
        # Identifies this engine's history: a client that reconnects to a store
        # whose ``uid`` changed knows its watches cannot resume.
        self.uid = secrets.token_hex(8)
        self.revision = 0
        self._kv: dict[str, KeyValue] = {}
        self._sorted_keys: list[str] = []
        # The live keys by their folder (the key up to its last ``/``), each
        # folder's (create revision, key) in order: the newest keys created
        # under a folder without a scan (see range_newest).
        self._folders: dict[str, list[tuple[int, str]]] = {}
        self._data_bytes = 0
        self._leases = LeaseTable()
        self.history = History(
            limits.history_bytes, limits.history_revisions if history is None else history
        )
        self._watchers: dict[int, _Watcher] = {}
        # The same watchers indexed for publishing: by exact key, and by prefix
        # (few distinct prefixes), so a write visits only the watchers it matches.
        self._by_key: dict[str, dict[int, _Watcher]] = {}
        self._by_prefix: dict[str, dict[int, _Watcher]] = {}
        self._watch_ids = itertools.count(1)

    @property
    def data_bytes(self) -> int:
        """What the live keys are counted as against ``max_data_bytes``."""
        return self._data_bytes

    @property
    def compact_revision(self) -> int:
        """The oldest revision a watch may start from (0: none compacted yet)."""
        return self.history.compact_revision

    # -- reads ---------------------------------------------------------------
    def get(self, key: str) -> KeyValue | None:
        return self._kv.get(key)

    def range(self, key: str, prefix: bool = False) -> list[KeyValue]:
        if not prefix:
            kv = self._kv.get(key)
            return [kv] if kv is not None else []
        start = bisect.bisect_left(self._sorted_keys, key)
        out: list[KeyValue] = []
        for k in itertools.islice(self._sorted_keys, start, None):
            if not k.startswith(key):
                break
            out.append(self._kv[k])
        return out

    def range_newest(
        self, prefix: str, max_create_revision: int, limit: int
    ) -> tuple[list[KeyValue], int]:
        """Up to ``limit`` keys under ``prefix`` created at or before
        ``max_create_revision``, the most recently created first; and how
        many keys are under ``prefix`` in all (etcd's range with sort by
        create revision, ``max_create_revision`` and ``limit``; ``limit <= 0``:
        no limit)."""
        count = self._count(prefix)
        entries = self._folders.get(prefix) if prefix.endswith("/") else None
        if entries is None or len(entries) != count:
            # Keys in folders below the prefix, or a prefix that is no folder: scan.
            kvs = self.range(prefix, prefix=True)
            return newest_created(kvs, max_create_revision, limit), len(kvs)
        # Every key under the prefix is in its folder: O(log n + limit).
        picked: list[tuple[int, str]] = []
        end = bisect.bisect_right(entries, max_create_revision, key=_created)
        while end > 0 and (limit <= 0 or len(picked) < limit):
            # The keys of one create revision (one txn) in key order, as newest_created.
            start = bisect.bisect_left(entries, entries[end - 1][0], 0, end, key=_created)
            picked.extend(entries[start:end])
            end = start
        chosen = picked[:limit] if limit > 0 else picked
        return [self._kv[key] for _, key in chosen], count

    def _count(self, prefix: str) -> int:
        """How many live keys are under ``prefix`` (two bisections)."""
        keys = self._sorted_keys
        start = bisect.bisect_left(keys, prefix)
        if not prefix:
            return len(keys)
        last = prefix[-1]
        if ord(last) >= 0x10FFFF:
            return len(self.range(prefix, prefix=True))
        return bisect.bisect_left(keys, prefix[:-1] + chr(ord(last) + 1), start) - start

    def range_page(
        self, prefix: str, after: str | None, limit: int, max_bytes: int
    ) -> tuple[list[KeyValue], bool]:
        """Keys under ``prefix`` (sorted), after the key ``after`` (exclusive;
        None: from the first), at most ``limit`` of them (<= 0: no count
        limit) and at most about ``max_bytes`` on the wire (never fewer than
        one); and whether more keys follow."""
        keys = self._sorted_keys
        start = bisect.bisect_left(keys, prefix)
        if after is not None and after >= prefix:
            start = max(start, bisect.bisect_right(keys, after))
        out: list[KeyValue] = []
        size = 0
        for i in range(start, len(keys)):
            k = keys[i]
            if not k.startswith(prefix):
                return out, False
            kv = self._kv[k]
            size += encoded_size(kv)
            if out and ((limit > 0 and len(out) >= limit) or size > max_bytes):
                return out, True
            out.append(kv)
        return out, False

    # -- writes --------------------------------------------------------------
    def put(self, key: str, value: bytes, lease: int = NO_LEASE) -> int:
        self._check_lease(lease)
        check_puts(self.limits, [Put(key, value, lease)], self._kv, self._data_bytes)
        self.revision += 1
        events = [self._apply_put(key, value, lease)]
        self._publish(events)
        return self.revision

    def delete(self, key: str, prefix: bool = False) -> int:
        targets = [kv.key for kv in self.range(key, prefix)]
        if not targets:
            return 0
        self.revision += 1
        self._publish([self._apply_delete(k) for k in targets])
        return len(targets)

    def txn(
        self,
        compares: Sequence[Compare],
        success: Sequence[Op],
        failure: Sequence[Op],
        *,
        max_answer: int | None = None,
    ) -> TxnResult:
        """Apply the txn. With ``max_answer``, a txn whose gets could answer
        more than that many bytes (on the wire) raises LimitExceeded, unapplied."""
        ok = all(c.holds(self._kv.get(c.key)) for c in compares)
        ops = success if ok else failure
        puts = [op for op in ops if isinstance(op, Put)]
        for put in puts:
            self._check_lease(put.lease)
        check_puts(self.limits, puts, self._kv, self._data_bytes)
        if max_answer is not None:
            check_answer(ops, puts, max_answer, self.range)
        writes = any(isinstance(op, Put) for op in ops) or any(
            isinstance(op, Delete) and self.range(op.key, op.prefix) for op in ops
        )
        if writes:
            self.revision += 1
        events: list[WatchEvent] = []
        gets: list[list[KeyValue]] = []
        counts: list[int] = []
        for op in ops:
            if isinstance(op, Get):
                gets.append(self.range(op.key, op.prefix))
            elif isinstance(op, Count):
                counts.append(self._count(op.prefix))
            elif isinstance(op, Put):
                events.append(self._apply_put(op.key, op.value, op.lease))
            else:
                events.extend(self._apply_delete(kv.key) for kv in self.range(op.key, op.prefix))
        if events:
            self._publish(events)
        return TxnResult(succeeded=ok, revision=self.revision, gets=gets, counts=counts)

    def compact(self, revision: int) -> None:
        """Discard the history before ``revision`` (etcd's compaction): a watch
        may start at ``revision`` or later, not before. Raises
        RevisionCompacted if it is already compacted that far, ValueError for
        a revision the store has not reached."""
        if revision > self.revision:
            raise ValueError(
                f"cannot compact to revision {revision}: it is a future revision "
                f"(the store is at {self.revision})"
            )
        if revision <= self.compact_revision or revision < 1:
            raise RevisionCompacted(
                f"revision {revision} is already compacted "
                f"(the oldest a watch may start from is {max(self.compact_revision, 1)})",
                max(self.compact_revision, 1),
            )
        self.history.compact(revision)

    # -- leases --------------------------------------------------------------
    def lease_grant(self, ttl: float, owner: object | None = None) -> int:
        if not (math.isfinite(ttl) and MIN_TTL <= ttl <= MAX_TTL):
            raise ValueError(f"lease TTL must be between {MIN_TTL} and {MAX_TTL} s, got {ttl}")
        return self._leases.grant(ttl, self.clock.monotonic() + ttl, owner)

    def lease_keepalive(self, lease_id: int, owner: object | None = None) -> float:
        """Restore the full TTL; ``owner`` becomes the lease's owner (None: none)."""
        return self._leases.keepalive(lease_id, self.clock.monotonic(), owner)

    def lease_revoke(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id)
        if lease is None or not lease.keys:
            return
        self.revision += 1
        self._publish([self._apply_delete(k) for k in sorted(lease.keys)])

    def lease_owner_gone(self, owner: object, grace: float) -> list[int]:
        """``owner`` went away: each lease it owns expires within ``grace`` or
        half its TTL, whichever is shorter (``min(deadline, now + that)``,
        never later than before) unless kept alive again, and has no owner
        from now on. Returns those leases' ids. The earliest deadline may have
        moved earlier: re-arm the expiry timer."""
        return self._leases.owner_gone(owner, grace, self.clock.monotonic())

    def lease_disown(self, owner: object) -> None:
        """Forget ``owner`` without touching deadlines (its leases keep their TTL)."""
        self._leases.disown(owner)

    def expire_leases(self) -> list[int]:
        """Revoke every lease whose deadline has passed; returns their ids
        (O(log n) each, and when none has: :mod:`.lease_table`)."""
        expired = self._leases.expired(self.clock.monotonic())
        for lease_id in expired:
            self.lease_revoke(lease_id)
        return expired

    def next_deadline(self) -> float | None:
        """The earliest lease deadline, or None when there are no leases."""
        return self._leases.next_deadline()

    # -- watches -------------------------------------------------------------
    def add_watcher(
        self,
        key: str,
        prefix: bool,
        start_revision: int | None,
        callback: WatchCallback,
        *,
        catch_up: bool = True,
    ) -> int:
        """Register a watcher. With ``start_revision`` in the past it starts
        catching up from there: with ``catch_up`` (the default) the whole
        history since is delivered (synchronously) before this returns;
        without, the front-end calls :meth:`catch_up` at its own pace.
        Raises RevisionCompacted (not registered) for a compacted start."""
        if start_revision is not None and start_revision <= self.revision:
            if start_revision < self.compact_revision:
                raise RevisionCompacted(
                    f"revision {start_revision} is compacted; "
                    f"the oldest a watch may start from is {self.compact_revision}",
                    self.compact_revision,
                )
            watcher = _Watcher(key, prefix, callback, max(1, start_revision), synced=False)
            if not prefix and self._unchanged_since(key, start_revision):
                # Nothing to catch up on: live from now (no scan of the history).
                watcher = _Watcher(key, prefix, callback, self.revision + 1, synced=True)
        else:
            watcher = _Watcher(key, prefix, callback, self.revision + 1, synced=True)
        watch_id = next(self._watch_ids)
        self._watchers[watch_id] = watcher
        index = self._by_prefix if prefix else self._by_key
        index.setdefault(key, {})[watch_id] = watcher
        if not watcher.synced and catch_up:
            self.catch_up(watch_id)
        return watch_id

    def is_synced(self, watch_id: int) -> bool:
        watcher = self._watchers.get(watch_id)
        return watcher is None or watcher.synced

    def catch_up(self, watch_id: int, budget: int | None = None) -> bool:
        """Deliver history to a watcher that is catching up: whole revisions,
        in order, until it is synced, its callback refuses, or about
        ``budget`` bytes were delivered (None: no bound). True once synced
        (or unknown). If compaction passed it, it is removed and
        RevisionCompacted raised."""
        watcher = self._watchers.get(watch_id)
        if watcher is None or watcher.synced:
            return True
        if watcher.next_rev < self.compact_revision:
            self.remove_watcher(watch_id)
            raise RevisionCompacted(
                f"the watch fell behind: revision {watcher.next_rev} was compacted; "
                f"the oldest kept is {self.compact_revision}",
                self.compact_revision,
            )
        sent = 0
        for revision, events, size in self.history.since(watcher.next_rev):
            if budget is not None and sent >= budget:
                return False
            matching = [e for e in events if watcher.matches(e.kv.key)]
            if matching:
                if watcher.callback(matching) is False:
                    return False
                sent += size
            watcher.next_rev = revision + 1
            if watch_id not in self._watchers:  # removed by its callback
                return True
        watcher.synced = True
        watcher.next_rev = self.revision + 1
        return True

    def watch_backlog(self, watch_id: int) -> int:
        """History bytes a watcher that is catching up has yet to be sent
        (every event of those revisions counted; 0 when it is live)."""
        watcher = self._watchers.get(watch_id)
        if watcher is None or watcher.synced:
            return 0
        return self.history.bytes_since(watcher.next_rev)

    def watch_next_revision(self, watch_id: int) -> int:
        """The first revision not delivered to a watcher yet (0: unknown)."""
        watcher = self._watchers.get(watch_id)
        return 0 if watcher is None else watcher.next_rev

    def remove_watcher(self, watch_id: int) -> None:
        watcher = self._watchers.pop(watch_id, None)
        if watcher is None:
            return
        index = self._by_prefix if watcher.prefix else self._by_key
        group = index.get(watcher.key)
        if group is not None:
            group.pop(watch_id, None)
            if not group:
                del index[watcher.key]

    # -- internals -----------------------------------------------------------
    def _unchanged_since(self, key: str, revision: int) -> bool:
        """Whether ``key`` has had no event from ``revision`` on: it exists and
        was last written before (a delete since would have left it absent, or
        written again later)."""
        kv = self._kv.get(key)
        return kv is not None and kv.mod_revision < revision

    def _check_lease(self, lease: int) -> None:
        if lease != NO_LEASE and lease not in self._leases:
            raise LeaseNotFound(f"lease {lease:x} not found (expired or revoked)")

    def _apply_put(self, key: str, value: bytes, lease: int) -> WatchEvent:
        old = self._kv.get(key)
        if old is None:
            bisect.insort(self._sorted_keys, key)
            folder = self._folders.setdefault(_folder(key), [])
            bisect.insort(folder, (self.revision, key))
            kv = KeyValue(key, value, self.revision, self.revision, 1, lease)
        else:
            if old.lease not in (NO_LEASE, lease) and old.lease in self._leases:
                self._leases[old.lease].keys.discard(key)
            kv = KeyValue(key, value, old.create_revision, self.revision, old.version + 1, lease)
        if lease != NO_LEASE:
            self._leases[lease].keys.add(key)
        self._kv[key] = kv
        if old is None:
            self._data_bytes += len(key) + len(value) + KEY_OVERHEAD
        else:
            self._data_bytes += len(value) - len(old.value)
        return WatchEvent("put", kv)

    def _apply_delete(self, key: str) -> WatchEvent:
        old = self._kv.pop(key)
        self._data_bytes -= len(key) + len(old.value) + KEY_OVERHEAD
        index = bisect.bisect_left(self._sorted_keys, key)
        del self._sorted_keys[index]
        name = _folder(key)
        folder = self._folders[name]
        del folder[bisect.bisect_left(folder, (old.create_revision, key))]
        if not folder:
            del self._folders[name]
        if old.lease != NO_LEASE and old.lease in self._leases:
            self._leases[old.lease].keys.discard(key)
        return WatchEvent("delete", KeyValue(key, b"", old.create_revision, self.revision, 0))

    def _publish(self, events: list[WatchEvent]) -> None:
        self.history.append(self.revision, events)
        # Each matching synced watcher once, in registration order, with this
        # revision's events for its key or prefix (one catching up reads them
        # from history later).
        hits: dict[int, _Watcher] = {}
        for event in events:
            key = event.kv.key
            group = self._by_key.get(key)
            if group:
                hits.update(group)
            for prefix, group in self._by_prefix.items():
                if key.startswith(prefix):
                    hits.update(group)
        if not hits:
            return
        revision = self.revision
        for _, watcher in sorted(hits.items()):
            if not watcher.synced:
                continue
            if len(events) == 1:
                matching = events
            else:
                matching = [e for e in events if watcher.matches(e.kv.key)]
                if not matching:
                    continue
            if watcher.callback(matching) is False:
                watcher.synced = False  # catches up from this revision
                watcher.next_rev = revision
            else:
                watcher.next_rev = revision + 1


def _folder(key: str) -> str:
    """The folder of ``key``: up to and with its last ``/`` ("" for none)."""
    return key[: key.rfind("/") + 1]


def _created(entry: tuple[int, str]) -> int:
    return entry[0]
