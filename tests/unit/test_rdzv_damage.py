"""Store values that are not records (docs/rendezvous.md, *Values that are not
records*): a per-node key that holds none is left out with one line, bounded;
a damaged record the whole job agrees on is a verdict naming the key.

Pure: the rule and the log. Then in-process handlers on the in-memory store in
virtual time: junk under ``waiting/``, ``nodes/``, ``rounds/R/join/`` and a
round's shards while a round trains changes nothing (a restart still closes
as soon as every node rejoined, not at the last call), each key said once; junk
in ``round`` ends every member's call with the verdict.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from elastrun.errors import ProtocolError, RecordDamaged
from elastrun.events import ListSink
from elastrun.failure import FailureRecord
from elastrun.names import RunId
from elastrun.rendezvous import damage as D
from elastrun.rendezvous import keys as K
from elastrun.rendezvous import results as R
from elastrun.rendezvous.api import RendezvousHooks
from elastrun.rendezvous.dynamic import DynamicRendezvous
from elastrun.rendezvous.plan import decode_round
from elastrun.rendezvous.records import (
    JoinRecord,
    MemberRecord,
    NodeInfo,
    PresenceRecord,
    ResultRecord,
    WaitingRecord,
)
from elastrun.store.base import KeyValue
from elastrun.store.memory import MemoryStore
from tests.unit.test_rdzv_timers import clock, handler, run

KEYS = K.Keys(RunId("job"))
JUNK = b"\x00\xffx"  # three bytes, not JSON
NODE = NodeInfo("a", "ha", "10.0.0.1", 2)


def kv(key: str, value: bytes, rev: int = 5) -> KeyValue:
    return KeyValue(key, value, create_revision=rev, mod_revision=rev, version=1)


# -- the rule: which per-node keys hold a record ------------------------------------------
def test_a_per_node_key_holds_a_record_only_when_it_decodes_and_names_its_key() -> None:
    presence = PresenceRecord(NODE).encode()
    assert D.problem(KEYS.nodes, kv(KEYS.node("a"), presence), PresenceRecord) is None
    join = JoinRecord(NODE, port=29500).encode()
    assert D.problem(KEYS.joins(3), kv(KEYS.join(3, "a"), join), JoinRecord) is None
    waiting = WaitingRecord("a", "ha", 2).encode()
    assert D.problem(KEYS.waiting_prefix, kv(KEYS.waiting("a"), waiting), WaitingRecord) is None

    cases = {
        # junk bytes, another kind's record, another node's record, an empty value
        (KEYS.node("x"), JUNK): "is not valid JSON",
        (KEYS.node("a"), waiting): "addr is missing",
        (KEYS.node("b"), presence): "node_id 'a' is not its key's",
        (KEYS.node("a"), b""): "is not valid JSON",
        # a name that is no node id: a deeper key, escapes, a blank
        (KEYS.nodes + "x/a", presence): "'x/a' is not a node id",
        (KEYS.nodes + "\x1b[2J", presence): "is not a node id",
        (KEYS.nodes, presence): "'' is not a node id",
    }
    for (key, value), expected in cases.items():
        why = D.problem(KEYS.nodes, kv(key, value), PresenceRecord)
        assert why is not None and expected in why, (key, why)
        assert key in why  # it names the key


def test_each_key_left_out_is_said_once_per_revision_and_the_lines_are_bounded() -> None:
    sink, lines = ListSink(), list[str]()
    log = D.JunkLog(sink, "a")
    log.say = lines.append
    junk = kv(KEYS.waiting("junk"), JUNK, rev=7)
    good = kv(KEYS.waiting("b"), WaitingRecord("b", "hb", 1).encode())
    for _ in range(3):  # the same value, read again in each phase
        assert log.keep(KEYS.waiting_prefix, [junk, good], WaitingRecord) == [good]
    assert len(lines) == 1 and KEYS.waiting("junk") in lines[0] and "\n" not in lines[0]
    assert lines[0].startswith("elastrun: warning: a store key left out")
    assert [e["key"] for e in sink.events] == [KEYS.waiting("junk")]
    assert sink.events[0]["kind"] == "record_skipped" and sink.events[0]["revision"] == 7

    log.keep(KEYS.waiting_prefix, [kv(KEYS.waiting("junk"), JUNK, rev=8)], WaitingRecord)
    assert len(lines) == 2  # put again: a new revision, a new line

    # A stranger's flood: thousands of keys and revisions, MAX_LINES lines and one more.
    flood = [kv(KEYS.waiting(f"j{i}"), b"\x1b[31m", rev=100 + i) for i in range(5000)]
    assert log.keep(KEYS.waiting_prefix, flood, WaitingRecord) == []
    assert len(lines) == D.MAX_LINES + 1 == len(sink.events)
    assert "further ones are left out without a line" in lines[-1]
    assert not any("\x1b" in line for line in lines)  # escapes shown, never sent


def test_a_damaged_round_record_is_a_verdict_naming_the_key() -> None:
    with pytest.raises(RecordDamaged) as got:
        decode_round(KEYS.round, JUNK)
    message = str(got.value)
    assert f"store key {KEYS.round} is not valid JSON" in message
    assert message.startswith("the job's round record is damaged") and "\n" not in message
    with pytest.raises(RecordDamaged, match=f"store key {KEYS.round}: state is"):
        decode_round(KEYS.round, K.encode({"round": 1, "state": "\x1b[2J"}))
    with pytest.raises(RecordDamaged, match=f"store key {KEYS.config}"):
        D.decode_config(KEYS.config, JUNK)


def test_a_key_under_the_shards_prefix_that_is_no_shard_is_left_out() -> None:
    members = (MemberRecord("a", "ha", "x", 1, 0), MemberRecord("b", "hb", "y", 1, 1))
    result = ResultRecord(3, members, "x", 29500)
    header, parts = R.stored_form(result, 2)
    head = kv(KEYS.result(3), header.encode())
    shards = [kv(KEYS.shard(3, p.shard), p.encode()) for p in parts]
    extra = [kv(KEYS.shards(3) + "junk", JUNK), kv(KEYS.shard(3, 2), JUNK)]
    got, left_out = R.decode_result(head, [*shards, *extra])
    assert got == result and left_out == extra
    # Junk in one of its shards: the result is damaged.
    with pytest.raises(ProtocolError, match=f"store key {KEYS.shard(3, 1)}"):
        R.decode_whole(head, [shards[0], kv(KEYS.shard(3, 1), JUNK)])


# -- in-process handlers, in virtual time -------------------------------------------------
def member(store: MemoryStore, run_id: str, name: str, lines: list[str]) -> DynamicRendezvous:
    common = {"min_nodes": 2, "max_nodes": 3, "last_call_timeout": 30.0, "max_restarts": 3}
    h = handler(store, run_id, name, **common)
    h.attach(RendezvousHooks(notice=lines.append))
    return h


def test_junk_under_the_per_node_prefixes_is_left_out_and_junk_in_round_ends_the_job() -> None:
    async def scenario() -> dict[str, Any]:
        store, run_id = MemoryStore(clock=clock()), f"j-{uuid.uuid4().hex[:6]}"
        said: dict[str, list[str]] = {"a": [], "b": []}
        a, b = (member(store, run_id, n, said[n]) for n in ("a", "b"))
        first = await asyncio.gather(a.next_round(), b.next_round())  # at the last call
        r = first[0].round
        k = K.Keys(RunId(run_id))
        junk = [k.waiting("junk"), k.node("junk"), k.join(r, "junk"), k.join(r + 1, "junk")]
        junk.append(k.shards(r + 1) + "junk")  # the next round's result: beside its shards
        for key in junk:
            await store.put(key, JUNK)
        # Members train: each reads waiting/ (the watcher nodes/ too) and goes on.
        change = asyncio.create_task(b.wait_for_change())
        await clock().sleep_until(clock().monotonic() + 5.0)
        assert not change.done()
        await store.put(k.waiting("junk"), JUNK)  # put again while watched
        await a.request_restart(FailureRecord(host="h-a", rank=0, exitcode=1, time=1.0))
        got = await change
        t0 = clock().monotonic()
        second = await asyncio.gather(a.next_round(), b.next_round())
        took = clock().monotonic() - t0
        # Every shard read (by a node that did not close the round): the junk one left out.
        whole = [await h.full_result(res) for h, res in zip((a, b), second, strict=True)]
        # Junk in round: every member's call ends with the verdict.
        calls = [asyncio.create_task(h.wait_for_change()) for h in (a, b)]
        await clock().sleep_until(clock().monotonic() + 1.0)
        await store.put(k.round, JUNK)
        ended = await asyncio.gather(*calls, return_exceptions=True)
        for h in (a, b):
            await h.shutdown()
        return {
            "said": said,
            "junk": junk,
            "change": got,
            "took": took,
            "members": [sorted(m.node_id for m in w.members) for w in whole],
            "ended": ended,
            "round_key": k.round,
        }

    out = run(scenario)
    assert out["change"].reason == "restart_requested"
    # Every node that was there rejoined: closed at once, not at the 30 s last
    # call (the junk presence and waiting keys are no nodes).
    assert out["took"] < 30.0
    assert out["members"] == [["a", "b"], ["a", "b"]]
    said = out["said"]["a"] + out["said"]["b"]
    for key in out["junk"]:
        per_node = [sum(key in line for line in out["said"][n]) for n in ("a", "b")]
        assert max(per_node) <= 2, (key, said)  # its two revisions
    assert any(out["junk"][0] in line for line in out["said"]["b"])  # waiting/, by a member
    for key in (out["junk"][1], out["junk"][3], out["junk"][4]):  # nodes/, joins, shards
        assert any(key in line for line in said), (key, said)
    for err in out["ended"]:
        assert isinstance(err, RecordDamaged), err
        assert f"store key {out['round_key']} is not valid JSON" in str(err)


def test_a_stranger_s_done_key_does_not_pass_the_exit_barrier_early() -> None:
    """Two members; a key under the round's done prefix that is no member's
    (junk bytes): the first member through counts two done keys for two
    members, yet waits for the other, which trains on."""

    async def scenario() -> dict[str, Any]:
        store, run_id = MemoryStore(clock=clock()), f"j-{uuid.uuid4().hex[:6]}"
        said: list[str] = []
        a, b = (handler(store, run_id, n, min_nodes=2, max_nodes=2) for n in ("a", "b"))
        a.attach(RendezvousHooks(notice=said.append))
        first = await asyncio.gather(a.next_round(), b.next_round())
        junk = K.Keys(RunId(run_id)).done(first[0].round, "junk")
        await store.put(junk, JUNK)
        training = asyncio.create_task(b.wait_for_change())
        await clock().sleep_until(clock().monotonic() + 1.0)
        a_done = asyncio.create_task(a.complete())
        await clock().sleep_until(clock().monotonic() + 60.0)
        early = a_done.done() or training.done()
        training.cancel()
        await asyncio.gather(b.complete(), a_done)  # b finishes: the barrier passes
        for h in (a, b):
            await h.shutdown()
        return {"early": early, "said": said, "junk": junk}

    out = run(scenario)
    assert not out["early"], "the barrier passed before every member was done"
    assert [line for line in out["said"] if out["junk"] in line], out["said"]


def test_a_junk_join_is_nobody_s_predecessor() -> None:
    """a joins, a stranger's join key, then b (its two newest joins: its own
    and the junk one), then a dies: b takes the decision over (it followed a,
    not the junk key, which never goes) and the round closes with b and c."""
    ttl = 1.0

    async def scenario() -> list[str]:
        store, run_id = MemoryStore(clock=clock()), f"j-{uuid.uuid4().hex[:6]}"
        common = {"min_nodes": 2, "max_nodes": 3, "last_call_timeout": 30.0, "lease_ttl": ttl}
        a, b, c = (handler(store, run_id, n, join_timeout=600.0, **common) for n in "abc")
        joining = [asyncio.create_task(a.next_round())]
        await clock().sleep_until(clock().monotonic() + 1.0)
        await store.put(K.Keys(RunId(run_id)).join(0, "junk"), JUNK)
        joining.append(asyncio.create_task(b.next_round()))
        await clock().sleep_until(clock().monotonic() + 1.0)
        joining[0].cancel()
        await a.keeper.stop(revoke=False)  # killed: its join key goes with its lease
        got = await asyncio.gather(joining[1], c.next_round())
        members = sorted(m.node_id for m in (await b.full_result(got[0])).members)
        for h in (b, c):
            await h.shutdown()
        return members

    assert run(scenario) == ["b", "c"]
