"""Other nodes write ``round`` without moving it on: a root-cause report adds
its failure to the round it opened, a fault mark its summary. A node's join,
close, open or finish compares ``round`` at the revision it last saw; when
such a write lands in between, the compare fails and the node must try again
on the record as it now is. Lost, the join leaves a node in the round that
thinks it joined (the round waits for it until the join timeout), and a lost
close leaves every joiner waiting. Driven in virtual time on one in-memory
store (a real store: the write in between is another node's real write)."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Callable, Sequence

from elastrun.clock import Clock, VirtualTimeLoop, run_virtual
from elastrun.failure import FailureRecord
from elastrun.names import RunId
from elastrun.rendezvous import keys as K
from elastrun.rendezvous.api import RendezvousSettings, RoundResult
from elastrun.rendezvous.dynamic import DynamicRendezvous
from elastrun.rendezvous.records import RoundRecord
from elastrun.store.base import Compare, Op, Put, TxnResult
from elastrun.store.memory import MemoryStore


def clock() -> Clock:
    loop = asyncio.get_running_loop()
    assert isinstance(loop, VirtualTimeLoop)
    return loop.clock


class WriteBetween(MemoryStore):
    """A store on which another node's write to ``round`` (its ``detail``
    changed, as a root-cause report does) lands just before the first write
    that ``matches``: the writer's compare then sees a newer revision."""

    def __init__(self, run_id: str, matches: Callable[[Sequence[Op]], bool]) -> None:
        super().__init__(clock=clock())
        self.keys = K.Keys(RunId(run_id))
        self.matches = matches
        self.armed = True
        self.rewrites = 0

    async def txn(
        self, compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> TxnResult:
        if self.armed and self.matches(success):
            self.armed = False
            kv = await self.get(self.keys.round)
            assert kv is not None
            rec = RoundRecord.decode(kv.key, kv.value)
            new = dataclasses.replace(rec, detail="a report of another node")
            assert await self.compare_and_set(self.keys.round, kv.mod_revision, new.encode())
            self.rewrites += 1
        return await super().txn(compares, success, failure)


def puts(key: str) -> Callable[[Sequence[Op]], bool]:
    return lambda ops: any(isinstance(op, Put) and op.key == key for op in ops)


def handler(store: MemoryStore, run_id: str, name: str) -> DynamicRendezvous:
    settings = RendezvousSettings(
        run_id=RunId(run_id),
        host=f"h-{name}",
        addr="127.0.0.1",
        min_nodes=2,
        max_nodes=2,
        join_timeout=600.0,
        max_restarts=3,
    )
    return DynamicRendezvous(store, settings, node_id=name, clock=clock())


def form(matches: Callable[[K.Keys], Callable[[Sequence[Op]], bool]]) -> tuple[float, list[str]]:
    """Two nodes form round 0 while another write lands before the write
    that ``matches``: how long it took (virtual seconds) and who is in it."""

    async def scenario() -> tuple[float, list[str], int]:
        run_id = f"j-{uuid.uuid4().hex[:6]}"
        store = WriteBetween(run_id, lambda ops: False)
        store.matches = matches(store.keys)
        a, b = handler(store, run_id, "a"), handler(store, run_id, "b")
        t0 = clock().monotonic()
        results = await asyncio.wait_for(asyncio.gather(a.next_round(), b.next_round()), 60.0)
        took = clock().monotonic() - t0
        whole = await a.full_result(results[0])
        for h in (a, b):
            await h.shutdown()
        return took, sorted(m.node_id for m in whole.members), store.rewrites

    took, members, rewrites = run_virtual(scenario())
    assert rewrites == 1  # the write in between happened
    return took, members


def test_a_join_whose_compare_another_write_failed_is_tried_again() -> None:
    # Lost, node a would sit in round 0 without its join key: b alone, below
    # min, until the 600 s join timeout (here: past the 60 s bound).
    took, members = form(lambda k: puts(k.join(0, "a")))
    assert members == ["a", "b"]
    assert took < 60.0


def test_a_close_whose_compare_another_write_failed_is_tried_again() -> None:
    # Lost, the decider would stay deciding with everyone joined, and no
    # timer left to close the round.
    took, members = form(lambda k: puts(k.result(0)))
    assert members == ["a", "b"]
    assert took < 60.0


def test_a_restart_whose_open_another_write_failed_is_tried_again() -> None:
    """Round 0 closed; a member's workers fail and it opens round 1, while
    another write to the closed round lands first: round 1 opens anyway, and
    both members form it with the restart charged."""

    async def scenario() -> tuple[str, int, list[RoundResult]]:
        run_id = f"j-{uuid.uuid4().hex[:6]}"
        store = WriteBetween(run_id, lambda ops: False)
        store.armed = False
        a, b = handler(store, run_id, "a"), handler(store, run_id, "b")
        await asyncio.gather(a.next_round(), b.next_round())
        change = asyncio.create_task(b.wait_for_change())
        round_key = store.keys.round

        def opens_round_1(ops: Sequence[Op]) -> bool:
            for op in ops:
                if isinstance(op, Put) and op.key == round_key:
                    return RoundRecord.decode(op.key, op.value).round == 1
            return False

        store.matches, store.armed = opens_round_1, True
        await a.request_restart(FailureRecord(host="h-a", rank=0, exitcode=1, time=1.0))
        got = await asyncio.wait_for(change, 60.0)
        second = await asyncio.wait_for(asyncio.gather(a.next_round(), b.next_round()), 60.0)
        for h in (a, b):
            await h.shutdown()
        return got.reason, store.rewrites, list(second)

    reason, rewrites, second = run_virtual(scenario())
    assert rewrites == 1
    assert reason == "restart_requested"
    assert [r.round for r in second] == [1, 1]
    assert [r.restart_count for r in second] == [1, 1]
