"""World-size policies (``--node-unit``) and hot spares.

Pure tests of the rules (:mod:`elastrun.rendezvous.sizes`, the close in
:mod:`elastrun.rendezvous.rounds`, the planner's room), then the real
rendezvous driver end to end on one in-memory store in virtual time: a lost
training node is replaced by a spare, which takes its group rank, while the
survivors keep theirs."""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path

import pytest

from elastrun.errors import ConfigError, RendezvousTimeout
from elastrun.launcher.cli import parse
from elastrun.launcher.config import LaunchConfig
from elastrun.launcher.plan import resolve
from elastrun.names import RunId
from elastrun.rendezvous import keys as K
from elastrun.rendezvous import plan as P
from elastrun.rendezvous import rounds as R
from elastrun.rendezvous.api import RoundResult
from elastrun.rendezvous.protocol import RoundClosed
from elastrun.rendezvous.records import (
    AgreedSettings,
    ConfigRecord,
    JoinRecord,
    MemberRecord,
    NodeInfo,
    PrevMember,
    ResultRecord,
    RoundRecord,
    RoundState,
    WaitingRecord,
)
from elastrun.rendezvous.sizes import WorldSizes, choose_members, promotions
from elastrun.status.cli import render_table
from elastrun.status.model import Summary
from elastrun.status.summary import summarize
from elastrun.store.base import KeyValue
from elastrun.store.memory import MemoryStore
from tests.unit.test_rdzv_timers import clock, handler, run


# -- allowed sizes -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("lo", "hi", "unit", "smallest", "largest"),
    [(2, 3, 2, 2, 2), (1, 8, 4, 4, 8), (3, 9, 2, 4, 8), (1, 5, 1, 1, 5), (4, 4, 4, 4, 4)],
    ids=["2:3/2", "1:8/4", "3:9/2", "1:5/1", "4:4/4"],
)
def test_allowed_sizes_are_the_multiples_of_the_unit_in_range(
    lo: int, hi: int, unit: int, smallest: int, largest: int
) -> None:
    sizes = WorldSizes(lo, hi, unit)
    assert (sizes.smallest, sizes.largest) == (smallest, largest)
    assert sizes.problem() is None
    for n in range(12):
        expected = max((s for s in range(smallest, n + 1, unit) if s <= hi), default=0)
        assert sizes.fit(n) == expected, n
        assert sizes.allowed(n) == (lo <= n <= hi and n % unit == 0)


def test_room_only_when_the_waiting_nodes_reach_the_next_allowed_size() -> None:
    sizes = WorldSizes(2, 6, 2)
    assert not sizes.room(2, 1)  # 3 nodes: still 2 train, one spare
    assert sizes.room(2, 2)  # 4 nodes: a larger world
    assert not sizes.room(6, 3)  # at max
    assert WorldSizes(1, 3).room(2, 1) and not WorldSizes(1, 3).room(3, 1)


@pytest.mark.parametrize(
    ("lo", "hi", "unit", "words"),
    [
        (1, 3, 4, ["--node-unit=4", "--nnodes=1:3", "larger"]),
        (5, 7, 4, ["no multiple of --node-unit=4", "between 5 and 7", "--nnodes=5:7"]),
        (3, 3, 2, ["no multiple of --node-unit=2", "--nnodes=3:3"]),
    ],
    ids=["unit-above-max", "no-multiple", "fixed-odd"],
)
def test_an_impossible_policy_is_refused_at_start_naming_the_flags(
    lo: int, hi: int, unit: int, words: list[str]
) -> None:
    problem = WorldSizes(lo, hi, unit).problem()
    assert problem is not None and all(w in problem for w in words), problem
    config = LaunchConfig(
        min_nodes=lo, max_nodes=hi, node_unit=unit, rdzv_backend="c10d", run_id="j"
    )
    with pytest.raises(ConfigError) as err:
        resolve(config)
    assert all(w in str(err.value) for w in words)


def test_node_unit_reaches_the_rendezvous_and_must_be_positive() -> None:
    config = LaunchConfig(min_nodes=2, max_nodes=3, node_unit=2, rdzv_backend="c10d", run_id="j")
    settings = resolve(config).rendezvous
    assert settings.node_unit == 2 and settings.agreed().node_unit == 2
    with pytest.raises(ConfigError, match=r"--node-unit=0 must be at least 1 .*--nnodes=2:3"):
        resolve(LaunchConfig(min_nodes=2, max_nodes=3, node_unit=0, rdzv_backend="c10d"))


def test_nodes_that_disagree_on_the_unit_get_the_config_mismatch() -> None:
    job = LaunchConfig(min_nodes=2, max_nodes=4, node_unit=2, rdzv_backend="c10d", run_id="j")
    mine = LaunchConfig(min_nodes=2, max_nodes=4, rdzv_backend="c10d", run_id="j")
    diff = R.config_diff("j", resolve(job).rendezvous.agreed(), resolve(mine).rendezvous.agreed())
    assert diff is not None
    message, fields = diff
    assert fields == {"node_unit": (2, 1)}
    assert "node_unit: job has 2, this node has 1" in message


# -- who trains -----------------------------------------------------------------------
def _joiner(nid: str, hint: int | None = None) -> JoinRecord:
    return JoinRecord(NodeInfo(nid, f"h-{nid}", "127.0.0.1", 1, hint, 1), port=1234)


def _reformed(prev: dict[str, int]) -> RoundRecord:
    return RoundRecord(
        round=5,
        state=RoundState.OPEN,
        prev=tuple(PrevMember(n, r) for n, r in prev.items()),
        reason="member_lost",
    )


def _close(prev: dict[str, int], order: str, max_nodes: int, unit: int) -> dict[str, int]:
    rnd = _reformed(prev) if prev else R.first_round(0.0)
    closed, result = R.close_records(
        rnd, [_joiner(n) for n in order], max_nodes, "t", 0.0, unit=unit
    )
    assert closed.state is RoundState.CLOSED
    return {m.node_id: m.group_rank for m in result.members}


def test_a_first_round_forms_the_largest_allowed_size_the_rest_are_spares() -> None:
    assert _close({}, "abc", 3, 2) == {"a": 0, "b": 1}
    assert _close({}, "abcde", 6, 2) == {"a": 0, "b": 1, "c": 2, "d": 3}


@pytest.mark.parametrize("lost", ["a", "b"])
def test_a_spare_takes_the_lost_rank_and_the_survivor_keeps_its_own(lost: str) -> None:
    prev = {"a": 0, "b": 1}
    survivor = "b" if lost == "a" else "a"
    # The spare joined the new round first: the survivor still trains.
    ranks = _close(prev, "s" + survivor, 3, 2)
    assert ranks == {survivor: prev[survivor], "s": prev[lost]}
    assert promotions(prev, ranks) == [("s", prev[lost], lost)]


def test_survivors_train_before_spares_and_keep_their_ranks() -> None:
    prev = {"a": 0, "b": 1, "c": 2, "d": 3}
    # b lost, two spares (x, y) joined before every survivor.
    ranks = _close(prev, "xyacd", 4, 2)
    assert ranks == {"a": 0, "c": 2, "d": 3, "x": 1}
    assert promotions(prev, ranks) == [("x", 1, "b")]
    # Nothing lost: the spares stay spares, the world keeps its ranks.
    assert _close(prev, "xyabcd", 4, 2) == prev


def test_two_losses_two_spares_each_takes_one_lost_rank() -> None:
    prev = {"a": 0, "b": 1, "c": 2, "d": 3}
    ranks = _close(prev, "yxda", 4, 2)
    assert ranks == {"a": 0, "d": 3, "y": 1, "x": 2}
    assert sorted(p[2] or "" for p in promotions(prev, ranks)) == ["b", "c"]


def test_without_a_spare_the_world_shrinks_to_the_next_allowed_size() -> None:
    prev = {"a": 0, "b": 1, "c": 2, "d": 3}
    # b lost, no spare: 3 nodes make a world of 2; a keeps rank 0; c (the
    # lowest previous rank left) takes 1; d waits as a spare.
    ranks = _close(prev, "dca", 4, 2)
    assert ranks == {"a": 0, "c": 1}
    assert promotions(prev, ranks) == []


def test_choose_members_order() -> None:
    joiners = ["n0", "n1", "n2", "n3", "n4"]
    ids = dict(enumerate(joiners))
    prev = {"n4": 0, "n2": 3, "n0": 1}
    # rank < size first (n4, n0), then previous rank order (n2), then join order.
    assert choose_members(joiners, ids, prev, 3) == ["n0", "n2", "n4"]
    assert choose_members(joiners, ids, prev, 4) == ["n0", "n1", "n2", "n4"]
    assert choose_members(joiners, ids, {}, 2) == ["n0", "n1"]


# -- the planner's room -----------------------------------------------------------------
def _closed_view(members: list[str], waiting: list[str]) -> P.View:
    keys = K.Keys(RunId("j"))
    view = P.View()
    mrecs = tuple(MemberRecord(n, f"h-{n}", "127.0.0.1", 1, i) for i, n in enumerate(members))
    view.results[0] = ResultRecord(0, mrecs, "127.0.0.1", 1, 0, False, "t")
    rnd = RoundRecord(round=0, state=RoundState.CLOSED)
    view.set_round(KeyValue(keys.round, rnd.encode(), 1, 1, 1))
    for n in waiting:
        rec = WaitingRecord(n, f"h-{n}", 0)
        view.waiting[n] = KeyValue(keys.waiting(n), rec.encode(), 2, 2, 1)
    return view


def test_a_waiting_spare_re_forms_the_round_only_with_enough_spares_to_grow() -> None:
    one = _closed_view(["a", "b"], ["s"])
    assert not P.waiting_event(one, 0, "s", 4, unit=2).room
    ev = P.round_event(one, "s", "h-s", 4, unit=2)
    assert isinstance(ev, RoundClosed) and not ev.room and not ev.member
    two = _closed_view(["a", "b"], ["s", "t"])
    assert P.waiting_event(two, 0, "t", 4, unit=2).room
    # Unit 1: as before, any waiting node below max.
    assert P.waiting_event(one, 0, "s", 4).room


# -- the driver, end to end in virtual time --------------------------------------------
TTL = 1.0
SPARES = {"min_nodes": 2, "max_nodes": 3, "node_unit": 2, "lease_ttl": TTL}


def _by_node(results: list[RoundResult]) -> dict[str, int]:
    return {r.me.node_id: r.group_rank for r in results}


@pytest.mark.parametrize("victim_rank", [0, 1])
def test_a_lost_training_node_is_replaced_by_the_spare_with_its_rank(victim_rank: int) -> None:
    async def scenario() -> tuple[dict[str, int], bool, RoundResult, dict[str, int]]:
        store, run_id = MemoryStore(clock=clock()), f"j-{uuid.uuid4().hex[:6]}"
        hs = {n: handler(store, run_id, n, **SPARES) for n in ("a", "b", "s")}
        first = await asyncio.gather(hs["a"].next_round(), hs["b"].next_round())
        ranks = _by_node(list(first))
        spare_call = asyncio.create_task(hs["s"].next_round())
        changes = {n: asyncio.create_task(hs[n].wait_for_change()) for n in ("a", "b")}
        await clock().sleep_until(clock().monotonic() + 3 * TTL)
        quiet = not spare_call.done() and not any(c.done() for c in changes.values())
        victim = next(n for n, r in ranks.items() if r == victim_rank)
        survivor = "b" if victim == "a" else "a"
        await hs[victim].keeper.stop(revoke=False)  # killed: its lease expires
        changes[victim].cancel()
        await changes[survivor]
        second = await asyncio.gather(hs[survivor].next_round(), spare_call)
        for n in (survivor, "s"):
            await hs[n].shutdown()
        return ranks, quiet, second[1], _by_node(list(second))

    ranks, quiet, spare_result, after = run(scenario)
    assert sorted(ranks.values()) == [0, 1] and "s" not in ranks
    assert quiet, "the spare re-formed a world it cannot enlarge"
    assert spare_result.group_world_size == 2
    victim = next(n for n, r in ranks.items() if r == victim_rank)
    survivor = "b" if victim == "a" else "a"
    assert after == {survivor: ranks[survivor], "s": victim_rank}


def test_without_a_spare_the_survivors_shrink_to_the_next_allowed_size() -> None:
    async def scenario() -> tuple[dict[str, int], dict[str, int], bool]:
        store, run_id = MemoryStore(clock=clock()), f"j-{uuid.uuid4().hex[:6]}"
        common = {"min_nodes": 2, "max_nodes": 4, "node_unit": 2, "lease_ttl": TTL}
        hs = {n: handler(store, run_id, n, **common) for n in "abcd"}
        first = _by_node(list(await asyncio.gather(*(h.next_round() for h in hs.values()))))
        victim = next(n for n, r in first.items() if r == 1)
        rest = [n for n in hs if n != victim]
        waits = [asyncio.create_task(hs[n].wait_for_change()) for n in rest]
        await hs[victim].keeper.stop(revoke=False)
        await asyncio.gather(*waits)
        calls = {n: asyncio.create_task(hs[n].next_round()) for n in rest}
        pending: set[asyncio.Task[RoundResult]] = set(calls.values())
        while len(pending) > 1:  # at most three turns: one call ends each
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        # The third stays a spare: three lease TTLs later it still waits.
        await clock().sleep_until(clock().monotonic() + 3 * TTL)
        results = [c.result() for c in calls.values() if c.done()]
        spare_waits = len(pending) == 1 and not next(iter(pending)).done()
        for n in rest:
            calls[n].cancel()
            await hs[n].shutdown()
        return first, _by_node(results), spare_waits

    first, after, spare_waits = run(scenario)
    assert len(after) == 2 and spare_waits
    rank0 = next(n for n, r in first.items() if r == 0)
    rank2 = next(n for n, r in first.items() if r == 2)
    assert after == {rank0: 0, rank2: 1}


def test_below_the_smallest_allowed_size_the_survivor_waits_then_names_why() -> None:
    async def scenario() -> BaseException:
        store, run_id = MemoryStore(clock=clock()), f"j-{uuid.uuid4().hex[:6]}"
        common = {"min_nodes": 1, "max_nodes": 2, "node_unit": 2, "lease_ttl": TTL}
        a, b = (handler(store, run_id, n, **common, join_timeout=60.0) for n in "ab")
        await asyncio.gather(a.next_round(), b.next_round())
        change = asyncio.create_task(a.wait_for_change())
        await b.keeper.stop(revoke=False)
        await change
        try:
            await a.next_round()
        except RendezvousTimeout as e:
            return e
        finally:
            await a.shutdown()
        raise AssertionError("the survivor formed a world of 1")

    error = run(scenario)
    assert "1 of min 2 nodes (--nnodes=1:2 --node-unit=2 allows world sizes 2)" in str(error)
    assert "join_timeout=60s" in str(error)


def test_a_second_spare_grows_the_world_by_one_unit() -> None:
    async def scenario() -> tuple[int, list[int]]:
        store, run_id = MemoryStore(clock=clock()), f"j-{uuid.uuid4().hex[:6]}"
        common = {"min_nodes": 2, "max_nodes": 4, "node_unit": 2, "lease_ttl": TTL}
        common["last_call_timeout"] = 0.5
        hs = {n: handler(store, run_id, n, **common) for n in "abcd"}
        first = await asyncio.gather(hs["a"].next_round(), hs["b"].next_round())
        third = asyncio.create_task(hs["c"].next_round())
        changes = [asyncio.create_task(hs[n].wait_for_change()) for n in "ab"]
        await clock().sleep_until(clock().monotonic() + 3 * TTL)
        assert not third.done() and not any(c.done() for c in changes)
        fourth = asyncio.create_task(hs["d"].next_round())
        await asyncio.gather(*changes)
        second = await asyncio.gather(hs["a"].next_round(), hs["b"].next_round(), third, fourth)
        for h in hs.values():
            await h.shutdown()
        return first[0].group_world_size, sorted(r.group_rank for r in second)

    size, ranks = run(scenario)
    assert size == 2 and ranks == [0, 1, 2, 3]


# -- the flag ----------------------------------------------------------------------------
@pytest.fixture(autouse=False)
def script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.chdir(tmp_path)
    for name in [n for n in os.environ if n.startswith("PET_")]:
        monkeypatch.delenv(name)
    (tmp_path / "train.py").write_text("print('hi')\n")
    return "train.py"


@pytest.mark.parametrize("flag", ["--node-unit=2", "--node_unit=2", "PET_NODE_UNIT=2"])
def test_the_node_unit_flag_in_both_spellings_and_from_the_environment(
    flag: str, monkeypatch: pytest.MonkeyPatch, script: str
) -> None:
    flags = ["--nnodes=2:3", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:29400"]
    if flag.startswith("PET_"):
        monkeypatch.setenv(*flag.split("="))
    else:
        flags.append(flag)
    plan, _ = parse([*flags, script])
    assert plan.rendezvous.node_unit == 2
    assert plan.rendezvous.sizes() == WorldSizes(2, 3, 2)


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--nnodes=1:3", "--node-unit=4"], ["--node-unit=4", "--nnodes=1:3"]),
        (["--nnodes=5:7", "--node-unit=4"], ["--node-unit=4", "--nnodes=5:7"]),
        (["--nnodes=2:3", "--node-unit=x"], ["--node-unit", "integer"]),
        (["--nnodes=2:3", "--node-unit=0"], ["--node-unit=0", "at least 1", "--nnodes=2:3"]),
    ],
    ids=["above-max", "no-multiple", "not-a-number", "zero"],
)
def test_bad_node_unit_flags_are_refused_naming_the_flags(
    flags: list[str], words: list[str], script: str
) -> None:
    with pytest.raises(ConfigError) as err:
        parse([*flags, "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:29400", script])
    assert all(w in str(err.value) for w in words), err.value


def test_the_policy_in_words() -> None:
    assert WorldSizes(2, 5, 2).describe() == "--nnodes=2:5 --node-unit=2 allows world sizes 2, 4"
    assert WorldSizes(2, 3).describe() == "--nnodes=2:3"


# -- status --------------------------------------------------------------------------------
def _summary(unit: int, waiting: list[str]) -> Summary:
    members = tuple(MemberRecord(n, f"h-{n}", "10.0.0.1", 1, i) for i, n in enumerate("ab"))
    return summarize(
        "job",
        config=ConfigRecord(AgreedSettings(2, 4, 3, 600.0, 30.0, node_unit=unit)),
        round_rec=RoundRecord(0, RoundState.CLOSED),
        result=ResultRecord(0, members, "10.0.0.1", 5, closed_at=100.0),
        prev_result=None,
        joins={},
        dones=set(),
        nodes={"a", "b", *waiting},
        waiting={n: WaitingRecord(n, f"h-{n}", 0) for n in waiting},
        revision=7,
        now=110.0,
    )


def test_status_shows_the_spares_beside_a_running_world() -> None:
    one = _summary(2, ["s"])
    assert [w.node_id for w in one.spares] == ["s"] and one.to_json()["node_unit"] == 2
    text = render_table(one, "h:1")
    assert "max 4, node unit 2), 3 present, 1 spare;" in text
    assert "\nspares: h-s (s)" in text
    # Two waiting nodes make a world of 4: they are about to join, not spares.
    assert _summary(2, ["s", "t"]).spares == ()
    # Unit 1 below max: a waiting node joins the next round.
    assert _summary(1, ["s"]).spares == ()
    assert "waiting: h-s (s)" in render_table(_summary(1, ["s"]), "h:1")


# -- a survivor never loses its place to a spare -------------------------------------------
def test_max_joined_waits_for_a_present_member_of_the_previous_round() -> None:
    from elastrun.rendezvous.protocol import Arm, CloseRound, Context, JoinersChanged, State
    from elastrun.rendezvous.rules import Rules

    m = Rules(Context(min_nodes=2, max_nodes=2, last_call_timeout=30.0, round=4), State.DECIDING)
    acts = m.handle(JoinersChanged(now=1.0, count=2, decider=True, members_pending=True))
    assert [type(a) for a in acts] == [Arm] and isinstance(acts[0], Arm)
    assert acts[0].deadline == 31.0
    acts = m.handle(JoinersChanged(now=2.0, count=3, decider=True))
    assert [a.reason for a in acts if isinstance(a, CloseRound)] == ["max_nodes"]


def test_the_planner_sees_a_present_member_yet_to_join() -> None:
    keys = K.Keys(RunId("j"))
    view = P.View(decider=True, nodes_loaded=True)
    rnd = RoundRecord(round=3, state=RoundState.OPEN, prev=(PrevMember("a", 0), PrevMember("b", 1)))
    view.set_round(KeyValue(keys.round, rnd.encode(), 1, 1, 1))
    for n in ("a", "s", "t"):
        view.nodes[n] = KeyValue(keys.node(n), b"{}", 2, 2, 1)
    for n in ("s", "t"):
        view.joiners[n] = KeyValue(keys.join(3, n), b"{}", 3, 3, 1)
    assert P.joiners_event(view, 0.0).members_pending  # a is present, not joined
    del view.nodes["a"]
    assert not P.joiners_event(view, 0.0).members_pending  # a is gone
    view.nodes["a"] = KeyValue(keys.node("a"), b"{}", 2, 2, 1)
    view.joiners["a"] = KeyValue(keys.join(3, "a"), b"{}", 4, 4, 1)
    assert not P.joiners_event(view, 0.0).members_pending


def test_a_slow_survivor_keeps_its_rank_though_two_spares_joined_first() -> None:
    async def scenario() -> tuple[dict[str, int], dict[str, int], bool]:
        store, run_id = MemoryStore(clock=clock()), f"j-{uuid.uuid4().hex[:6]}"
        common = {**SPARES, "last_call_timeout": 30.0}
        hs = {n: handler(store, run_id, n, **common) for n in ("a", "b", "s", "t")}
        first = _by_node(list(await asyncio.gather(hs["a"].next_round(), hs["b"].next_round())))
        spares = {n: asyncio.create_task(hs[n].next_round()) for n in ("s", "t")}
        changes = {n: asyncio.create_task(hs[n].wait_for_change()) for n in ("a", "b")}
        await clock().sleep_until(clock().monotonic() + 3 * TTL)
        await hs["b"].keeper.stop(revoke=False)
        changes["b"].cancel()
        await changes["a"]
        # The survivor stops its workers for 5 s; both spares join at once.
        await clock().sleep_until(clock().monotonic() + 5.0)
        mine = await hs["a"].next_round()
        done, pending = await asyncio.wait(spares.values(), timeout=3 * TTL)
        promoted = [t.result() for t in done]
        after = _by_node([mine, *promoted])
        left_waiting = len(pending) == 1
        for t in pending:
            t.cancel()
        for n in ("a", "s", "t"):
            await hs[n].shutdown()
        return first, after, left_waiting

    first, after, left_waiting = run(scenario)
    assert after["a"] == first["a"] and len(after) == 2 and left_waiting
    (spare,) = set(after) - {"a"}
    assert after[spare] == first["b"]


# -- how long a spare waits -------------------------------------------------------------------
def test_a_spare_waits_as_long_as_the_job_runs_then_its_join_timeout_counts_again() -> None:
    async def scenario() -> tuple[bool, float, BaseException | None]:
        store, run_id = MemoryStore(clock=clock()), f"j-{uuid.uuid4().hex[:6]}"
        common = {**SPARES, "join_timeout": 60.0}
        hs = {n: handler(store, run_id, n, **common) for n in ("a", "b", "s")}
        await asyncio.gather(hs["a"].next_round(), hs["b"].next_round())
        spare = asyncio.create_task(hs["s"].next_round())
        # Ten join timeouts: the world trains, the spare waits on.
        await clock().sleep_until(clock().monotonic() + 600.0)
        waited = not spare.done()
        for n in ("a", "b"):  # both training nodes are lost: the spare alone re-forms
            await hs[n].keeper.stop(revoke=False)
        lost_at = clock().monotonic()
        error = None
        try:
            await spare
        except RendezvousTimeout as e:
            error = e
        took = clock().monotonic() - lost_at
        await hs["s"].shutdown()
        return waited, took, error

    waited, took, error = run(scenario)
    assert waited, "the spare gave up while the job ran"
    assert isinstance(error, RendezvousTimeout) and "1 of min 2 nodes" in str(error)
    assert took == pytest.approx(60.0 + TTL, abs=1.0)  # the lease, then one join timeout


def test_the_timeline_marks_a_promotion() -> None:
    from elastrun.status.timeline import render_html
    from tests.unit.timeline_events import logged, opened, promoted, started

    events = [
        logged(1.0, opened(1, "member_lost"), "s", "h-s"),
        logged(2.0, promoted(1, "s", 1, "b"), "s", "h-s"),
        logged(3.0, started(1, 2), "s", "h-s"),
    ]
    assert "promoted: group rank 1, in place of b" in render_html(events)
