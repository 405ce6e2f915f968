"""The clock's waits: deadlines on the system clock, the fake clock and the
virtual-time event loop."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from elastrun.clock import SYSTEM_CLOCK, FakeClock, VirtualTimeLoop, run_virtual, wait_until


def test_wait_until_on_the_system_clock_times_out_at_the_deadline() -> None:
    async def main() -> tuple[float, float]:
        t0 = SYSTEM_CLOCK.monotonic()
        with pytest.raises(TimeoutError):
            await wait_until(asyncio.Event().wait(), t0 + 0.05, SYSTEM_CLOCK)
        timed_out = SYSTEM_CLOCK.monotonic()
        assert await wait_until(asyncio.sleep(0, "x"), math.inf, SYSTEM_CLOCK) == "x"
        return t0, timed_out

    t0, timed_out = asyncio.run(main())  # (bounded: a wait that hung would hang here)
    assert timed_out >= t0 + 0.04  # not before its deadline (the loop's timers: 1 ms)


def test_fake_clock_wakes_sleepers_and_times_out_only_when_advanced() -> None:
    async def main() -> list[str]:
        clock, seen = FakeClock(), list[str]()

        async def sleeper() -> None:
            await clock.sleep_until(clock.monotonic() + 5)
            seen.append("woke")

        async def waiter() -> None:
            try:
                await wait_until(asyncio.Event().wait(), clock.monotonic() + 3, clock)
            except TimeoutError:
                seen.append("timed out")

        tasks = [asyncio.create_task(sleeper()), asyncio.create_task(waiter())]
        for _ in range(5):
            await asyncio.sleep(0)
        assert seen == []  # real time passes; the fake clock does not
        clock.advance(3)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert seen == ["timed out"]
        clock.advance(2)
        await asyncio.gather(*tasks)
        return seen

    assert asyncio.run(main()) == ["timed out", "woke"]


def test_virtual_time_jumps_to_the_next_timer_once_every_task_waits() -> None:
    async def main() -> list[tuple[str, float]]:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, VirtualTimeLoop)
        clock, seen = loop.clock, list[tuple[str, float]]()
        t0 = clock.monotonic()

        async def at(name: str, delay: float) -> None:
            await clock.sleep_until(t0 + delay)
            seen.append((name, clock.monotonic() - t0))

        await asyncio.gather(at("ten minutes", 600.0), at("a second", 1.0))
        with pytest.raises(TimeoutError):
            await wait_until(asyncio.Event().wait(), clock.monotonic() + 30.0, clock)
        seen.append(("timeout", clock.monotonic() - t0))
        return seen

    # Ten and a half virtual minutes: were they real, the test's timeout (300 s)
    # would end it first.
    seen = run_virtual(main())
    assert seen == [("a second", 1.0), ("ten minutes", 600.0), ("timeout", 630.0)]


def test_virtual_time_waits_for_threads_and_reports_all_tasks_blocked() -> None:
    async def main() -> tuple[int, float, list[str]]:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, VirtualTimeLoop)
        t0, seen = loop.time(), list[str]()
        # A timer far away does not fire while a thread is at work.
        loop.call_later(600.0, seen.append, "timer")

        def work() -> int:
            time.sleep(0.05)
            return 7

        value = await asyncio.to_thread(work)
        assert seen == []

        async def step() -> None:
            await asyncio.sleep(0)
            seen.append("stepped")

        task = asyncio.create_task(step())
        await loop.all_tasks_blocked()  # every other task waits: time has not moved
        await task
        return value, loop.time() - t0, list(seen)

    value, elapsed, seen = run_virtual(main())
    # Time moved only as the thread took (real time), never to the timer.
    assert value == 7 and elapsed < 600.0 and seen == ["stepped"]
