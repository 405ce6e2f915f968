"""The hot-spare fault test's checker (tests/faults/spares_check.py) finds
each breach it is meant to find, and passes a sound run."""

from __future__ import annotations

from typing import Any

from tests.faults.spares_check import Faults, violations

Log = dict[str, list[dict[str, Any]]]


def ev(kind: str, ts: float, node: str, **fields: Any) -> dict[str, Any]:
    return {"kind": kind, "ts": ts, "node_id": node, **fields}


def sound() -> Log:
    """a, b train (ranks 0, 1); b is SIGKILLed at 10; the spare s takes rank 1."""
    return {
        "a": [
            ev("round_closed", 1.0, "a", round=0, ranks={"a": 0, "b": 1}),
            ev("round_joined", 1.0, "a", round=0, group_rank=0, group_world_size=2),
            ev("workers_started", 2.0, "a", round=0, pids=[100]),
            ev("worker_exited", 10.5, "a", pid=100),
            ev("round_closed", 11.0, "a", round=1, ranks={"a": 0, "s": 1}),
            ev("round_joined", 11.0, "a", round=1, group_rank=0, group_world_size=2),
            ev("workers_started", 11.2, "a", round=1, pids=[101]),
            ev("worker_exited", 20.0, "a", pid=101),
        ],
        "b": [
            ev("round_joined", 1.0, "b", round=0, group_rank=1, group_world_size=2),
            ev("workers_started", 2.0, "b", round=0, pids=[200]),
        ],
        "s": [
            ev("node_waiting", 5.0, "s", round=0, spare=True),
            ev("round_joined", 11.0, "s", round=1, group_rank=1, group_world_size=2),
            ev("spare_promoted", 11.0, "s", round=1, group_rank=1, replaces="b"),
            ev("workers_started", 11.1, "s", round=1, pids=[300]),
            ev("worker_exited", 20.0, "s", pid=300),
        ],
    }


KILLED = Faults(killed={"b": 10.0})


def test_a_sound_run_passes() -> None:
    assert violations(sound(), KILLED, {2}) == []


def test_a_world_of_a_size_not_allowed_is_found() -> None:
    log = sound()
    log["s"][1]["group_world_size"] = 3
    assert any("world of 3 nodes" in v for v in violations(log, KILLED, {2}))


def test_a_spare_on_the_wrong_rank_and_a_moved_survivor_are_found() -> None:
    log = sound()
    log["a"][4]["ranks"] = {"a": 1, "s": 0}
    log["a"][5]["group_rank"] = 1
    log["s"][1]["group_rank"] = 0
    found = violations(log, KILLED, {2})
    assert any("survivor a moved from rank 0 to 1" in v for v in found), found
    assert any("s (new) took rank 0" in v for v in found), found


def test_a_promotion_that_names_the_wrong_member_is_found() -> None:
    log = sound()
    log["s"][2]["replaces"] = "a"
    assert any("says it replaces a" in v for v in violations(log, KILLED, {2}))


def test_two_generations_at_once_are_found_unless_the_old_one_was_cut_off() -> None:
    log = sound()
    log["a"][3]["ts"] = 12.0  # a's round-0 workers outlive the start of round 1
    found = violations(log, KILLED, {2})
    assert any("two generations at once: a's round 0" in v for v in found), found
    cut = Faults(killed={"b": 10.0}, cut={"a": [(9.0, 13.0)]})
    assert violations(log, cut, {2}) == []


def test_workers_that_never_ended_are_found() -> None:
    found = violations(sound(), Faults(), {2})  # b was not killed: its workers never ended
    assert any("b: workers of round 0 never ended" in v for v in found), found


def test_a_node_that_registers_again_while_its_old_workers_run_is_found() -> None:
    """b, cut off, lost its lease; it may register again (lease_regained) only
    once its round-0 workers are gone."""
    log = sound()
    cut = Faults(cut={"b": [(9.0, 14.0)]})
    log["b"].append(ev("worker_exited", 12.0, "b", pid=200))
    log["b"].append(ev("lease_regained", 14.5, "b", lost="store unreachable"))
    assert violations(log, cut, {2}) == []
    log["b"][-1]["ts"] = 11.0  # before its worker's exit
    found = violations(log, cut, {2})
    assert any("b registered again at 11.000 while its workers of round 0" in v for v in found)
