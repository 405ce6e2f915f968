"""The agent's signal handlers: every signal acted on, nothing printed.

asyncio's ``loop.add_signal_handler`` learns which signal came from the byte
that Python's C-level handler writes to the loop's wakeup socket: one byte
per delivered signal. A socket pair holds about 278 unread one-byte writes
(each costs a socket buffer, not a byte). When many children end while the
loop is busy (a large group stopped on SIGTERM: a SIGCHLD each), the writes
that do not fit fail. Python then prints "Exception ignored when trying to
write to the signal wakeup fd" for each one. The signal in that byte is lost
to asyncio, whichever signal it was: a SIGTERM too.

:class:`SignalRouter` does not rely on those bytes. Its wakeup socket only wakes
the loop. With ``warn_on_full_buffer=False`` a full socket is no error, and
it wakes the loop just the same. Python-level handlers tell which signal came. They
run in the main thread between two bytecodes, from per-signal flags that
cannot overflow, and hand the callback to the loop with
``call_soon_threadsafe``. A burst of one signal between two handler runs is
one call. With ``coalesce`` (SIGCHLD), the burst stays one call until the
callback has run.

:class:`StopSignals` is what the agent's loop does with the terminating
signals: their handlers only queue them; every wait of the loop is raced with
them (:meth:`StopSignals.first`), and a stop of the workers runs to its end
while they are counted (:meth:`StopSignals.during`: the second cuts its
grace short).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Any, TypeVar

__all__ = ["SignalRouter", "Signalled", "StopSignals"]

SignalCallback = Callable[[int], None]
CANCEL_TIMEOUT = 5.0  # s for the losers of a race to end once cancelled
T = TypeVar("T")


class SignalRouter:
    """Signal handlers whose callbacks run in ``loop`` (main thread only)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._callbacks: dict[int, SignalCallback] = {}
        self._previous: dict[int, Any] = {}
        self._coalesce: set[int] = set()
        self._pending: set[int] = set()
        self._wake: tuple[socket.socket, socket.socket] | None = None
        self._old_wakeup_fd = -1

    def add(self, sig: int, callback: SignalCallback, *, coalesce: bool = False) -> None:
        """Call ``callback(sig)`` in the loop when ``sig`` comes. Raises
        ValueError or OSError where it cannot be handled (not the main
        thread, a signal that cannot be caught)."""
        self._start()
        previous = signal.signal(sig, self._handler)
        self._previous.setdefault(sig, previous)
        self._callbacks[sig] = callback
        if coalesce:
            self._coalesce.add(sig)

    def close(self) -> None:
        """Give every signal its previous handler back, and the wakeup fd."""
        for sig, previous in self._previous.items():
            with contextlib.suppress(ValueError, TypeError, OSError):
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        self._callbacks.clear()
        if self._wake is None:
            return
        with contextlib.suppress(ValueError, OSError):
            signal.set_wakeup_fd(self._old_wakeup_fd)
        reader, writer = self._wake
        with contextlib.suppress(ValueError, OSError, RuntimeError):
            self._loop.remove_reader(reader.fileno())
        reader.close()
        writer.close()
        self._wake = None

    def _start(self) -> None:
        if self._wake is not None:
            return
        reader, writer = socket.socketpair()
        reader.setblocking(False)
        writer.setblocking(False)
        try:
            # Raises ValueError outside the main thread: nothing is installed then.
            self._old_wakeup_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        except (ValueError, OSError):
            reader.close()
            writer.close()
            raise
        self._wake = (reader, writer)
        self._loop.add_reader(reader.fileno(), self._drain)

    def _drain(self) -> None:
        if self._wake is None:
            return
        with contextlib.suppress(OSError):
            while self._wake[0].recv(4096):
                pass

    def _handler(self, signum: int, _frame: FrameType | None) -> None:
        if signum in self._coalesce:
            if signum in self._pending:
                return
            self._pending.add(signum)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody to tell
            self._loop.call_soon_threadsafe(self._dispatch, signum)

    def _dispatch(self, signum: int) -> None:
        self._pending.discard(signum)  # a signal from now on is a new call
        callback = self._callbacks.get(signum)
        if callback is not None:
            callback(signum)


class Signalled(Exception):
    """A terminating signal came first."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class StopSignals:
    """The terminating signals, queued by their handlers (:meth:`put`) for
    the agent's loop to act on."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[int] = asyncio.Queue()
        self.seen = 0  # terminating signals received
        self.pending: int | None = None  # the first one, once acted on

    def put(self, sig: int) -> None:
        self._queue.put_nowait(sig)

    def raise_pending(self) -> None:
        """Raise Signalled if a terminating signal came."""
        if self.pending is not None:
            raise Signalled(self.pending)

    async def first(self, *racers: Awaitable[T]) -> T:
        """The result of the first of ``racers`` to finish (the earlier one
        given when several finish together), or Signalled when a terminating
        signal comes first. The others are cancelled (bounded)."""
        if self.pending is not None:
            for aw in racers:
                if asyncio.iscoroutine(aw):
                    aw.close()
            raise Signalled(self.pending)
        tasks = [asyncio.ensure_future(aw) for aw in racers]
        sig_task = asyncio.ensure_future(self._queue.get())
        every: list[asyncio.Future[Any]] = [*tasks, sig_task]
        try:
            done, _ = await asyncio.wait(every, return_when=asyncio.FIRST_COMPLETED)
        finally:
            pending = [t for t in every if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.wait(pending, timeout=CANCEL_TIMEOUT)
            for t in every:  # a loser's error is not this race's outcome
                t.add_done_callback(_retrieve)
        if sig_task in done:
            self.seen += 1
            self.pending = sig_task.result()
            raise Signalled(self.pending)
        return next(t for t in tasks if t in done).result()

    async def during(self, work: Awaitable[T], hurry: Callable[[], None]) -> T:
        """``work`` (a stop of the workers, itself bounded) to its end; a
        terminating signal meanwhile is remembered, and from the second one
        on ``hurry()`` is called (SIGKILL at once)."""
        if self.seen >= 2:
            hurry()
        task = asyncio.ensure_future(work)
        while not task.done():
            sig_task = asyncio.ensure_future(self._queue.get())
            done, _ = await asyncio.wait({task, sig_task}, return_when="FIRST_COMPLETED")
            if sig_task in done:
                self.seen += 1
                if self.pending is None:
                    self.pending = sig_task.result()
                if self.seen >= 2:
                    hurry()
            else:
                sig_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sig_task
        return task.result()


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Mark a finished racer's error as seen: the winner decides the outcome,
    and a loser that failed too (the store lost while the workers failed)
    must not print "Task exception was never retrieved" at exit."""
    if not task.cancelled():
        task.exception()
