"""A persistent straggler replaced by a waiting spare (agent/straggler_replacement.py):
the pure decision as tables, and the one decision over a real in-memory store
(the round, the spare's waiting key and the quarantine record compared and set
in one transaction)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from elastrun.agent.hooks import Departure
from elastrun.agent.spec import StragglerSettings
from elastrun.agent.straggler_replacement import (
    Outcome,
    Replacement,
    Streaks,
    fresh,
    judge_interval,
    judge_store,
)
from elastrun.event_kinds import StragglerReplacement
from elastrun.events import ListSink
from elastrun.failure import FailureRecord
from elastrun.names import RunId
from elastrun.rendezvous import keys as K
from elastrun.rendezvous import notes as N
from elastrun.rendezvous import quarantine as Q
from elastrun.rendezvous.api import (
    Change,
    Member,
    Rendezvous,
    RendezvousHooks,
    RendezvousSettings,
    RoundResult,
)
from elastrun.rendezvous.fault_access import FaultAccess
from elastrun.rendezvous.records import RoundRecord, RoundState, WaitingRecord
from elastrun.rendezvous.sizes import WorldSizes
from elastrun.store.memory import MemoryStore

RUN = RunId.parse("job", "--rdzv-id")
KEYS = K.Keys(RUN)
SPARES = WorldSizes(2, 3, 2)  # --nnodes=2:3 --node-unit=2: 2 train, 1 spare


# ------------------------------------------------------------------ step 1
@pytest.mark.parametrize(
    ("streak", "after", "named", "is_fresh", "decided", "expected"),
    [
        (1, 2, 1, True, False, Outcome.WAIT),  # fewer than K intervals in a row
        (2, 2, 1, True, False, Outcome.LOOK),  # K intervals: read the store
        (5, 2, 1, True, False, Outcome.LOOK),
        (5, 0, 1, True, False, Outcome.WAIT),  # --replace-stragglers off
        (2, 2, 1, True, True, Outcome.DONE),  # already replaced in this round
        (2, 2, 2, True, False, Outcome.SEVERAL),  # two nodes named: no single culprit
        (2, 2, 1, False, False, Outcome.STALE),  # a peer's progress missing or stale
        (1, 2, 2, False, True, Outcome.WAIT),  # below K nothing else counts
    ],
)
def test_an_interval_allows_a_decision_only_for_one_node_named_k_times_in_a_row(
    streak: int, after: int, named: int, is_fresh: bool, decided: bool, expected: Outcome
) -> None:
    assert judge_interval(streak, after, named, is_fresh, decided) is expected


# ------------------------------------------------------------------ step 2
def state(
    *,
    current: bool = True,
    spares: int = 1,
    held: bool = False,
    full: bool = False,
) -> Q.ClaimState:
    rec = Q.QuarantineRecord("b", 0.0, 2.0**39) if held else None
    return Q.ClaimState(
        round=3,
        round_rev=7 if current else 0,
        spares=tuple((f"w{i}", 10 + i) for i in range(spares)),
        held=rec,
        record_rev=0,
        full=full,
    )


@pytest.mark.parametrize(
    ("claim", "members", "sizes", "expected"),
    [
        (state(), 2, SPARES, Outcome.REPLACE),
        (state(spares=0), 2, SPARES, Outcome.NO_SPARE),  # never more removed than spares
        (state(current=False), 2, SPARES, Outcome.ROUND),  # a failure or change since
        (None, 2, SPARES, Outcome.ROUND),  # the store did not answer
        (state(held=True), 2, SPARES, Outcome.HELD),  # already replaced (kept out)
        (state(full=True), 2, SPARES, Outcome.FULL),
        (state(spares=2), 4, WorldSizes(4, 8, 4), Outcome.REPLACE),
        # The world could not keep its size (never below --nnodes' MIN): a
        # round larger than the policy allows, as another node's settings.
        (state(), 3, WorldSizes(2, 2), Outcome.SIZE),
    ],
)
def test_the_store_allows_a_replacement_only_with_a_waiting_spare_in_the_same_round(
    claim: Q.ClaimState | None, members: int, sizes: WorldSizes, expected: Outcome
) -> None:
    assert judge_store(claim, members, sizes) is expected


def test_streaks_count_intervals_in_a_row_and_restart_when_a_node_is_not_named() -> None:
    s = Streaks()
    s.observe({"b"})
    s.observe({"b", "c"})
    assert s.longest() == ("b", 2)
    s.observe({"c"})
    assert s.longest() == ("c", 2)
    s.observe(set())
    assert s.longest() is None
    s.observe({"b"})
    assert s.longest() == ("b", 1)


def ranks(*ids: int, idle: float = 0.1, own: float | None = 0.2) -> tuple[N.RankProgress, ...]:
    return tuple(N.RankProgress(r, step=5, step_time=0.2, own_time=own, idle_s=idle) for r in ids)


def note(g: int, host: str, rs: tuple[N.RankProgress, ...], round_: int = 3) -> N.ProgressNote:
    return N.ProgressNote(round_, g, f"{host}-1-abc", host, time.time(), rs)


def test_progress_is_fresh_only_when_every_member_reported_recently() -> None:
    ok = [note(0, "a", ranks(0)), note(1, "b", ranks(1))]
    assert fresh(ok, 2, 0.5)
    assert not fresh(ok[:1], 2, 0.5)  # a member sent no note (hung, or gone)
    assert not fresh([ok[0], note(1, "b", ranks(1, idle=60.0))], 2, 0.5)  # stale
    assert not fresh([ok[0], note(1, "b", ranks(1, own=None))], 2, 0.5)
    assert not fresh([ok[0], note(1, "b", ())], 2, 0.5)


# ------------------------------------------------------------- the store
class StoreRendezvous(FaultAccess, Rendezvous):
    """Fault attribution's store calls (the real ones) over an in-memory
    store; the rest of a rendezvous is not used here."""

    def __init__(self, store: MemoryStore) -> None:
        self.store = store
        self.keys = KEYS
        self.settings = RendezvousSettings(RUN, 2, 3, node_unit=2)

    def attach(self, hooks: RendezvousHooks) -> None:
        del hooks

    async def next_round(self) -> RoundResult:
        raise NotImplementedError

    async def wait_for_change(self) -> Change:
        raise NotImplementedError

    async def request_restart(self, failure: FailureRecord) -> None:
        raise NotImplementedError

    async def complete(self) -> None:
        raise NotImplementedError

    async def shutdown(self) -> None:
        pass


def result(round_: int = 3) -> RoundResult:
    members = (
        Member("a-1-abc", "a", "127.0.0.1", 0, 1),
        Member("b-1-abc", "b", "127.0.0.1", 1, 1),
    )
    return RoundResult("job", round_, members, 0, "127.0.0.1", 29500, 0, 3)


async def job_with_spare(store: MemoryStore, *, spare: bool = True) -> None:
    await store.put(KEYS.round, RoundRecord(3, RoundState.CLOSED).encode())
    if spare:
        await store.put(KEYS.waiting("s-1-abc"), WaitingRecord("s-1-abc", "s", 3).encode())


def replacement(rdzv: Rendezvous, host: str, after: int = 2) -> tuple[Replacement, ListSink]:
    sink = ListSink()
    settings = StragglerSettings(interval=0.5, replace_after=after, hold=600.0)
    return Replacement(rdzv, settings, SPARES, sink, Departure(), host), sink


def interval() -> tuple[N.StragglersNote, list[N.ProgressNote]]:
    notes = [note(0, "a", ranks(0)), note(1, "b", ranks(1, own=0.6))]
    verdict = N.StragglersNote(3, time.time(), 0.4, (N.Straggler(1, 0.6),))
    return verdict, notes


def decisions(sink: ListSink) -> list[dict[str, Any]]:
    return [e for e in sink.events if e["kind"] == StragglerReplacement.KIND]


def test_group_rank_0_replaces_the_straggler_once_after_k_intervals_and_it_leaves() -> None:
    async def main() -> None:
        store = MemoryStore()
        await job_with_spare(store)
        rdzv = StoreRendezvous(store)
        judge, sink = replacement(rdzv, "a")
        verdict, notes = interval()
        assert await judge.consider(result(), verdict, notes) is Outcome.WAIT
        assert await judge.consider(result(), verdict, notes) is Outcome.REPLACE
        assert await judge.consider(result(), verdict, notes) is Outcome.DONE  # one per round
        (made,) = decisions(sink)
        assert (made["node"], made["replaced"], made["intervals"], made["ranks"]) == (
            "b",
            True,
            2,
            [1],
        )
        rec = await Q.find(store, KEYS, "b")
        assert rec is not None and rec.active(time.time()) and rec.round == 3
        assert rec.reason.startswith("straggler: rank 1's own step time 0.6 s")
        assert rec.until - rec.since == pytest.approx(600.0)
        # Another group rank 0 judging the same episode (a second agent, a
        # stale one) decides nothing: the record is held.
        other, other_sink = replacement(rdzv, "a")
        await other.consider(result(), verdict, notes)
        assert await other.consider(result(), verdict, notes) is Outcome.HELD
        assert [d["replaced"] for d in decisions(other_sink)] == [False]
        # The straggler's own agent finds its record and asks to leave.
        straggler, _ = replacement(rdzv, "b")
        assert await straggler.look()
        leave = await asyncio.wait_for(straggler.departure.wait(), 5)
        assert leave.reason == "straggler_replaced"
        assert "this node (b) leaves the job, kept out until" in leave.line
        # The survivor is not asked to leave.
        survivor, _ = replacement(rdzv, "a")
        assert not await survivor.look()

    asyncio.run(main())


def test_without_a_spare_the_straggler_is_only_reported_once() -> None:
    async def main() -> None:
        store = MemoryStore()
        await job_with_spare(store, spare=False)
        judge, sink = replacement(StoreRendezvous(store), "a")
        verdict, notes = interval()
        for _ in range(4):
            await judge.consider(result(), verdict, notes)
        (reported,) = decisions(sink)
        assert (reported["replaced"], reported["why"]) == (False, Outcome.NO_SPARE.value)
        assert await Q.find(store, KEYS, "b") is None
        # A spare arrives while the streak goes on: replaced then.
        await store.put(KEYS.waiting("s-1-abc"), WaitingRecord("s-1-abc", "s", 3).encode())
        assert await judge.consider(result(), verdict, notes) is Outcome.REPLACE

    asyncio.run(main())


def test_the_claim_holds_only_while_the_round_and_the_spare_are_as_read() -> None:
    async def main() -> None:
        store = MemoryStore()
        await job_with_spare(store)
        now = time.time()
        rec = Q.QuarantineRecord("b", now, now + 60, "straggler: test", 3)
        read = await Q.claim_state(store, KEYS, "b", 3, now)
        assert read.current and len(read.spares) == 1 and read.held is None
        # The round restarted (a failure) after the read: no decision.
        await store.put(KEYS.round, RoundRecord(4, RoundState.OPEN).encode())
        assert not await Q.claim(store, KEYS, read, rec)
        await job_with_spare(store)
        read = await Q.claim_state(store, KEYS, "b", 3, now)
        await store.delete(KEYS.waiting("s-1-abc"))  # the spare left after the read
        assert not await Q.claim(store, KEYS, read, rec)
        await job_with_spare(store)
        read = await Q.claim_state(store, KEYS, "b", 3, now)
        assert await Q.claim(store, KEYS, read, rec)
        assert not await Q.claim(store, KEYS, read, rec)  # exactly one decision
        # A node on the straggler's own host is no spare for it.
        assert (await Q.claim_state(store, KEYS, "s", 3, now)).spares == ()
        # Round 2's judgment is not round 3's.
        assert not (await Q.claim_state(store, KEYS, "c", 2, now)).current

    asyncio.run(main())


def test_the_record_names_the_member_s_host_from_the_round_not_from_its_note() -> None:
    async def main() -> None:
        store = MemoryStore()
        await job_with_spare(store)
        judge, sink = replacement(StoreRendezvous(store), "a")
        verdict, notes = interval()
        # The straggler's note says another host (a note is anyone's to write).
        notes[1] = N.ProgressNote(3, 1, "b-1-abc", "victim", time.time(), notes[1].ranks)
        for _ in range(2):
            await judge.consider(result(), verdict, notes)
        assert await Q.find(store, KEYS, "victim") is None
        rec = await Q.find(store, KEYS, "b")
        assert rec is not None and rec.active(time.time())
        assert [d["node"] for d in decisions(sink)] == ["b"]

    asyncio.run(main())
