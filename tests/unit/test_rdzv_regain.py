"""A node that lost its lease registers again while its store is unreachable,
for at most its rejoin window (``join_timeout``): ``rendezvous/register.py``."""

from __future__ import annotations

import asyncio

import pytest

from elastrun.clock import Clock, VirtualTimeLoop, run_virtual
from elastrun.errors import (
    AuthenticationError,
    HostLost,
    StoreTimeout,
    StoreUnavailable,
)
from elastrun.rendezvous.register import RETRY_EVERY, regain


def _clock() -> Clock:
    """The virtual clock of the running loop (run_virtual's)."""
    loop = asyncio.get_running_loop()
    assert isinstance(loop, VirtualTimeLoop)
    return loop.clock


def test_an_unreachable_store_is_retried_until_it_answers() -> None:
    async def scenario() -> tuple[float, int, list[str]]:
        clock = _clock()
        tries: list[int] = []
        seen: list[str] = []

        async def attempt() -> None:
            tries.append(1)
            if len(tries) < 5:
                raise StoreTimeout("granted no lease within 2 s")

        took = await regain(
            attempt, window=60.0, clock=clock, lost="gone", on_retry=lambda e: seen.append(str(e))
        )
        return took, len(tries), seen

    took, tries, seen = run_virtual(scenario())
    assert tries == 5
    assert seen == ["granted no lease within 2 s"] * 4
    assert took == pytest.approx(4 * RETRY_EVERY)


def test_past_the_window_it_gives_up_naming_the_store_the_window_and_why() -> None:
    async def scenario() -> tuple[BaseException, float]:
        clock = _clock()
        start = clock.monotonic()

        async def attempt() -> None:
            raise StoreTimeout("127.0.0.1:29400 granted no lease within 2 s (lease_ttl)")

        try:
            await regain(
                attempt, window=12.0, clock=clock, lost="lease expired", store="store at h:1"
            )
        except StoreUnavailable as e:
            return e, clock.monotonic() - start
        raise AssertionError("no error")

    err, took = run_virtual(scenario())
    assert 12.0 <= took <= 12.0 + RETRY_EVERY
    text = str(err)
    assert "store at h:1 stayed unreachable for 12 s (join_timeout=12)" in text
    assert "lease expired" in text and "granted no lease" in text


@pytest.mark.parametrize(
    "error", [AuthenticationError("bad token"), HostLost("host lost"), ValueError("bug")]
)
def test_what_is_no_matter_of_reachability_is_raised_at_once(error: Exception) -> None:
    async def scenario() -> tuple[BaseException, int]:
        clock = _clock()
        tries: list[int] = []

        async def attempt() -> None:
            tries.append(1)
            raise error

        try:
            await regain(attempt, window=60.0, clock=clock, lost="gone")
        except Exception as e:
            return e, len(tries)
        raise AssertionError("no error")

    got, tries = run_virtual(scenario())
    assert got is error and tries == 1


def test_a_window_bounded_by_something_else_names_it() -> None:
    async def scenario() -> str:
        async def attempt() -> None:
            raise StoreTimeout("")

        try:
            await regain(attempt, window=3.0, clock=_clock(), lost="x", limit="the exit barrier")
        except StoreUnavailable as e:
            return str(e)
        raise AssertionError("no error")

    text = run_virtual(scenario())
    assert "unreachable for 3 s (the exit barrier)" in text and "join_timeout" not in text
