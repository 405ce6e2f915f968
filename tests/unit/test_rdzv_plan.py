"""The rendezvous planner, pure: phase plans, the decider, the barrier's
watcher, and what the store's state and watch events mean (no store, no I/O)."""

from __future__ import annotations

import pytest

from elastrun.names import RunId
from elastrun.rendezvous import barrier_plan as B
from elastrun.rendezvous import keys as K
from elastrun.rendezvous import plan as P
from elastrun.rendezvous.protocol import (
    BarrierDone,
    JoinersChanged,
    MemberLost,
    NodeWaiting,
    RoundClosed,
    RoundFailed,
    RoundFinished,
    RoundOpen,
    State,
)
from elastrun.rendezvous.records import (
    DONE,
    JoinRecord,
    MemberRecord,
    NodeInfo,
    PresenceRecord,
    PrevMember,
    ResultRecord,
    RoundRecord,
    RoundState,
    WaitingRecord,
)
from elastrun.rendezvous.results import Head
from elastrun.store.base import KeyValue, WatchEvent

KEYS = K.Keys(RunId("job"))
OPEN, CLOSED = RoundState.OPEN, RoundState.CLOSED


def kv(key: str, created: int, value: bytes) -> KeyValue:
    return KeyValue(key, value, created, created, 1)


def round_kv(record: RoundRecord, created: int = 5) -> KeyValue:
    return kv(KEYS.round, created, record.encode())


def join(node: str, created: int) -> KeyValue:
    record = JoinRecord(NodeInfo(node, f"h-{node}", "a", 1), 29500)
    return kv(KEYS.join(0, node), created, record.encode())


def presence(node: str, created: int = 1) -> KeyValue:
    return kv(
        KEYS.node(node), created, PresenceRecord(NodeInfo(node, f"h-{node}", "a", 1)).encode()
    )


def members(*ids: str) -> tuple[MemberRecord, ...]:
    return tuple(MemberRecord(n, f"h-{n}", "a", 1, i) for i, n in enumerate(ids))


def result(r: int, *ids: str) -> ResultRecord:
    return ResultRecord(r, members(*ids), "a", 29500)


def closed_view(*ids: str, r: int = 2) -> P.View:
    view = P.View()
    view.set_round(round_kv(RoundRecord(r, CLOSED)))
    view.results[r] = result(r, *ids)
    return view


def put(k: KeyValue) -> WatchEvent:
    return WatchEvent("put", k)


def delete(key: str) -> WatchEvent:
    return WatchEvent("delete", KeyValue(key, b"", 0, 0, 0))


# -- phases -----------------------------------------------------------------------------
def test_each_state_that_waits_has_its_phase_plan() -> None:
    plans = {s: P.plan_phase(s, 4) for s in State}
    assert {s for s, p in plans.items() if p is None} == {
        State.IDLE,
        State.FINISHED,
        State.FAILED,
        State.LEFT,
    }
    join_plan = plans[State.JOINING]
    assert join_plan == plans[State.DECIDING]  # the decider keeps its phase
    assert join_plan is not None and join_plan.joins and not join_plan.nodes
    wait, member = plans[State.WAITING], plans[State.MEMBER]
    assert wait is not None and wait.nodes and not wait.waiting
    # A member reads no prefix of O(n) up front: the round's watcher, then its steps.
    assert member is not None and member.watch_members and member.waiting
    assert not (member.nodes or member.barrier or member.joins)
    complete = plans[State.COMPLETING]
    # The barrier reads no prefix of O(n) up front: the count, then its steps.
    assert complete is not None and complete.barrier
    assert not (complete.nodes or complete.waiting or complete.joins)
    assert P.plan_phase(State.MEMBER, 4) != P.plan_phase(State.MEMBER, 5)


# -- the decider ------------------------------------------------------------------------
def test_the_decider_is_the_live_joiner_with_the_smallest_join_revision() -> None:
    joins = [join("c", 30), join("a", 12), join("b", 20)]  # key order is not join order
    assert P.join_role("a", joins) == P.Decider()
    assert P.join_role("b", joins) == P.Follower("a")
    assert P.join_role("c", joins) == P.Follower("b")  # only its predecessor
    assert P.join_role("z", joins) is None  # not joined: watches only round
    # The decider left (its join key is gone): its follower decides now.
    assert P.join_role("b", [join("c", 30), join("b", 20)]) == P.Decider()
    assert P.join_role("a", []) is None


def test_a_follower_reads_only_its_own_join_and_its_predecessors() -> None:
    newest = [join("me", 40), join("p", 33)]  # newest first, up to my join
    assert P.follower_of_newest("me", newest) == P.Follower("p")
    # Alone (I decide), or another join at my revision came first: read all.
    assert P.follower_of_newest("me", [join("me", 40)]) is None
    assert P.follower_of_newest("me", [join("x", 40), join("me", 40)]) is None


def test_a_follower_re_reads_when_its_predecessor_leaves() -> None:
    view = P.View()
    r = P.react(view, P.Watched.PREDECESSOR, delete(KEYS.join(0, "p")), r=0, now=1.0, max_nodes=4)
    assert r == P.Resnap()
    again = put(join("p", 33))
    assert P.react(view, P.Watched.PREDECESSOR, again, r=0, now=1.0, max_nodes=4) == []


# -- the exit barrier -----------------------------------------------------------------------
MEMBERS = members("a", "b", "c", "me", "d")


def step(present: dict[str, bool], done: dict[str, bool], count: int = 1) -> B.BarrierStep:
    return B.barrier_step(MEMBERS, "me", count, present, done)


def test_every_done_key_counted_ends_the_barrier_at_once() -> None:
    assert step({}, {}, count=5) == BarrierDone()


def test_the_watcher_is_the_first_member_in_rank_order_whose_presence_exists() -> None:
    assert step({}, {}) == B.CheckPresence("a")  # one key at a time, rank order
    assert step({"a": True}, {}) == B.WatchWatcher("a")
    assert step({"a": False}, {"a": True}) == B.CheckPresence("b")
    assert step({"a": False, "b": True}, {"a": True}) == B.WatchWatcher("b")


def test_a_member_before_the_watcher_that_is_gone_must_have_a_done_key() -> None:
    assert step({"a": False}, {}) == B.CheckDone("a")
    lost = step({"a": False}, {"a": False})
    assert isinstance(lost, B.LostAtBarrier) and lost.member.node_id == "a"
    assert P.lost_event(lost.member) == MemberLost("node h-a (a) lost: lease expired or revoked")


def test_with_every_member_before_it_gone_and_done_this_node_watches() -> None:
    gone = {"a": False, "b": False, "c": False}
    assert step(gone, dict.fromkeys(gone, True)) == B.BeWatcher()
    # Members after this node never matter: the first member watches.
    assert B.barrier_step(MEMBERS, "a", 1, {}, {}) == B.BeWatcher()


def test_the_others_re_pick_the_watcher_when_it_leaves_done() -> None:
    view = closed_view("a", "me")
    gone = P.react(view, P.Watched.WATCHER, delete(KEYS.node("a")), r=2, now=0.0, max_nodes=4)
    # Lost unless it put its done key; if it did, set the barrier up again.
    assert gone == P.GoneMember(members("a", "me")[0], resnap=True)
    back = put(presence("a"))
    assert P.react(view, P.Watched.WATCHER, back, r=2, now=0.0, max_nodes=4) == []


def test_the_watcher_ends_the_barrier_on_the_last_done_key() -> None:
    view = closed_view("a", "b")
    first = put(kv(KEYS.done(2, "a"), 9, DONE))
    assert P.react(view, P.Watched.DONE, first, r=2, now=0.0, max_nodes=4) == []
    last = put(kv(KEYS.done(2, "b"), 10, DONE))
    assert P.react(view, P.Watched.DONE, last, r=2, now=0.0, max_nodes=4) == [BarrierDone()]
    assert P.all_done(view, 2)


# -- store state -> events ----------------------------------------------------------------------
def test_the_round_record_means_one_event() -> None:
    view = P.View()
    assert P.round_event(view, "me", "h", 4) is None
    for state, event in (
        (OPEN, RoundOpen(3)),
        (RoundState.FINISHED, RoundFinished(3)),
        (RoundState.FAILED, RoundFailed(3)),
    ):
        view.set_round(round_kv(RoundRecord(3, state)))
        assert P.result_needed(view) is None
        assert P.round_event(view, "me", "h", 4) == event


def test_a_closed_round_needs_its_result_then_says_who_is_in_it() -> None:
    view = P.View()
    view.set_round(round_kv(RoundRecord(2, CLOSED)))
    assert P.result_needed(view) == 2
    whole = result(2, "a", "b")
    view.heads[2] = Head.of(whole, "c", 1)  # the header and this node's place: none
    assert P.result_needed(view) is None
    assert P.round_event(view, "c", "h-c", 2) == RoundClosed(
        2, member=False, room=False, lost="", detail="node h-c (c) waits to join"
    )
    # Presence read: every member is needed, and one without a presence is
    # gone (the waiting node re-forms).
    view.nodes, view.nodes_loaded = {"a": presence("a")}, True
    assert P.result_needed(view) == 2
    view.results[2] = whole
    assert P.result_needed(view) is None
    ev = P.round_event(view, "c", "h-c", 3)
    assert isinstance(ev, RoundClosed) and ev.room
    assert ev.lost == "node b lost (no presence in the store)"


def test_joiners_event_counts_and_skips_the_last_call_when_all_rejoined() -> None:
    view = P.View(decider=True)
    view.set_round(round_kv(RoundRecord(1, OPEN, prev=(PrevMember("a", 0),))))
    view.joiners = {"a": join("a", 7)}
    view.nodes, view.nodes_loaded = {"a": presence("a"), "b": presence("b")}, True
    assert P.joiners_event(view, 9.0) == JoinersChanged(9.0, 1, decider=True, all_joined=False)
    P.react(view, P.Watched.JOINS, put(join("b", 8)), r=1, now=10.0, max_nodes=4)
    assert P.joiners_event(view, 10.0).all_joined
    # A follower's count is the one it read (only its predecessor is watched).
    follower = P.View(joined_count=5)
    assert P.joiners_event(follower, 1.0).count == 5


def test_a_members_presence_gone_is_lost_unless_done() -> None:
    view = closed_view("a", "b")
    view.nodes = {"a": presence("a"), "b": presence("b")}
    view.nodes_loaded = True
    gone = P.react(view, P.Watched.NODES, delete(KEYS.node("b")), r=2, now=0.0, max_nodes=4)
    assert gone == P.GoneMember(members("a", "b")[1])
    assert P.absent_members(view, 2) == [members("a", "b")[1]]
    view.done.add("b")  # it put its done key: it finished, not lost
    assert P.absent_members(view, 2) == []
    assert P.react(view, P.Watched.NODES, delete(KEYS.node("b")), r=2, now=0.0, max_nodes=4) == []
    # Not a member: nothing.
    other = delete(KEYS.node("x"))
    assert P.react(view, P.Watched.NODES, other, r=2, now=0.0, max_nodes=4) == []


def test_the_decider_recounts_on_presence_changes() -> None:
    view = P.View(decider=True)
    view.nodes_loaded = True
    ev = P.react(view, P.Watched.NODES, put(presence("n")), r=0, now=3.0, max_nodes=4)
    assert ev == [JoinersChanged(3.0, 0, decider=True, all_joined=False)]


@pytest.mark.parametrize(("max_nodes", "room"), [(3, True), (2, False)])
def test_a_waiting_node_is_news_to_members(max_nodes: int, room: bool) -> None:
    view = closed_view("a", "b")
    waiting = kv(KEYS.waiting("w"), 12, WaitingRecord("w", "h-w", 1).encode())
    ev = P.react(view, P.Watched.WAITING, put(waiting), r=2, now=0.0, max_nodes=max_nodes)
    assert ev == [NodeWaiting(room, "node h-w (w) waits to join")]
    gone = delete(KEYS.waiting("w"))
    assert P.react(view, P.Watched.WAITING, gone, r=2, now=0.0, max_nodes=max_nodes) == []
    assert view.waiting == {}


def test_the_round_record_changing_asks_for_its_event() -> None:
    view = P.View()
    rec = round_kv(RoundRecord(4, OPEN), created=8)
    assert P.react(view, P.Watched.ROUND, put(rec), r=3, now=0.0, max_nodes=4) == P.RoundChanged()
    assert view.round is not None and view.round.round == 4


def test_a_round_event_the_snapshot_already_holds_changes_nothing() -> None:
    """The round feed outlives phases: a phase that started from a snapshot
    at revision 9 ignores the feed's events up to 9 (queued before it), and
    takes a newer one."""
    view = P.View()
    view.set_round(round_kv(RoundRecord(4, CLOSED), created=9), 9)
    old = round_kv(RoundRecord(4, OPEN), created=8)
    assert P.react(view, P.Watched.ROUND, put(old), r=4, now=0.0, max_nodes=4) == []
    same = round_kv(RoundRecord(4, CLOSED), created=9)
    assert P.react(view, P.Watched.ROUND, put(same), r=4, now=0.0, max_nodes=4) == []
    assert view.round is not None and view.round.state is CLOSED
    newer = round_kv(RoundRecord(5, OPEN), created=11)
    assert P.react(view, P.Watched.ROUND, put(newer), r=4, now=0.0, max_nodes=4) == P.RoundChanged()
    assert view.round is not None and view.round.round == 5 and view.round_rev == 11
