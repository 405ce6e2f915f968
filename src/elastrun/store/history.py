"""The engine's watch history: the events of past revisions, bounded in bytes.

Watches that start in the past, resume after a reconnect, or fall behind read
it. It keeps the newest revisions whose events fit ``max_bytes`` (and at most
``max_revisions`` of them, and always the newest one, whatever its size);
older ones are *compacted*: :attr:`History.compact_revision` is then the
oldest revision a watch may start from, as in etcd.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

from elastrun.store.base import WatchEvent

__all__ = ["EVENT_OVERHEAD", "History", "event_size"]

# Bytes counted per event on top of its key and value: a rough share of the
# Python objects that hold it.
EVENT_OVERHEAD = 160


def event_size(event: WatchEvent) -> int:
    return len(event.kv.key) + len(event.kv.value) + EVENT_OVERHEAD


class History:
    def __init__(self, max_bytes: int, max_revisions: int) -> None:
        self.max_bytes = max_bytes
        self.max_revisions = max_revisions
        # The oldest revision a watch may start from (0: nothing compacted yet).
        self.compact_revision = 0
        # (revision, events, bytes), ascending; entries before ``_start`` are
        # dropped (and removed from the list in batches).
        self._entries: list[tuple[int, list[WatchEvent], int]] = []
        # Bytes appended in all, through each entry (same index as _entries).
        self._ends: list[int] = []
        self._appended = 0
        self._start = 0
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries) - self._start

    def append(self, revision: int, events: list[WatchEvent]) -> None:
        size = sum(event_size(e) for e in events)
        self._entries.append((revision, events, size))
        self._appended += size
        self._ends.append(self._appended)
        self.bytes += size
        while len(self) > 1 and (self.bytes > self.max_bytes or len(self) > self.max_revisions):
            self._drop_oldest()
        self._pack()

    def compact(self, revision: int) -> None:
        """Drop every revision before ``revision``."""
        entries = self._entries
        while self._start < len(entries) and entries[self._start][0] < revision:
            self._drop_oldest()
        self.compact_revision = max(self.compact_revision, revision)
        self._pack()

    def since(self, revision: int) -> Iterator[tuple[int, list[WatchEvent], int]]:
        """The kept entries from ``revision`` on, oldest first. Do not append
        while iterating."""
        entries = self._entries
        i = bisect.bisect_left(entries, revision, lo=self._start, key=_revision_of)
        for j in range(i, len(entries)):
            yield entries[j]

    def bytes_since(self, revision: int) -> int:
        """Bytes of the kept revisions from ``revision`` on (what a watch
        that has delivered everything before ``revision`` has yet to send)."""
        entries = self._entries
        i = bisect.bisect_left(entries, revision, lo=self._start, key=_revision_of)
        if i >= len(entries):
            return 0
        return self._appended - (self._ends[i] - entries[i][2])

    def _drop_oldest(self) -> None:
        revision, _, size = self._entries[self._start]
        self._entries[self._start] = (revision, [], 0)  # release the events now
        self._start += 1
        self.bytes -= size
        self.compact_revision = max(self.compact_revision, revision + 1)

    def _pack(self) -> None:
        if self._start > 1024 and self._start * 2 > len(self._entries):
            del self._entries[: self._start]
            del self._ends[: self._start]
            self._start = 0


def _revision_of(entry: tuple[int, list[WatchEvent], int]) -> int:
    return entry[0]
