"""Job notes as an attacker writes them: the schemas, the membership checks,
the byte budget of a hang's stacks, the straggler verdicts, and what reaches a
terminal or a page (status table, failure summary, stacks, timeline).

Pure parts, and the typed reads on the in-memory store; the same inputs
through real agents, a real TCP store and the ``elastrun status`` command are
in tests/integration/test_hostile_notes.py.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Mapping
from typing import Any

import pytest

from elastrun.agent.error_files import ErrorFileInfo
from elastrun.agent.failures import WorkerFailure, classify, format_summary
from elastrun.agent.hangs import Gathered, note_of, summary
from elastrun.agent.stacks import RankStacks
from elastrun.agent.stragglers import Aggregator, StragglerRule
from elastrun.failure import FailureRecord
from elastrun.names import RunId
from elastrun.rendezvous import notes as N
from elastrun.rendezvous import rounds as R
from elastrun.rendezvous.api import Member, RoundResult
from elastrun.rendezvous.keys import Keys
from elastrun.rendezvous.records import (
    JoinRecord,
    MemberRecord,
    NodeInfo,
    ResultRecord,
    RoundRecord,
    WaitingRecord,
)
from elastrun.status.cli import render_table
from elastrun.status.summary import ShownNotes, hang_stacks, rank_progress, read_notes, summarize
from elastrun.status.timeline import render_html
from elastrun.store.memory import MemoryStore
from tests.unit.test_rdzv_hooks import _handler

ESCAPES = "\x1b]0;owned\x07\x1b[2J\x1b[31mALERT\u202e"
RAW_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e]")


def progress(g: int, node: str, round_: int = 4, ranks: tuple[int, ...] = (0,), **kw: Any):
    raw = {
        "round": round_,
        "group_rank": g,
        "node_id": node,
        "host": f"h{g}",
        "at": 1.0,
        "ranks": [{"rank": r, "step": 10, "step_time": 0.1, "own_time": 0.05} for r in ranks],
    }
    raw.update(kw)
    return raw


def stacks(round_: int, g: int, node: str, numbers: tuple[int, ...], **kw: Any) -> dict[str, Any]:
    raw = {
        "round": round_,
        "group_rank": g,
        "node_id": node,
        "ranks": [
            {"rank": r, "host": f"h{g}", "frames": ["f (x.py:1)"], "in_torch": r != 1}
            for r in numbers
        ],
    }
    raw.update(kw)
    return raw


def result(round_: int, *members: tuple[str, int, int]) -> ResultRecord:
    rows = tuple(MemberRecord(n, f"h{g}", "127.0.0.1", p, g) for n, g, p in members)
    return ResultRecord(round_, rows, "127.0.0.1", 29500)


def _bytes(value: object) -> bytes:
    return value if isinstance(value, bytes) else N.encode(value)  # type: ignore[arg-type]


def shown_notes(
    notes: Mapping[str, object], shown: ResultRecord | None, hang: ResultRecord | None = None
) -> ShownNotes:
    """What ``elastrun status`` reads of ``notes`` (JSON objects, or bytes as
    they are) in an in-memory store, for the round ``shown`` and the hang's round."""

    async def run() -> ShownNotes:
        store, keys = MemoryStore(), Keys(RunId("job"))
        for name, value in notes.items():
            await store.put(keys.note(name), _bytes(value))
        return await read_notes(store, keys, shown, hang)

    return asyncio.run(run())


# -- decoding and the schemas ------------------------------------------------------


def test_a_note_decodes_only_within_the_bounds() -> None:
    for raw in (
        b"[" * 100000,
        b"{" * 10 + b"}" * 10,
        b"x" * (N.NOTE_MAX_BYTES + 1),
        b"not json",
        b"[1, 2]",
        b'{"v": 2}',
        b'{"round": 1}',
    ):
        assert N.parse(N.StacksNote, raw, 0, N.seats([("a", 1, 1)])[1]) is None
    note = N.ProgressNote.from_json(progress(0, "a"))
    seat = N.seats([("a", 0, 1)])[0]
    assert N.parse(N.ProgressNote, N.encode(note.to_json()), 4, seat) == note


@pytest.mark.parametrize(
    "change",
    [
        {"round": "4"},
        {"round": True},
        {"round": -1},
        {"node_id": "a/../b"},
        {"node_id": "x" * 200},
        {"host": "h" * 301},
        {"at": float("nan")},
        {"at": 1e300},
        {"ranks": [{"rank": 0}] * (N.MAX_RANKS + 1)},
        {"ranks": [{"rank": 0}, {"rank": 0}]},
        {"ranks": [{"rank": 0, "step_time": -1.0}]},
        {"ranks": [{"rank": 0, "phase": "p" * 65}]},
        {"ranks": [{"rank": 0, "step": [1]}]},
        {"ranks": ["junk"]},
        {"ranks": {"rank": 0}},
    ],
)
def test_a_progress_note_of_the_wrong_shape_is_refused(change: dict[str, Any]) -> None:
    with pytest.raises(N.NoteInvalid):
        N.ProgressNote.from_json(progress(0, "a", **change))


@pytest.mark.parametrize(
    "change",
    [
        {"ranks": [{"rank": 0, "host": "h", "frames": ["f"] * 31, "in_torch": True}]},
        {"ranks": [{"rank": 0, "host": "h", "frames": ["f" * 301], "in_torch": True}]},
        {"ranks": [{"rank": 0, "host": "h", "frames": [["nested"]], "in_torch": True}]},
        {"ranks": [{"rank": 0, "host": "h", "frames": [], "in_torch": "yes"}]},
        {"ranks": [{"rank": 0, "host": 7, "frames": [], "in_torch": True}]},
    ],
)
def test_a_stacks_note_of_the_wrong_shape_is_refused(change: dict[str, Any]) -> None:
    with pytest.raises(N.NoteInvalid):
        N.StacksNote.from_json(stacks(0, 0, "a", (0,), **change))


def test_a_note_counts_only_from_the_round_s_member_with_its_ranks() -> None:
    seats = N.seats([("b", 1, 2), ("a", 0, 3)])
    assert [(s.first_rank, s.nproc) for s in seats.values()] == [(0, 3), (3, 2)]
    good = N.ProgressNote.from_json(progress(1, "b", ranks=(3, 4)))
    assert good.check(4, seats[1]) is good
    for note, round_ in (
        (good, 5),  # another round
        (N.ProgressNote.from_json(progress(1, "a", ranks=(3,))), 4),  # another node
        (N.ProgressNote.from_json(progress(0, "b", ranks=(3,))), 4),  # another group rank
        (N.ProgressNote.from_json(progress(1, "b", ranks=(0,))), 4),  # not its rank
    ):
        with pytest.raises(N.NoteInvalid):
            note.check(round_, seats[1])


# -- the stacks of a hang: bounded per node and in all ------------------------------


def _round(members: int, nproc: int, me: int = 0) -> RoundResult:
    ms = tuple(Member(f"n{g}", f"h{g}", "127.0.0.1", g, nproc) for g in range(members))
    return RoundResult("job", 3, ms, me, "127.0.0.1", 1, 0, 3)


def test_a_big_job_s_stacks_notes_fit_the_hang_s_budget() -> None:
    frames = tuple(f"function_{i} ({'/very/long/path' * 12}/module_{i}.py:{i})" for i in range(30))
    ranks = [RankStacks(r, "host", frames, in_torch=r != 3, hung=r == 3) for r in range(8)]
    result = _round(45, 8)  # the probe's job: one hang filled 2.7 MB
    note = note_of(ranks, result)
    size = len(json.dumps(note.to_json()))
    assert size <= N.stacks_budget(45) and 45 * N.stacks_budget(45) <= 1.1 * 1024 * 1024
    hung = next(r for r in note.ranks if r.hung)
    assert len(hung.frames) == 10 and all(len(r.frames) >= 1 for r in note.ranks)
    assert N.StacksNote.from_json(note.to_json()).check(3, N.seats([("n0", 0, 8)])[0])
    small = note_of(ranks, _round(2, 8))  # a small job keeps every frame
    assert all(len(r.frames) == 30 for r in small.ranks)


def test_the_declaring_node_escapes_the_other_node_s_stacks_and_names_the_missing() -> None:
    own = [RankStacks(0, "a", ("mine (m.py:1)",), in_torch=False, hung=True)]
    theirs = RankStacks(1, "b" + ESCAPES, ("f (x.py:1)\n  rank 9 on fake" + ESCAPES,), True)
    text = summary(
        Gathered([*own, theirs], ["  c (group rank 2): its stacks note was refused"]), None
    )
    assert not RAW_CONTROL.search(text) and "\\x1b]0;owned\\x07" in text
    assert [ln for ln in text.splitlines() if ln.startswith("  rank ")][1].startswith("  rank 1")
    assert "rank 9 on fake" in text and "\n  rank 9" not in text  # no forged line
    assert text.rstrip().endswith("its stacks note was refused")


# -- stragglers: one aggregator's verdicts, checked by status ------------------------


def test_the_aggregator_names_a_sustained_straggler_among_all_members() -> None:
    agg = Aggregator(StragglerRule(sustain=2))
    a = N.ProgressNote.from_json(progress(0, "a", ranks=(0, 1)))
    slow = progress(1, "b", ranks=(2,))
    slow["ranks"][0]["own_time"] = 0.09
    b = N.ProgressNote.from_json(slow)
    assert agg.judge(4, [a, b]).stragglers == ()
    verdict = agg.judge(4, [a, b])
    assert [(s.rank, s.own_time) for s in verdict.stragglers] == [(2, 0.09)]
    assert verdict.median == 0.05 and verdict.round == 4
    assert N.StragglersNote.from_json(verdict.to_json()) == verdict


def test_status_shows_only_members_notes_and_confirmed_stragglers() -> None:
    shown = result(4, ("a", 0, 2), ("b", 1, 1))
    slow = progress(1, "b", ranks=(2,))
    slow["ranks"][0]["own_time"] = 0.2
    notes: dict[str, dict[str, Any]] = {
        "progress_0": progress(0, "a", ranks=(0, 1)),
        "progress_1": slow,
        "progress_2": progress(2, "c", ranks=(5,)),  # not a member
        "stragglers": {"round": 4, "at": 1.0, "median": 0.05, "stragglers": []},
    }
    rows = rank_progress(shown_notes(notes, shown))
    assert [(r.rank, r.straggler) for r in rows] == [(0, False), (1, False), (2, False)]
    flagged = [{"rank": 0, "own_time": 0.05}, {"rank": 2, "own_time": 0.2}]
    notes["stragglers"] = {"round": 4, "at": 1.0, "median": 0.05, "stragglers": flagged}
    rows = rank_progress(shown_notes(notes, shown))
    # rank 0 is named, but its own note says it is not slow: not flagged
    assert [(r.rank, r.straggler) for r in rows] == [(0, False), (1, False), (2, True)]
    notes["stragglers"] = {**notes["stragglers"], "round": 3}  # another round's verdict
    assert not any(r.straggler for r in rank_progress(shown_notes(notes, shown)))
    notes["progress_1"] = progress(1, "b", round_=3, ranks=(2,))  # an older round's note
    assert [r.rank for r in rank_progress(shown_notes(notes, shown))] == [0, 1]
    assert shown_notes(notes, None) == ShownNotes()  # no round shown: no note read


def test_status_shows_stacks_only_of_the_round_that_ended_on_a_hang() -> None:
    notes = {
        "stacks_2_0": stacks(2, 0, "a", (0, 1)),
        "stacks_2_1": stacks(2, 1, "b", (2,)),
        "stacks_2_2": stacks(2, 2, "c", (3,)),  # not a member of round 2
        "stacks_5_0": stacks(5, 0, "a", (0, 1)),  # a round that never hung
    }
    shown = result(4, ("a", 0, 2))
    assert hang_stacks(shown_notes(notes, shown)) is None  # no round ended on a hang
    got = hang_stacks(shown_notes(notes, shown, result(2, ("a", 0, 2), ("b", 1, 1))))
    assert got is not None and got.round == 2
    assert [r.rank for r in got.ranks] == [1, 0, 2]  # stuck in its own code first


def test_a_round_opened_by_a_hang_is_the_job_s_hang_round() -> None:
    rnd, res = R.close_records(R.first_round(0.0), [_joiner("a")], 2, "t", 0.0)
    hang = FailureRecord(rank=0, hang="rank 0 made no progress for 5s")
    opened = R.next_round_record(rnd, res, "r", "", counts=True, failure=hang, opened_at=0.0)
    assert opened.hang_round == 0
    rnd, res = R.close_records(opened, [_joiner("a")], 2, "t", 0.0)
    assert rnd.hang_round == 0  # kept while the round runs
    crash = FailureRecord(rank=0, exitcode=1)
    later = R.next_round_record(rnd, res, "r", "", counts=True, failure=crash, opened_at=0.0)
    assert later.hang_round == 0  # carried over: still the last hang
    # A hang round that is not a round number names no round.
    stored = {**later.to_json(), "hang_round": "0"}
    assert RoundRecord.from_json(stored).hang_round is None
    assert RoundRecord.from_json({**stored, "hang_round": -1}).hang_round is None


def _joiner(node: str) -> JoinRecord:
    return JoinRecord(NodeInfo(node, node, "127.0.0.1", 1), port=1)


# -- what reaches a terminal or a page ------------------------------------------------


def test_the_status_table_escapes_everything_from_the_store() -> None:
    # As read from the store: anyone who reaches it may have written these.
    rnd = {"round": 1, "state": "closed", "restarts": 0, "reason": "x" + ESCAPES}
    rnd["detail"] = "line one\nline two" + ESCAPES
    rnd["last_failure"] = {"rank": 0, "host": "h" + ESCAPES, "message": "boom" + ESCAPES}
    member = {"node_id": "a", "host": "h" + ESCAPES, "addr": ESCAPES, "nproc": 1, "group_rank": 0}
    member["role"] = "trainer" + ESCAPES
    res = ResultRecord(
        1, (MemberRecord.from_json(member, "m"),), master_addr=ESCAPES, master_port=1
    )
    s = summarize(
        "job",
        config=None,
        round_rec=RoundRecord.from_json(rnd),
        result=res,
        prev_result=None,
        joins={},
        dones=set(),
        nodes={"a"},
        waiting={"w" + ESCAPES: WaitingRecord("w", ESCAPES, 1)},
        revision=3,
        now=0.0,
        notes=shown_notes(
            {"progress_0": progress(0, "a", round_=1, host="h" + ESCAPES, ranks=(0,))},
            res,
        ),
    )
    text = render_table(s, "store" + ESCAPES)
    assert not RAW_CONTROL.search(text), text
    assert "\\x1b]0;owned\\x07" in text and "line one\\x0aline two" in text
    assert "ROLE" in text and "trainer\\x1b]0;owned\\x07" in text  # each member's role
    assert "last failure: rank 0 on h\\x1b]0;owned\\x07" in text and ": boom\\x1b" in text
    out = json.dumps(s.to_json())
    assert json.loads(out)["ranks"][0]["host"] == "h" + ESCAPES  # --json: escaped by JSON
    assert "\x1b" not in out


def test_the_failure_summary_escapes_the_worker_s_error_file() -> None:
    error = ErrorFileInfo(
        message="boom" + ESCAPES + "\nsecond line",
        traceback="Traceback:\n\tFile x" + ESCAPES + "\n" + ESCAPES,
        timestamp=None,
    )
    f = WorkerFailure(0, 0, "h" + ESCAPES, 1, 1, 0.0, 0.0, error=error)
    other = WorkerFailure(1, 1, "h", 2, 1, 0.0, 1.0, error=ErrorFileInfo(ESCAPES, None, None))
    text = format_summary(classify([f, other]), "header")
    assert not RAW_CONTROL.search(text), text
    assert "  error: boom\\x1b]0;owned\\x07" in text and "\n    second line" in text
    assert "\tFile x\\x1b" in text  # a tab of the traceback is kept
    tail = WorkerFailure(0, 0, "h", 1, 1, 0.0, 0.0, stderr_tail=("oops" + ESCAPES,))
    assert not RAW_CONTROL.search(format_summary(classify([tail]), "header"))


def test_the_timeline_escapes_events_and_skips_hostile_lines(tmp_path: Any) -> None:
    from elastrun.status.timeline import load_events
    from tests.unit.timeline_events import exited, line, opened, started

    good = line(10.0, opened(0, "<b>" + ESCAPES), "n", "<i>" + ESCAPES)
    lane = line(11.0, started(0, 2), "n", "<i>" + ESCAPES)
    crash = line(12.0, exited(0, 1), "n", "</ul><script>" + ESCAPES)
    mistyped = line(13.0, started(0, 2), "n") | {"round": "not a number"}
    path = tmp_path / "events.jsonl"
    lines = [json.dumps(e) for e in (good, lane, crash, mistyped)]
    lines += ["[" * 100000, json.dumps({"ts": 1e300}), json.dumps({"ts": True})]
    path.write_text("\n".join(lines) + "\n")
    events = load_events([str(path)])
    assert len(events) == 3
    page = render_html(events)
    assert "<script>" not in page and "<b>" not in page and "&lt;script&gt;" in page
    assert not RAW_CONTROL.search(page) and "\\x1b]0;owned\\x07" in page


def test_a_replica_note_counts_only_from_the_round_s_member_at_its_group_rank() -> None:
    seat = N.seats([("node-a", 0, 1), ("node-b", 1, 1)])[1]
    note = N.ReplicaNote(round=3, group_rank=1, node_id="node-b", port=40001)
    assert N.parse(N.ReplicaNote, N.encode(note.to_json()), 3, seat) == note
    with pytest.raises(N.NoteInvalid, match="round 2, not of round 3"):
        N.ReplicaNote(2, 1, "node-b", 40001).check(3, seat)
    with pytest.raises(N.NoteInvalid, match="not from the round's member node-b"):
        N.ReplicaNote(3, 1, "node-x", 40001).check(3, seat)
    for port in (0, 65536, "80", True):
        with pytest.raises(N.NoteInvalid):
            N.ReplicaNote.from_json({**note.to_json(), "port": port})


# -- the typed reads of the rendezvous, on the in-memory store -------------------------


NESTED = b"[" * 100000


def test_a_typed_read_gives_a_checked_note_of_its_kind_or_none() -> None:
    seats = N.seats([("a", 0, 2), ("b", 1, 1)])
    good = N.ProgressNote.from_json(progress(1, "b", ranks=(2,)))

    async def run() -> None:
        store = MemoryStore()
        rdzv = _handler(store)
        keys = rdzv.keys

        async def put(name: str, value: object) -> None:
            await store.put(keys.note(name), _bytes(value))

        assert await rdzv.read_note(N.ProgressNote, 4, seats[1]) is None  # absent
        await put("progress_1", good.to_json())
        assert await rdzv.read_note(N.ProgressNote, 4, seats[1]) == good
        assert await rdzv.read_note(N.ProgressNote, 5, seats[1]) is None  # another round
        # the seat it was not written from: group rank 0's name holds b's note
        await put("progress_0", good.to_json())
        assert await rdzv.read_note(N.ProgressNote, 4, seats[0]) is None
        refused = await rdzv.find_note(N.ProgressNote, 4, seats[0])
        assert isinstance(refused, N.Refused) and "not from the round's member a" in refused.why
        # another kind's note under the name: refused, and never a dict
        await put("progress_1", stacks(4, 1, "b", (2,)))
        assert await rdzv.read_note(N.ProgressNote, 4, seats[1]) is None
        assert isinstance(await rdzv.find_note(N.ProgressNote, 4, seats[1]), N.Refused)
        # junk bytes: no note at all
        for junk in (NESTED, b"not json", b'{"v": 2}', b"x" * (N.NOTE_MAX_BYTES + 1)):
            await put("progress_1", junk)
            assert await rdzv.find_note(N.ProgressNote, 4, seats[1]) is None
        # a round's verdict, and the modules note, read with no seat
        verdict = N.StragglersNote(4, 1.0, 0.05, (N.Straggler(2, 0.2),))
        await put("stragglers", verdict.to_json())
        assert await rdzv.read_note(N.StragglersNote, 4) == verdict
        assert await rdzv.read_note(N.StragglersNote, 3) is None
        await put("modules", {"modules": "os"})
        assert isinstance(await rdzv.find_note(N.ModuleReport), N.Refused)
        await put("modules", {"modules": ["os", "this"], "python": "3.11"})
        assert await rdzv.read_note(N.ModuleReport) == N.ModuleReport(("os",), "3.11", None, 1)

    asyncio.run(asyncio.wait_for(run(), 30.0))


def test_gathered_notes_are_typed_by_seat_and_writes_keep_their_kind_s_lease() -> None:
    seats = N.seats([("a", 0, 1), ("b", 1, 1), ("c", 2, 1), ("d", 3, 1)])

    async def run() -> None:
        store = MemoryStore()
        rdzv = _handler(store)
        await rdzv.next_round()
        keys = rdzv.keys
        mine = N.StacksNote.from_json(stacks(3, 1, "b", (1,)))
        await rdzv.write_note(mine)
        await store.put(keys.note("stacks_3_2"), _bytes(stacks(3, 2, "x", (2,))))
        await store.put(keys.note("stacks_3_3"), NESTED)
        got = await rdzv.gather_notes(N.StacksNote, 3, list(seats.values())[1:], 0.0)
        assert got.keys() == {1, 2} and got[1] == mine  # 3 never decodes: left out
        assert isinstance(got[2], N.Refused) and "not from the round's member c" in got[2].why
        kv = await store.get(keys.note(mine.name))
        assert kv is not None and kv.lease == 0  # a hang's stacks outlive the node
        beat = N.ProgressNote.from_json(progress(0, "a", round_=0))
        await rdzv.write_note(beat)
        kv = await store.get(keys.note(beat.name))
        assert kv is not None and kv.lease == rdzv.keeper.lease != 0
        await rdzv.shutdown()
        assert await store.get(keys.note(beat.name)) is None

    asyncio.run(asyncio.wait_for(run(), 30.0))


def test_a_refusal_note_is_typed_and_bounded() -> None:
    note = N.RefusalNote("node-b", "host-b", "node_unit: job has 2, this node has 1")
    assert N.parse(N.RefusalNote, N.encode(note.to_json())) == note
    for bad in (
        {"node_id": "no/slash"},
        {"host": "h" * (N.MAX_TEXT + 1)},
        {"message": "m" * (N.MAX_MESSAGE + 1)},
        {"message": 3},
    ):
        found = N.parse(N.RefusalNote, N.encode({**note.to_json(), **bad}))
        assert isinstance(found, N.Refused), bad
