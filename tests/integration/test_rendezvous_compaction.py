"""The rendezvous re-reads when a watch loses history it needs.

A store compacts its history (the embedded store when its history bound is
reached, etcd when told to), and a watch that asks for, or falls behind, the
compacted revision ends with RevisionCompacted. The rendezvous must not fail
on that: it reads the phase's keys again and watches from after that read.

The store here is the real in-memory store with faults injected around its
watches: before every fourth watch is opened, unrelated writes and a real
compaction of the engine make that watch's start revision compacted (the
engine refuses it); and every fifth watch that is opened ends, after its
first event, with RevisionCompacted (the engine is compacted then too), as a
watch that fell behind does.
"""

from __future__ import annotations

import asyncio
import itertools

from elastrun.errors import RevisionCompacted
from elastrun.events import ListSink
from elastrun.failure import FailureRecord
from elastrun.names import RunId
from elastrun.rendezvous.api import RendezvousSettings
from elastrun.rendezvous.dynamic import DynamicRendezvous
from elastrun.store.base import Watch, WatchEvent
from elastrun.store.engine import Engine
from elastrun.store.memory import MemoryStore


class FallsBehind(Watch):
    """A real watch that ends as compacted after its first event."""

    def __init__(self, inner: Watch, engine: Engine) -> None:
        self.inner, self.engine, self.delivered = inner, engine, 0

    async def __anext__(self) -> WatchEvent:
        if self.delivered == 1:
            self.engine.put("/noise/behind", b"")
            self.engine.put("/noise/behind", b"")
            self.engine.compact(self.engine.revision)
            await self.inner.close()
            raise RevisionCompacted(
                "the watch fell behind the compacted history", self.engine.compact_revision
            )
        event = await self.inner.__anext__()
        self.delivered += 1
        return event

    async def close(self) -> None:
        await self.inner.close()


class CompactingStore(MemoryStore):
    def __init__(self, engine: Engine, counter: itertools.count[int]) -> None:
        super().__init__(engine=engine)
        self.counter = counter

    async def watch(
        self, key: str, *, prefix: bool = False, start_revision: int | None = None
    ) -> Watch:
        n = next(self.counter)
        if n % 4 == 0 and start_revision is not None:
            self.engine.put("/noise/open", b"")
            self.engine.put("/noise/open", b"")
            self.engine.compact(self.engine.revision)  # start_revision is now compacted
        inner = await super().watch(key, prefix=prefix, start_revision=start_revision)
        return FallsBehind(inner, self.engine) if n % 5 == 1 else inner


def test_rounds_form_although_watches_are_compacted_again_and_again() -> None:
    n = 4

    async def body() -> None:
        engine = Engine()
        counter = itertools.count()
        sinks = [ListSink() for _ in range(n)]
        stores = [CompactingStore(engine, counter) for _ in range(n)]
        handlers = [
            DynamicRendezvous(
                stores[i],
                RendezvousSettings(
                    run_id=RunId("compacted"),
                    min_nodes=n,
                    max_nodes=n,
                    max_restarts=3,
                    lease_ttl=30.0,
                    join_timeout=60.0,
                    last_call_timeout=0.5,
                    host=f"h{i}",
                    addr="127.0.0.1",
                ),
                node_id=f"n{i}",
                events=sinks[i],
            )
            for i in range(n)
        ]
        for round_ in range(2):
            results = await asyncio.wait_for(
                asyncio.gather(*(h.next_round() for h in handlers)), 60
            )
            assert {r.round for r in results} == {results[0].round}
            assert sorted(r.group_rank for r in results) == list(range(n))
            assert all(r.world_size == n for r in results)
            if round_ == 0:  # a restart: every handler sees the round end
                await handlers[0].request_restart(FailureRecord(reason="test"))
                changes = await asyncio.wait_for(
                    asyncio.gather(*(h.wait_for_change() for h in handlers[1:])), 30
                )
                assert all(c.counts_as_restart for c in changes)
        rereads = [e for s in sinks for e in s.events if e["kind"] == "watch_reread"]
        print(f"{len(rereads)} phases re-read after a compacted watch")
        assert len(rereads) >= 4, "too few watches were compacted to test anything"
        assert any("fell behind" in e["reason"] for e in rereads)
        assert any("is compacted" in e["reason"] for e in rereads)
        for h in handlers:
            await h.shutdown()
        for s in stores:
            await s.close()

    asyncio.run(body())
