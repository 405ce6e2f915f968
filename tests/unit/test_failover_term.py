"""The store failover's pure parts: a candidate's term, votes and fencing
(store/term.py), the candidate list's checks (launcher/plan.py), the round a
node carries into a new host's store (rendezvous/rounds.py)."""

from __future__ import annotations

import pytest

from elastrun.clock import FakeClock
from elastrun.errors import ConfigError
from elastrun.launcher.cli import parse
from elastrun.rendezvous.records import AgreedSettings, PrevMember, RoundRecord, RoundState
from elastrun.rendezvous.rounds import Carry, config_diff, takeover_round
from elastrun.store.ballot import Ballot
from elastrun.store.term import FailoverTiming, Role, TermState

TIMING = FailoverTiming(heartbeat=1.0, silence=2.5, fence=3.0, drift=0.01, margin=1.0)


def host(count: int = 3, clock: FakeClock | None = None) -> TermState:
    return TermState(0, count, role=Role.HOST, term=1, timing=TIMING, clock=clock or FakeClock())


def test_a_voter_waits_longer_than_the_host_fences_on_any_clock_within_the_drift() -> None:
    after = TIMING.vote_after
    # The host's fence timer on a clock 1% slow vs the voter's 1% fast.
    assert after * (1 - TIMING.drift) > TIMING.fence * (1 + TIMING.drift)


def test_the_host_steps_down_once_it_hears_from_fewer_than_a_majority() -> None:
    clock = FakeClock()
    state = host(3, clock)
    assert state.check_fence() is None  # not armed: the job is not up yet
    state.heard_from(1)
    assert state.check_fence() is None and state.armed
    clock.advance(2.0)
    assert state.check_fence() is None  # candidate 1 heard 2 s ago: still a majority
    clock.advance(1.5)
    why = state.check_fence()
    assert why is not None and "1 of 3" in why and "majority (2)" in why
    assert state.role is Role.FENCED
    state.heard_from(1)  # coming back does not undo it
    assert state.role is Role.FENCED and state.check_fence() is None


def test_a_host_never_armed_does_not_fence_and_one_candidate_never_does() -> None:
    clock = FakeClock()
    state = host(3, clock)
    clock.advance(100)
    assert state.check_fence() is None and state.role is Role.HOST
    single = TermState(0, 1, role=Role.HOST, term=1, timing=TIMING, clock=clock)
    clock.advance(100)
    assert single.check_fence() is None


def test_a_standby_takes_over_with_a_majority_of_votes_for_a_newer_term() -> None:
    clock = FakeClock()
    standby = TermState(1, 3, timing=TIMING, clock=clock)
    standby.learn(1, 0)
    assert not standby.receive_vote(1, 1)  # not newer than the term it knows
    assert not standby.receive_vote(2, 1)  # its own vote: 1 of 3
    assert not standby.receive_vote(2, 1)  # the same voter twice counts once
    assert standby.role.value == "standby"
    assert standby.receive_vote(2, 2)
    assert standby.role is Role.HOST and standby.term == 2 and standby.host == 1
    # Armed at once: it heard its voters just now.
    assert standby.armed and standby.live() == {1, 2}
    assert not standby.receive_vote(3, 0)  # a host takes no votes


def test_votes_for_different_candidates_in_a_term_cannot_both_win() -> None:
    c1 = TermState(1, 3, timing=TIMING)
    c2 = TermState(2, 3, timing=TIMING)
    ballots = [Ballot(), Ballot(), Ballot()]
    # Voter 0 votes for 1, voter 2 for itself, voter 1 for itself: a split.
    for voter, target in ((0, c1), (2, c2), (1, c1)):
        if ballots[voter].vote(2, target.index):
            target.receive_vote(2, voter)
    assert not ballots[1].vote(2, 2)  # voter 1 voted for 1 in term 2: not for 2 too
    assert [c1.role, c2.role] == [Role.HOST, Role.STANDBY]


def test_a_standby_refuses_naming_the_host_and_a_fenced_host_says_it_stepped_down() -> None:
    standby = TermState(2, 3, timing=TIMING)
    standby.learn(4, 1)
    assert "term 4" in standby.refusal("10.0.0.2:29400")
    assert "the host is 10.0.0.2:29400" in standby.refusal("10.0.0.2:29400")


def launch(endpoint: str, *extra: str) -> None:
    parse(
        [
            "--nnodes=2:3",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}",
            "--rdzv-id=j",
            *extra,
            "--no-python",
            "true",
        ]
    )


@pytest.mark.parametrize(
    ("endpoint", "extra", "says"),
    [
        ("a:1,b:1,a:1", (), "listed twice"),
        (",".join(f"h{i}:1" for i in range(8)), (), "at most 7"),
        ("a:1,,b:1", (), "empty entry"),
        ("a:1,b:0", (), "fixed port"),
        ("a:1,b:1", ("--rdzv-conf=is_host=1",), "is_host"),
        ("a:1,b:1", ("--rdzv-conf=store_bind=0.0.0.0",), "store_bind"),
    ],
    ids=["duplicate", "eight", "empty", "port-0", "is-host", "store-bind"],
)
def test_a_bad_candidate_list_is_refused_naming_the_flag(
    endpoint: str, extra: tuple[str, ...], says: str
) -> None:
    with pytest.raises(ConfigError) as err:
        launch(endpoint, *extra)
    assert says in str(err.value)
    assert "--rdzv" in str(err.value)


def test_a_candidate_list_is_a_setting_every_node_must_share() -> None:
    plan, _ = parse(
        [
            "--nnodes=2:3",
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=a:5,b:5,c:5",
            "--rdzv-id=j",
            "--no-python",
            "true",
        ]
    )
    assert plan.failover and len(plan.endpoints) == 3
    mine = plan.rendezvous.agreed()
    theirs = AgreedSettings(**{**mine.__dict__, "candidates": "a:5,c:5,b:5"})
    diff = config_diff("j", theirs, mine)
    assert diff is not None and "candidates" in diff[0]
    assert AgreedSettings.from_json(mine.to_json()) == mine
    single, _ = parse(
        [
            "--nnodes=2",
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=a:5",
            "--rdzv-id=j",
            "--no-python",
            "true",
        ]
    )
    assert not single.failover and single.rendezvous.agreed().candidates == ""
    assert "candidates" not in single.rendezvous.agreed().to_json()  # older nodes read it


def test_the_round_after_a_takeover_never_goes_backwards() -> None:
    carry = Carry(round=4, restarts=2, prev=(PrevMember("n1", 0), PrevMember("n2", 1)))
    fresh = takeover_round(carry, None, "lost", 0.0)
    assert (fresh.round, fresh.restarts, fresh.state) == (5, 2, RoundState.OPEN)
    assert fresh.prev == carry.prev and not fresh.counts
    older = RoundRecord(round=3, state=RoundState.OPEN, restarts=3)
    again = takeover_round(carry, older, "lost", 0.0)
    assert (again.round, again.restarts) == (5, 3)


def test_the_host_holds_requests_while_a_majority_is_silent_and_before_it_fences() -> None:
    clock = FakeClock()
    state = host(3, clock)
    state.heard_from(1)
    state.heard_from(2)
    assert state.check_fence() is None and not state.suspect()
    clock.advance(TIMING.suspect + 0.1)
    assert state.suspect()  # requests wait from here ...
    state.heard_from(2)
    assert not state.suspect()  # ... and are served again once a majority is heard
    clock.advance(TIMING.fence + 0.1)
    assert state.suspect() and state.check_fence() is not None


def test_candidate_hosts_need_a_lease_ttl_that_outlasts_the_hold() -> None:
    with pytest.raises(ConfigError) as err:
        launch("a:1,b:1,c:1", "--rdzv-conf=lease_ttl=2")
    assert "lease_ttl" in str(err.value) and "at least 3" in str(err.value)
    assert 2 * TIMING.suspect <= 3.0


def test_a_vote_from_a_node_with_another_candidate_list_is_not_taken() -> None:
    from elastrun.store.server import StoreServer
    from elastrun.store.term import list_digest

    listed = ["127.0.0.1:1", "127.0.0.2:1", "127.0.0.3:1"]
    state = TermState(1, 3, timing=TIMING)
    server = StoreServer(["127.0.0.2"], 1, failover=state, candidates=listed)
    reordered = list_digest("127.0.0.1:1,127.0.0.3:1,127.0.0.2:1")
    assert not server.term_vote({"term": 1, "voter": 2, "list": reordered})["won"]
    assert not server.term_vote({"term": 1, "voter": 2})["won"]  # no list: not taken
    assert not server.elect_self(1)  # its own vote, with its own list: 1 of 3
    assert server.term_vote({"term": 1, "voter": 2, "list": list_digest(",".join(listed))})["won"]
    assert state.role is Role.HOST and state.term == 1


def test_a_host_that_stepped_down_stands_by_again_once_it_learns_a_newer_term() -> None:
    """Issue 37 item 0: a stalled host steps down; once it learns the newer
    term's host it stands by again and can be elected in a later term, never
    in its own or the learned one."""
    clock = FakeClock()
    state = host(3, clock)
    state.heard_from(1)
    assert state.check_fence() is None
    clock.advance(10.0)  # a stall: it heard from nobody
    assert state.check_fence() is not None
    assert state.role.value == "fenced"
    assert not state.learn(1, 0)  # not newer: still stepped down
    assert not state.receive_vote(2, 1)
    assert state.learn(2, 1)
    assert (state.role, state.term, state.host, state.armed) == (Role.STANDBY, 2, 1, False)
    assert not state.receive_vote(2, 2)  # the learned term is taken
    assert not state.receive_vote(3, 1) and state.receive_vote(3, 2)
    assert (state.role.value, state.term) == ("host", 3)
