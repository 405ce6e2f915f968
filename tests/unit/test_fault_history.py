"""The job's fault history and quarantine records in the store: typed,
bounded, read as untrusted (rendezvous/fault_history.py, quarantine.py,
fault_access.py), on a real in-memory store."""

from __future__ import annotations

import asyncio
import json

import pytest

from elastrun.failure import BROKEN_COLLECTIVE, ERROR, FailureRecord
from elastrun.names import RunId
from elastrun.rendezvous import fault_history as H
from elastrun.rendezvous import keys as K
from elastrun.rendezvous import quarantine as Q
from elastrun.rendezvous.fault_access import mark_failed
from elastrun.rendezvous.records import RoundRecord, RoundState
from elastrun.store.memory import MemoryStore
from elastrun.untrusted import UntrustedData

KEYS = K.Keys(RunId.parse("job", "--rdzv-id"))


def entry(r: int, host: str = "a", step: int | None = 3) -> H.FaultEntry:
    return H.FaultEntry(r, host, 1, ERROR, True, 1, None, "ValueError", "bad", step)


def test_an_entry_is_made_of_the_root_cause_and_the_step() -> None:
    rec = FailureRecord(
        host="a",
        rank=3,
        exitcode=1,
        role="root_cause",
        kind=ERROR,
        message="torch.OutOfMemoryError: CUDA out of memory. Tried",
    )
    e = H.entry_of(rec, 4, 17)
    assert (e.round, e.host, e.rank, e.own, e.step) == (4, "a", 3, True, 17)
    assert (e.exception, e.message) == ("torch.OutOfMemoryError", "CUDA out of memory. Tried")
    broke = FailureRecord(host="b", rank=0, role="root_cause", kind=BROKEN_COLLECTIVE)
    assert not H.entry_of(broke, 4, None).own
    assert H.split_exception("Traceback: x\ny") == ("Traceback", "x")
    assert H.split_exception("worker exited") == ("", "worker exited")
    assert H.split_exception("KeyboardInterrupt") == ("KeyboardInterrupt", "")


VERDICT = H.JudgedFault(3, "node_fault", "b", "node fault: node b failed 2 times", "stays")
HEALTH = H.HealthFailure("c", "before_round", 2, 1.7e9, "exited with code 7", "GPU 0 fell off")


def _v(round_: int) -> dict[str, object]:
    return dict(VERDICT.to_json(), round=round_)


def test_verdicts_and_health_failures_are_kept_within_their_bounds() -> None:
    hist = H.FaultHistory()
    for r in range(H.MAX_VERDICTS + 3):
        hist = hist.with_verdict(H.JudgedFault(r, "node_fault", "b", "first"))
        hist = hist.with_verdict(H.JudgedFault(r, "node_fault", "b", "later"))
    assert [v.round for v in hist.verdicts] == list(range(3, H.MAX_VERDICTS + 3))
    assert {v.summary for v in hist.verdicts} == {"first"}  # the first of a round stays
    for i in range(H.MAX_HEALTH + 2):
        hist = hist.with_health(H.HealthFailure(f"c{i}", "training", None, 1.7e9, "x" * 300))
    assert hist.health[0].host == "c2" and len(hist.health) == H.MAX_HEALTH
    full = H.FaultHistory(
        entries=tuple(entry(r, step=r) for r in range(H.MAX_ENTRIES)),
        stopped="s" * H.MAX_SUMMARY,
        verdicts=tuple(
            H.JudgedFault(r, "script_fault", "h" * 256, "x" * 1000, "y" * 1000)
            for r in range(H.MAX_VERDICTS)
        ),
        health=tuple(
            H.HealthFailure("h" * 256, "training", 9, 1.7e9, "r" * 300, "o" * 500)
            for _ in range(H.MAX_HEALTH)
        ),
    )
    assert H.FaultHistory.decode(full.encode()) == full
    assert len(full.encode()) < H.MAX_BYTES  # every list at its bound fits


def test_the_history_keeps_one_entry_per_round_and_the_newest_within_its_bound() -> None:
    hist = H.FaultHistory()
    for r in range(H.MAX_ENTRIES + 5):
        hist = hist.added(entry(r)).added(entry(r, host="other"))
    assert [e.round for e in hist.entries] == list(range(5, H.MAX_ENTRIES + 5))
    assert all(e.host == "a" for e in hist.entries)  # the first entry of a round stays
    assert H.FaultHistory.decode(hist.encode()) == hist
    assert len(hist.encode()) < H.MAX_BYTES


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"[]",
        json.dumps({"v": 2, "entries": []}).encode(),
        json.dumps({"v": 1, "entries": [{"round": 0}]}).encode(),
        json.dumps({"v": 1, "entries": [entry(1).to_json(), entry(0).to_json()]}).encode(),
        json.dumps({"v": 1, "entries": [entry(1).to_json()] * 2}).encode(),
        json.dumps({"v": 1, "entries": [entry(r).to_json() for r in range(40)]}).encode(),
        json.dumps({"v": 1, "entries": [dict(entry(0).to_json(), message="x" * 301)]}).encode(),
        json.dumps({"v": 1, "entries": [dict(entry(0).to_json(), own=1)]}).encode(),
        json.dumps({"v": 1, "entries": [], "stopped": "x" * 2000}).encode(),
        json.dumps({"v": 1, "verdicts": [VERDICT.to_json()] * 2}).encode(),  # one per round
        json.dumps({"v": 1, "verdicts": [_v(r) for r in range(H.MAX_VERDICTS + 1)]}).encode(),
        json.dumps({"v": 1, "verdicts": [dict(VERDICT.to_json(), summary="x" * 1001)]}).encode(),
        json.dumps({"v": 1, "health": [HEALTH.to_json()] * (H.MAX_HEALTH + 1)}).encode(),
        json.dumps({"v": 1, "health": [dict(HEALTH.to_json(), output="x" * 501)]}).encode(),
        json.dumps({"v": 1, "health": [dict(HEALTH.to_json(), at="now")]}).encode(),
        json.dumps({"v": 1, "health": [dict(HEALTH.to_json(), round=-1)]}).encode(),
        b"[" * 100 + b"]" * 100,
        b" " * (H.MAX_BYTES + 1),
    ],
)
def test_a_history_that_a_writer_of_this_version_would_not_write_is_refused(raw: bytes) -> None:
    with pytest.raises(UntrustedData):
        H.FaultHistory.decode(raw)


def test_record_adds_the_root_cause_once_and_replaces_a_damaged_history() -> None:
    async def run() -> None:
        store = MemoryStore()
        await store.put(KEYS.faults, b"\x00junk")  # a stranger's bytes: no history
        assert await H.read(store, KEYS) == H.FaultHistory()
        got = await H.record(store, KEYS, entry(0, step=5), own=True, timeout=1.0)
        assert got is not None and got.entries == (entry(0, step=5),)
        # Another member, later, with the same round: the first entry stays.
        again = await H.record(store, KEYS, entry(0, host="b"), own=True, timeout=1.0)
        assert again == got
        # A member whose failure is not the root cause waits for that node's entry.
        waiter = asyncio.create_task(
            H.record(store, KEYS, entry(1, host="b", step=None), own=False, timeout=30.0)
        )
        await asyncio.sleep(0)
        assert not waiter.done()
        await H.record(store, KEYS, entry(1, step=9), own=True, timeout=1.0)
        seen = await asyncio.wait_for(waiter, 30.0)
        assert seen is not None and seen.entries[-1] == entry(1, step=9)
        # No root-cause node came: the waiting member writes its own, at its timeout.
        alone = await H.record(store, KEYS, entry(2, host="b"), own=False, timeout=0.05)
        assert alone is not None and alone.entries[-1].host == "b"
        await H.stop(store, KEYS, "script fault: first")
        await H.stop(store, KEYS, "script fault: second")
        assert (await H.read(store, KEYS)).stopped == "script fault: first"

    asyncio.run(run())


def test_stopping_the_job_marks_it_failed_once() -> None:
    async def run() -> None:
        store = MemoryStore()
        assert not await mark_failed(store, KEYS, "x")  # no job
        await store.put(KEYS.round, RoundRecord(3, RoundState.OPEN).encode())
        assert await mark_failed(store, KEYS, "script fault: ValueError")
        kv = await store.get(KEYS.round)
        assert kv is not None
        rec = RoundRecord.decode(kv.key, kv.value)
        assert rec.state is RoundState.FAILED and rec.detail == "script fault: ValueError"
        assert not await mark_failed(store, KEYS, "again")

    asyncio.run(run())


def test_quarantine_records_are_bounded_checked_and_cleared() -> None:
    async def run() -> None:
        store = MemoryStore()
        rec = Q.QuarantineRecord("gpu-7", 1000.0, 1600.0, "node fault: ...", 4)
        assert await Q.put(store, KEYS, rec)
        assert await Q.find(store, KEYS, "gpu-7") == rec
        assert rec.active(1599.0) and not rec.active(1600.0)
        assert await Q.find(store, KEYS, "gpu-8") is None
        # A record under one host's key naming another host is none.
        await store.put(KEYS.quarantine(Q.host_key("gpu-8")), rec.encode())
        assert await Q.find(store, KEYS, "gpu-8") is None
        assert [r.host for r in await Q.listed(store, KEYS)] == ["gpu-7"]
        # Bounded: past MAX_RECORDS other hosts, no record is written.
        for i in range(Q.MAX_RECORDS):
            await store.put(KEYS.quarantine(f"h{i}"), b"{}")
        assert not await Q.put(store, KEYS, Q.QuarantineRecord("new", 0.0, 1.0))
        assert await Q.clear(store, KEYS, "gpu-7")
        assert not await Q.clear(store, KEYS, "gpu-7")
        assert await Q.find(store, KEYS, "gpu-7") is None

    asyncio.run(run())


@pytest.mark.parametrize(
    "obj",
    [
        {"v": 1, "host": "a", "since": 0, "until": 1e12, "reason": "", "round": 0},  # a century
        {"v": 1, "host": "a", "since": 10, "until": 5, "reason": "", "round": 0},
        {"v": 1, "host": "a" * 300, "since": 0, "until": 1, "reason": "", "round": 0},
        {"v": 2, "host": "a", "since": 0, "until": 1, "reason": "", "round": 0},
        {"v": 1, "host": "a", "since": 0, "until": 1, "reason": "", "round": True},
    ],
)
def test_a_quarantine_record_out_of_bounds_is_refused(obj: dict[str, object]) -> None:
    with pytest.raises(UntrustedData):
        Q.QuarantineRecord.decode(json.dumps(obj).encode())
