"""The watches of one connection of the embedded store's server
(:class:`~elastrun.store.server_conn.Connection` inherits
:class:`WatchStreams`).

A watch is either live (each write's events are sent as they happen) or
catching up from the engine's history, a step at a time while the
connection's output drains. A live watch whose connection has more than the
high-water mark queued falls back to catching up. A watch that falls behind
the compacted history is cancelled (``compacted``); one whose unsent bytes,
what is queued unread on its connection plus the history it has yet to be
sent, pass ``slow_watch_bytes`` is cancelled (``slow``), so a client that does
not read is not sent more of it when it reads a little.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from elastrun.errors import ProtocolError, RevisionCompacted
from elastrun.store import codec
from elastrun.store.base import WatchEvent
from elastrun.store.engine import Engine
from elastrun.store.server_ops import failure_response
from elastrun.store.server_output import OutputStream

__all__ = ["CATCH_UP_STEP", "SLOW_CHECK_INTERVAL", "WatchStreams"]

# History bytes a catching-up watch is sent per step (then other work runs).
CATCH_UP_STEP = 256 * 1024
# Seconds between checks for slow watches while a connection's output is backed up.
SLOW_CHECK_INTERVAL = 1.0


class WatchStreams(OutputStream):
    """A connection's watches: the ``watch`` request, catching up, slow watches."""

    engine: Engine
    peer: str
    watches: dict[int, int]  # client's watch id -> engine watcher id
    lagging: dict[int, int]  # the watches catching up from history (same ids)
    _pump_scheduled: bool
    _slow_check_soon: bool
    _slow_timer: asyncio.TimerHandle | None

    def send(self, message: Mapping[str, Any]) -> None:
        raise NotImplementedError

    def slow_watch_cancelled(self, watch_id: int, message: str) -> None:
        """Count and log watch ``watch_id``, cancelled as slow (its frame is sent here)."""
        raise NotImplementedError

    def _watch(self, request_id: int, request: codec.WatchRequest) -> None:
        watch_id = request.watch
        if watch_id in self.watches:
            self.send(
                codec.error_response(
                    request_id, "invalid", f"watch id {watch_id} is already in use"
                )
            )
            return

        def deliver(events: list[WatchEvent]) -> bool:
            return self.send_events(watch_id, events)

        start = request.start_revision
        try:
            watcher = self.engine.add_watcher(
                request.key, request.prefix, start, deliver, catch_up=False
            )
        except RevisionCompacted as exc:
            self.send(failure_response(request_id, exc))
            return
        self.watches[watch_id] = watcher
        revision = self.engine.revision
        if start is not None and not self.engine.is_synced(watcher):
            # Everything before ``start`` is "delivered"; history follows this answer.
            revision = max(0, start - 1)
            self.lagging[watch_id] = watcher
        self.send(codec.encode_response(request_id, codec.RevisionAnswer(revision)))
        self._schedule_pump()

    def _schedule_pump(self) -> None:
        if self.lagging and not self._pump_scheduled and not self.closing:
            self._pump_scheduled = True
            asyncio.get_running_loop().call_soon(self._pump)

    def _pump(self) -> None:
        """One step of catching up for each lagging watch, while output drains."""
        self._pump_scheduled = False
        for watch_id, watcher in list(self.lagging.items()):
            if self.closing:
                return
            if self.write_paused:
                self._cancel_slow_watches()
                return  # resume_writing schedules the next step
            try:
                synced = self.engine.catch_up(watcher, CATCH_UP_STEP)
            except RevisionCompacted as exc:
                self.lagging.pop(watch_id, None)
                self.watches.pop(watch_id, None)
                frame = codec.encode_cancel(watch_id, "compacted", str(exc), exc.compact_revision)
                self.send(frame)
                continue
            if synced:
                self.lagging.pop(watch_id, None)
        self._schedule_pump()

    def send_events(self, watch_id: int, events: list[WatchEvent]) -> bool:
        """The engine's callback for one revision of one watch: False (not
        sent; the watch catches up later) while the output is backed up."""
        if self.closing or self.transport is None or watch_id not in self.watches:
            return True  # the watch is ending: nothing to send, nothing to catch up
        if self.write_paused:
            self.lagging[watch_id] = self.watches[watch_id]
            if not self._slow_check_soon:  # once the engine has noted where it stopped
                self._slow_check_soon = True
                asyncio.get_running_loop().call_soon(self._slow_check_now)
            return False
        for head, body, tail in _event_frames(watch_id, events):
            self._write(head, body, tail)
        return True

    # -- slow watches ------------------------------------------------------------
    def _slow_check_now(self) -> None:
        self._slow_check_soon = False
        if self.write_paused:
            self._cancel_slow_watches()

    def _slow_check(self) -> None:
        self._slow_timer = None
        if self.closing or not self.write_paused:
            return
        self._cancel_slow_watches()
        loop = asyncio.get_running_loop()
        self._slow_timer = loop.call_later(SLOW_CHECK_INTERVAL, self._slow_check)

    def _cancel_slow_watches(self) -> None:
        """Cancel (code ``slow``) the watches catching up whose unsent bytes
        pass ``slow_watch_bytes``: what is queued unread on this connection
        plus the history each has yet to be sent."""
        if not self.lagging or self.closing:
            return
        queued = self.output_size()
        bound = self.limits.slow_watch_bytes
        for watch_id, watcher in list(self.lagging.items()):
            behind = queued + self.engine.watch_backlog(watcher)
            if behind <= bound:
                continue
            next_revision = self.engine.watch_next_revision(watcher)
            self.engine.remove_watcher(watcher)
            self.lagging.pop(watch_id, None)
            self.watches.pop(watch_id, None)
            message = (
                f"the store ended the watch: its client left {behind} bytes of it unread "
                f"(more than slow_watch_bytes, {bound}); read the current state and watch "
                f"again from revision {next_revision}"
            )
            self.slow_watch_cancelled(watch_id, message)
            self.send(codec.encode_cancel(watch_id, "slow", message, next_revision=next_revision))


class _EncodedEvents:
    """The last revision's events as encoded for a watch: the next watch sent
    the same events (every watch of a key gets the same ones) reuses them
    instead of encoding a value of up to 1.5 MiB once per watch."""

    events: list[WatchEvent] = []
    body = b""

    @classmethod
    def body_of(cls, events: list[WatchEvent]) -> bytes:
        last = cls.events
        if len(last) != len(events) or any(a is not b for a, b in zip(last, events, strict=True)):
            cls.events, cls.body = list(events), codec.encode_events_body(events)
        return cls.body


def _event_frames(
    watch_id: int, events: list[WatchEvent], partial: bool = False
) -> list[tuple[bytes, bytes, bytes]]:
    """One revision's events as frames, each in the parts of
    :func:`~elastrun.store.codec.events_frame_parts` (the middle one shared
    by every watch sent the same events): one frame, unless they exceed the
    frame limit; then split, every frame but the revision's last marked
    ``partial`` (``partial``: mark the last one too, it is not the
    revision's last)."""
    try:
        return [codec.events_frame_parts(watch_id, _EncodedEvents.body_of(events), partial)]
    except ProtocolError:
        if len(events) == 1:  # cannot happen within the key and value limits
            raise
    half = len(events) // 2
    return _event_frames(watch_id, events[:half], True) + _event_frames(
        watch_id, events[half:], partial
    )
