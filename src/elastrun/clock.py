"""Time, injected: absolute monotonic deadlines, and waits on them.

Everything that waits works with *absolute monotonic deadlines* obtained from a
:class:`Clock`, never with wall-clock time and never with clocks of other nodes,
and it waits through the same clock: :meth:`Clock.sleep_until` (sleep to a
deadline) and :func:`wait_until` (an awaitable, abandoned at a deadline with
:class:`TimeoutError`). A deadline of ``math.inf`` never passes.

* :data:`SYSTEM_CLOCK`: production; the machine's monotonic clock.
* :class:`FakeClock`: pure tests; time moves only when :meth:`FakeClock.advance`
  is called, and sleepers wake when it passes their deadline.
* :func:`duration_text`: a duration as people read it, the one form every
  line and table of elastrun shows (``3m04s``).
* :class:`VirtualTimeLoop`: an asyncio event loop whose time is virtual, with
  its :attr:`~VirtualTimeLoop.clock`. Time jumps to the next timer as soon as
  every task waits (trio's "autojump"): a test that waits for a 10 minute
  timeout runs it in microseconds, and the order of what happens is
  deterministic. For in-process tests whose I/O is in memory: threads of
  ``run_in_executor`` are waited for in real time; sockets are not supported
  (a reply may be on its way when time jumps).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import math
import selectors
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from concurrent.futures import Future as ConcurrentFuture
from typing import Any, Protocol, TypeVar

__all__ = [
    "SYSTEM_CLOCK",
    "Clock",
    "FakeClock",
    "SystemClock",
    "VirtualTimeLoop",
    "duration_text",
    "remaining",
    "run_virtual",
    "wait_until",
]

T = TypeVar("T")


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a monotonic scale; only differences are meaningful."""
        ...

    async def sleep_until(self, deadline: float) -> None:
        """Return once :meth:`monotonic` reaches ``deadline`` (at once if past)."""
        ...

    def timeout_at(self, deadline: float) -> contextlib.AbstractAsyncContextManager[Any]:
        """An ``async with`` block cancelled at ``deadline`` on this clock,
        which then raises :class:`TimeoutError` (as ``asyncio.timeout_at``)."""
        ...


async def wait_until(aw: Awaitable[T], deadline: float, clock: Clock) -> T:
    """``await aw``, or raise :class:`TimeoutError` (``aw`` cancelled) once
    ``deadline`` passes on ``clock``."""
    if math.isinf(deadline):
        return await aw
    async with clock.timeout_at(deadline):
        return await aw


async def _forever() -> None:
    await asyncio.get_running_loop().create_future()


def _loop_deadline(deadline: float, clock: Clock) -> float | None:
    """``deadline`` on ``clock`` as a deadline on the running loop's time."""
    if math.isinf(deadline):
        return None
    return asyncio.get_running_loop().time() + (deadline - clock.monotonic())


class SystemClock:
    """The machine's monotonic clock; waits run on the event loop's timers."""

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep_until(self, deadline: float) -> None:
        if math.isinf(deadline):
            await _forever()
        await asyncio.sleep(max(0.0, deadline - time.monotonic()))

    def timeout_at(self, deadline: float) -> contextlib.AbstractAsyncContextManager[Any]:
        return asyncio.timeout_at(_loop_deadline(deadline, self))


SYSTEM_CLOCK: Clock = SystemClock()


def remaining(deadline: float, clock: Clock = SYSTEM_CLOCK) -> float:
    """Seconds left until ``deadline`` (never negative; ``inf`` stays ``inf``)."""
    if math.isinf(deadline):
        return math.inf
    return max(0.0, deadline - clock.monotonic())


def duration_text(seconds: float, *, up: bool = False) -> str:
    """A duration for people: ``12s``, ``3m04s``, ``2h05m``, ``3d04h``
    (``never`` for an infinite one). Whole seconds rounded down (time spent),
    or ``up`` (time left: never ``0s`` while some remains)."""
    if math.isinf(seconds):
        return "never"
    if math.isnan(seconds) or seconds <= 0:
        n = 0
    else:
        n = math.ceil(seconds) if up else math.floor(seconds)
    if n < 60:
        return f"{n}s"
    if n < 3600:
        return f"{n // 60}m{n % 60:02d}s"
    if n < 86400:
        return f"{n // 3600}h{n % 3600 // 60:02d}m"
    return f"{n // 86400}d{n % 86400 // 3600:02d}h"


class FakeClock:
    """A clock that only moves when told to (for pure tests). Sleepers and
    :meth:`timeout_at` blocks wake when :meth:`advance` passes their deadline."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._order = itertools.count()
        self._due: list[tuple[float, int, Callable[[], None]]] = []

    def monotonic(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock does not go backwards")
        self._now += seconds
        while self._due and self._due[0][0] <= self._now:
            heapq.heappop(self._due)[2]()

    def _at(self, deadline: float, wake: Callable[[], None]) -> None:
        if deadline <= self._now:
            wake()
        elif not math.isinf(deadline):
            heapq.heappush(self._due, (deadline, next(self._order), wake))

    async def sleep_until(self, deadline: float) -> None:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def wake() -> None:
            if not done.done():
                done.set_result(None)

        self._at(deadline, wake)
        await done

    @contextlib.asynccontextmanager
    async def timeout_at(self, deadline: float) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(None) as scope:
            inside = True

            def expire() -> None:
                if inside and scope.when() is None:
                    scope.reschedule(loop.time())  # cancels the block on the next turn

            self._at(deadline, expire)
            try:
                yield
            finally:
                inside = False


class _LoopClock:
    """The clock of an event loop: its ``time()``."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def monotonic(self) -> float:
        return self._loop.time()

    async def sleep_until(self, deadline: float) -> None:
        if math.isinf(deadline):
            await _forever()
        await asyncio.sleep(max(0.0, deadline - self._loop.time()))

    def timeout_at(self, deadline: float) -> contextlib.AbstractAsyncContextManager[Any]:
        return asyncio.timeout_at(None if math.isinf(deadline) else deadline)


class _VirtualSelector(selectors.DefaultSelector):
    """Selects on real file descriptors without blocking; where the loop
    would block until its next timer, moves the loop's virtual time there."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.threads = 0  # run_in_executor jobs in flight: virtual time waits for them
        self.idle_waiters: list[asyncio.Future[None]] = []

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if self.threads:
            # A thread's work takes no virtual time: wait (really) for it to
            # finish, which wakes the loop, with the virtual time standing
            # still, so that a test's times do not depend on the machine's load.
            return super().select(timeout)
        if self.idle_waiters:
            waiters, self.idle_waiters = self.idle_waiters, []
            for w in waiters:
                if not w.done():
                    w.set_result(None)
            return []
        if timeout is None:
            return super().select(None)  # nothing scheduled: only I/O can wake it
        self.now += timeout
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose time is virtual (see the module doc)."""

    def __init__(self) -> None:
        self._vselector = _VirtualSelector()
        super().__init__(self._vselector)
        self.clock: Clock = _LoopClock(self)

    def time(self) -> float:
        return self._vselector.now

    def run_in_executor(  # type: ignore[override]
        self, executor: Any, func: Callable[..., T], *args: Any
    ) -> asyncio.Future[T]:
        fut = super().run_in_executor(executor, func, *args)
        self._vselector.threads += 1

        def done(_: asyncio.Future[T] | ConcurrentFuture[T]) -> None:
            self._vselector.threads -= 1

        fut.add_done_callback(done)
        return fut

    async def all_tasks_blocked(self) -> None:
        """Return once every other task waits (for a timer, I/O or another
        task), before time moves on: trio's ``wait_all_tasks_blocked``."""
        waiter: asyncio.Future[None] = self.create_future()
        self._vselector.idle_waiters.append(waiter)
        await waiter


def run_virtual(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` on a fresh :class:`VirtualTimeLoop` (as ``asyncio.run``)."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(main)
