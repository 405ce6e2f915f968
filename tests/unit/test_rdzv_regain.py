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
from elastrun.names import RunId
from elastrun.rendezvous.api import RendezvousSettings
from elastrun.rendezvous.dynamic import DynamicRendezvous
from elastrun.rendezvous.register import RETRY_EVERY, regain
from elastrun.store.memory import MemoryStore


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


class SlowGrants(MemoryStore):
    """A real store whose first ``slow`` lease grants answer after 3 s (its
    host loaded): past a 2 s lease_ttl."""

    def __init__(self, slow: int) -> None:
        super().__init__(clock=_clock())
        self.slow = slow
        self.grants = 0

    async def lease_grant(self, ttl: float) -> int:
        self.grants += 1
        if self.grants <= self.slow:
            await asyncio.sleep(3.0)  # virtual seconds
        return await super().lease_grant(ttl)


def _node(store: MemoryStore, join_timeout: float) -> DynamicRendezvous:
    settings = RendezvousSettings(
        run_id=RunId("slow-grants"),
        host="h-a",
        addr="127.0.0.1",
        min_nodes=1,
        max_nodes=1,
        lease_ttl=2.0,
        join_timeout=join_timeout,
    )
    return DynamicRendezvous(store, settings, node_id="a", clock=_clock())


def test_a_first_lease_granted_late_is_asked_for_again_until_one_comes() -> None:
    async def scenario() -> tuple[int, int]:
        store = SlowGrants(slow=3)
        node = _node(store, join_timeout=60.0)
        result = await node.next_round()
        await node.shutdown()
        return result.world_size, store.grants

    world, grants = run_virtual(scenario())
    assert world == 1
    assert grants == 4  # three late answers, then one in time


def test_a_store_that_never_grants_in_time_fails_at_the_join_timeout_saying_so() -> None:
    async def scenario() -> tuple[BaseException, float]:
        clock = _clock()
        start = clock.monotonic()
        node = _node(SlowGrants(slow=1000), join_timeout=20.0)
        with pytest.raises(StoreTimeout) as info:
            await node.next_round()
        return info.value, clock.monotonic() - start

    err, took = run_virtual(scenario())
    assert 20.0 <= took <= 20.0 + 2.0 + RETRY_EVERY  # the last try's own lease_ttl
    assert "granted no lease within 2 s (lease_ttl)" in str(err)
    assert "asked again for join_timeout=20s" in str(err)
