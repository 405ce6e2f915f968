"""Structured events: what happened, as JSON lines, for operators and tools.

Components emit events through an :class:`EventSink`. The agent writes them to
a JSON-lines file (one object per line, schema version ``EVENT_SCHEMA``); tests
and embedders can collect them in memory. Each event has ``v`` (schema
version), ``ts`` (wall-clock seconds, for humans correlating logs; never used
for decisions), ``kind``, and event-specific fields: an event is one of the
typed kinds of :mod:`elastrun.event_kinds` (the catalogue).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from elastrun.event_kinds import Event
from elastrun.safefs import append_fd

__all__ = ["EVENT_SCHEMA", "EventSink", "JsonLinesSink", "ListSink", "NullSink", "make_event"]

EVENT_SCHEMA = 1


def make_event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"v": EVENT_SCHEMA, "ts": round(time.time(), 6), "kind": kind, **fields}


class EventSink(Protocol):
    def emit(self, event: Event) -> None: ...


class NullSink:
    def emit(self, event: Event) -> None:
        return None


class TeeSink:
    """Each event to every one of ``sinks``, in order."""

    def __init__(self, *sinks: EventSink) -> None:
        self.sinks = sinks

    def emit(self, event: Event) -> None:
        for s in self.sinks:
            s.emit(event)


class ListSink:
    """Keeps events in memory (tests, embedding)."""

    def __init__(self, on_event: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.events: list[dict[str, Any]] = []
        self._on_event = on_event

    def emit(self, event: Event) -> None:
        line = make_event(event.KIND, **event.to_json())
        self.events.append(line)
        if self._on_event is not None:
            self._on_event(line)

    def kinds(self) -> list[str]:
        return [e["kind"] for e in self.events]


class JsonLinesSink:
    """Appends one JSON object per line to a file, flushed per event.

    The file is opened without following a link, never a FIFO or a device,
    and never another user's file (:func:`elastrun.safefs.append_fd`:
    :class:`~elastrun.safefs.UnsafePath`); a missing folder is created."""

    def __init__(self, path: str | os.PathLike[str], **common: Any) -> None:
        self.path = os.fspath(path)
        parent = os.path.dirname(self.path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        self._common = common
        self._lock = threading.Lock()
        fd = append_fd(self.path, 0o666)  # as open() would make it, less the umask
        self._file = os.fdopen(fd, "a", encoding="utf-8")

    def emit(self, event: Event) -> None:
        self.write(event.KIND, event.to_json())

    def write(self, kind: str, fields: Mapping[str, Any]) -> None:
        """One line: ``kind``, the sink's common fields, then ``fields``."""
        line = json.dumps(make_event(kind, **{**self._common, **fields}), sort_keys=True)
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()
