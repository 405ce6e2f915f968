"""The verdict rule over the job's fault history (rendezvous/verdict.py): a table
of histories and their verdicts, and a seeded randomized check that failures on
random nodes never lead to an exclusion the rule does not allow."""

from __future__ import annotations

import random

import pytest

from elastrun.failure import BROKEN_COLLECTIVE, ERROR, HANG, SIGNAL
from elastrun.rendezvous.fault_history import FaultEntry
from elastrun.rendezvous.verdict import STEP_TOLERANCE, Verdict, VerdictKind, judge

NODE, SCRIPT, TRANSIENT = VerdictKind.NODE, VerdictKind.SCRIPT, VerdictKind.TRANSIENT


def error(r: int, host: str, rank: int, exc: str, msg: str, step: int | None) -> FaultEntry:
    """A rank's own exception (exit code 1)."""
    return FaultEntry(r, host, rank, ERROR, True, 1, None, exc, msg, step)


def bug(r: int, host: str, step: int | None = 5, rank: int = 1) -> FaultEntry:
    """A Python exception of the script (the same every time)."""
    return error(r, host, rank, "ValueError", "bad batch", step)


def gpu(r: int, host: str, step: int | None = None, rank: int = 2, msg: str = "ECC") -> FaultEntry:
    """A node's hardware error: the same exception type, its message may vary."""
    return error(r, host, rank, "RuntimeError", f"CUDA error: {msg}", step)


def killed(r: int, host: str, sig: str = "SIGBUS", rank: int = 0) -> FaultEntry:
    return FaultEntry(round=r, host=host, rank=rank, kind=SIGNAL, own=True, signal=sig)


def collateral(r: int, host: str) -> FaultEntry:
    """A rank whose collective a peer's crash broke (never its node's fault)."""
    return FaultEntry(
        round=r,
        host=host,
        rank=0,
        kind=BROKEN_COLLECTIVE,
        own=False,
        exitcode=1,
        exception="RuntimeError",
        message="Connection closed by peer",
    )


CASES: list[tuple[str, list[FaultEntry], VerdictKind, str]] = [
    ("no failure", [], TRANSIENT, ""),
    ("one failure", [bug(0, "a")], TRANSIENT, ""),
    ("same bug, same rank and step, one node", [bug(0, "a"), bug(1, "a")], SCRIPT, "a"),
    ("same bug on whichever node holds the rank", [bug(0, "a"), bug(2, "s")], SCRIPT, "s"),
    (
        "same bug, steps within the tolerance",
        [bug(0, "a", 5), bug(1, "a", 5 + STEP_TOLERANCE)],
        SCRIPT,
        "a",
    ),
    (
        "same exception, other steps, one node: the node",
        [bug(0, "a", 5), bug(1, "a", 50)],
        NODE,
        "a",
    ),
    (
        "same exception, step unknown, one node: the node",
        [bug(0, "a", None), bug(1, "a", None)],
        NODE,
        "a",
    ),
    (
        "same exception, other steps, other nodes: transient",
        [bug(0, "a", 5), bug(1, "b", 50)],
        TRANSIENT,
        "",
    ),
    ("same bug in another rank", [bug(0, "a", rank=1), bug(1, "a", rank=2)], NODE, "a"),
    (
        "same bug, another rank on another node",
        [bug(0, "a", rank=1), bug(1, "b", rank=2)],
        TRANSIENT,
        "",
    ),
    (
        "a node's errors, messages differ",
        [gpu(0, "c", msg="ECC"), gpu(1, "c", msg="Xid 79")],
        NODE,
        "c",
    ),
    ("a node's signals", [killed(0, "c"), killed(1, "c")], NODE, "c"),
    ("a node's signals of other kinds", [killed(0, "c"), killed(1, "c", "SIGSEGV")], TRANSIENT, ""),
    ("signals on two nodes", [killed(0, "c"), killed(1, "d")], TRANSIENT, ""),
    (
        "a hang then a signal",
        [FaultEntry(0, "c", 0, HANG, True), killed(1, "c")],
        TRANSIENT,
        "",
    ),
    ("collateral twice", [collateral(0, "b"), collateral(1, "b")], TRANSIENT, ""),
    ("collateral breaks a run", [killed(0, "c"), collateral(1, "c")], TRANSIENT, ""),
    ("only the last two count", [killed(0, "d"), killed(1, "c"), killed(2, "c")], NODE, "c"),
    ("a bug after another node's fault", [killed(0, "c"), bug(1, "a")], TRANSIENT, ""),
    (
        "exit codes alike on one node",
        [FaultEntry(0, "c", 0, ERROR, True, exitcode=3), FaultEntry(1, "c", 0, ERROR, True, 3)],
        NODE,
        "c",
    ),
]


@pytest.mark.parametrize(("label", "history", "kind", "host"), CASES, ids=[c[0] for c in CASES])
def test_the_verdict_of_each_history(
    label: str, history: list[FaultEntry], kind: VerdictKind, host: str
) -> None:
    verdict = judge(history, 2)
    assert verdict.kind is kind, label
    if kind is not TRANSIENT:
        assert verdict.host == host
        assert verdict.rounds == tuple(e.round for e in history[-2:])


def test_a_script_fault_names_the_exception_the_rank_and_the_step() -> None:
    verdict = judge([bug(0, "a", 7), bug(1, "a", 7)], 2)
    assert verdict.summary() == (
        "script fault: ValueError: bad batch in rank 1 at step 7, 2 identical failures (last on a)"
    )
    node = judge([killed(0, "c"), killed(1, "c")], 2)
    assert node.summary() == "node fault: node c failed 2 times in a row (killed by SIGBUS)"


def test_the_limit_counts_identical_failures_and_zero_turns_it_off() -> None:
    history = [bug(0, "a"), bug(1, "a"), bug(2, "a")]
    assert judge(history[:2], 3).kind is TRANSIENT
    assert judge(history, 3).kind is SCRIPT
    assert judge(history, 1).kind is SCRIPT
    assert judge(history, 0).kind is TRANSIENT
    assert judge([killed(0, "c")], 1).kind is NODE


def allowed_exclusion(history: list[FaultEntry], limit: int, verdict: Verdict) -> bool:
    """What the rule allows, stated independently: a node is excluded only when
    the last ``limit`` root causes were all its own failures, of one class,
    not a script's repeatable bug."""
    last = history[-limit:]
    return (
        len(history) >= limit
        and all(e.own and e.host == verdict.host for e in last)
        and len({(e.kind, e.exception, e.exitcode, e.signal) for e in last}) == 1
    )


def random_entry(rng: random.Random, r: int, hosts: list[str]) -> FaultEntry:
    host = rng.choice(hosts)
    how = rng.random()
    if how < 0.3:
        return collateral(r, host)
    if how < 0.55:
        return killed(r, host, rng.choice(["SIGKILL", "SIGBUS"]), rank=rng.randrange(4))
    if how < 0.8:
        return gpu(r, host, rng.choice([None, rng.randrange(100)]), rank=rng.randrange(4))
    return bug(r, host, rng.choice([None, 5, 6, 40]), rank=rng.randrange(2))


@pytest.mark.parametrize("seed", range(8))
def test_failures_on_random_nodes_exclude_no_node_beyond_the_rule(seed: int) -> None:
    """Seeded random histories (failures on random nodes, collateral ones among
    them): every node-fault verdict is one the rule allows; no collateral
    failure ever counts; the verdict depends only on the last ``limit`` entries."""
    rng = random.Random(seed)
    hosts = [f"n{i}" for i in range(rng.randint(2, 6))]
    excluded = 0
    for _trial in range(300):
        limit = rng.randint(1, 4)
        history = [random_entry(rng, r, hosts) for r in range(rng.randint(0, 10))]
        verdict = judge(history, limit)
        if verdict.kind is NODE:
            excluded += 1
            assert allowed_exclusion(history, limit, verdict), (history, limit)
        if any(not e.own for e in history[-limit:]):
            assert verdict.kind is TRANSIENT
        older = [random_entry(rng, -1 - i, hosts) for i in range(3)][::-1]
        assert judge(older + history, limit).kind is verdict.kind or len(history) < limit
    assert excluded > 0  # the check ran on exclusions, not only on transients
