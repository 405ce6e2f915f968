"""The ranks' agreement on a memory checkpoint step, with the replicas that
the agents hold of their neighbour node's snapshots (train/memory_load.agree)."""

from __future__ import annotations

from elastrun.train.memory_load import Held, agree


def held(own: dict[int, int], replicas: dict[tuple[int, int], int] | None = None) -> Held:
    return Held(own, replicas or {})


def test_every_rank_with_its_own_copy_agrees_on_the_highest_common_step() -> None:
    assert agree([held({12: 9, 11: 9, 10: 9}), held({11: 9, 10: 9})], shared=False) == (11, {})


def test_a_new_rank_takes_its_state_from_the_node_holding_its_replica() -> None:
    # rank 1's node was replaced: its state at step 10 is rank 0's node's replica
    survivor = held({12: 100, 11: 100, 10: 100}, {(1, 10): 120})
    assert agree([survivor, held({})], shared=False) == (10, {1: (0, 120)})


def test_an_older_replica_than_the_survivors_hold_is_no_step_at_all() -> None:
    # the survivor no longer holds step 5: nothing in memory (the disk rule follows)
    assert agree([held({12: 1, 11: 1, 10: 1}, {(1, 5): 1}), held({})], shared=False) is None


def test_a_replica_of_another_rank_does_not_stand_in_for_a_rank() -> None:
    assert agree([held({10: 1}, {(2, 10): 1}), held({})], shared=False) is None


def test_a_rank_that_holds_its_own_replica_loads_it_itself() -> None:
    assert agree([held({10: 1}), held({}, {(1, 10): 7})], shared=False) == (10, {1: (1, 7)})


def test_shared_state_prefers_a_rank_s_own_copy_to_a_replica() -> None:
    got = agree([held({}, {(3, 10): 5}), held({10: 6}), held({})], shared=True)
    assert got == (10, {0: (1, 6), 2: (1, 6)})
    assert agree([held({}, {(3, 10): 5}), held({})], shared=True) == (10, {0: (0, 5), 1: (0, 5)})
