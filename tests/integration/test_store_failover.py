"""The job outlives its store's host: three candidate hosts, the host's agent
SIGKILLed, the survivors train again (docs/failover.md).

Three agents on one machine, told apart by loopback addresses
(``--local-addr`` 127.0.0.1/.2/.3), each a candidate host of
``--rdzv-endpoint 127.0.0.1:P,127.0.0.2:P,127.0.0.3:P``. The first hosts the
store (term 1). A worker crash first spends one restart (so the count has
something to carry). Then the host's agent is SIGKILLed with its workers:
the two others vote, the second candidate takes over (term 2), and they
train again at world 2 under the same run id, with the restart count carried
(not reset, and the node loss not charged), from the checkpoint. The lease
TTL and ``read_timeout`` are an hour: whatever the survivors did within the
test's bounded wait, they did by the failover.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from elastrun.event_kinds import parse_event
from elastrun.store.term import list_digest
from tests.helpers import pid_alive, port_on_every, soak_or, wait_for
from tests.integration.elastic_harness import (
    BOUND,
    ELASTRUN,
    Job,
    check_finished,
    crash_and_train_again,
    job,
    steps_after,
)

HOUR = 3600


def flags(port: int, me: int, events: Path, *, nnodes: str = "2:3", timeout: int = 60) -> list[str]:
    return [
        f"--nnodes={nnodes}",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port},127.0.0.2:{port},127.0.0.3:{port}",
        f"--local-addr=127.0.0.{me}",
        "--rdzv-id=failover-job",
        "--max-restarts=3",
        f"--rdzv-conf=last_call_timeout=1,lease_ttl={HOUR},join_timeout=120,"
        f"read_timeout={HOUR},failover_timeout={timeout}",
        "--shutdown-timeout=5",
        f"--events-file={events}",
    ]


def status(port: int) -> dict[str, Any]:
    """``elastrun status --json`` with the candidate list, as an operator runs it."""
    endpoint = f"127.0.0.1:{port},127.0.0.2:{port},127.0.0.3:{port}"
    proc = subprocess.run(
        [*ELASTRUN, "status", "--rdzv-endpoint", endpoint, "--rdzv-id", "failover-job", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    # every line is an event of the catalogue (elastrun/event_kinds.py)
    assert [e for e in out if parse_event(e) is None] == []
    return out


def test_a_node_with_another_candidate_list_is_refused_naming_it(tmp_path: Path) -> None:
    # The refusal is the rendezvous's (the candidate list is one of the job's
    # settings): the job waits for its third node, so no worker starts, and
    # no warm interpreter imports torch for one.
    port = port_on_every()
    with job(tmp_path) as j:
        a = j.start_agent(
            "n1", [*flags(port, 1, tmp_path / "ev1.jsonl", nnodes="3:3"), "--no-warm"]
        )
        j.start_agent("n3", [*flags(port, 3, tmp_path / "ev3.jsonl", nnodes="3:3"), "--no-warm"])
        wait_for(lambda: "hosts the store from term 1" in a.output(), BOUND, "n1 hosting the store")
        other = [*flags(port, 2, tmp_path / "ev2.jsonl", nnodes="3:3"), "--no-warm"]
        reordered = f"--rdzv-endpoint=127.0.0.1:{port},127.0.0.3:{port},127.0.0.2:{port}"
        other = [reordered if f.startswith("--rdzv-endpoint=") else f for f in other]
        b = j.start_agent("n2", other)
        assert b.wait(BOUND) != 0
        out = b.output()
        assert "candidates: job has" in out, out[-3000:]
        assert "Traceback" not in out


def test_a_candidate_that_never_answers_at_start_is_reported_and_not_waited_for_forever(
    tmp_path: Path,
) -> None:
    """Nothing listens at the first candidate (whose agent never starts) and the second
    stands by: the node reports the unreachable candidate and which answered what, and,
    alone no majority of the candidates, gives up at the join timeout (here 12 s) naming
    them."""
    port = port_on_every()
    with job(tmp_path) as j:
        argv = flags(port, 2, tmp_path / "ev2.jsonl", nnodes="2:3")
        argv = [
            f.replace("join_timeout=120", "join_timeout=12") if f.startswith("--rdzv-conf=") else f
            for f in argv
        ]
        b = j.start_agent("n2", argv)
        assert b.wait(BOUND) != 0
        out = b.output()
        assert "waiting for the store's host among" in out, out[-3000:]
        assert f"127.0.0.1:{port} refused" in out, out[-3000:]
        assert f"127.0.0.2:{port} stands by" in out, out[-3000:]
        # Passed over once unreachable for a while; alone it is no majority.
        assert f"candidate host 127.0.0.1:{port} has been unreachable" in out, out[-3000:]
        assert "no candidate host of the store serves term 1" in out, out[-3000:]
        assert "Traceback" not in out


# Stalls of whichever candidate hosts, one after another: two show that a
# stalled host, continued, stands by again and so counts towards the next
# takeover's majority; ``make soak`` runs three.
STALLS = soak_or(2, 3)


def takeovers(tmp_path: Path) -> list[tuple[int, int]]:
    """(term, node) of every store takeover in the three nodes' event logs."""
    return [
        (e["term"], n)
        for n in (1, 2, 3)
        for e in events(tmp_path / f"ev{n}.jsonl")
        if e["kind"] == "store_takeover"
    ]


def stall_each_host(j: Job, tmp_path: Path, agents: list[Any]) -> None:
    """The hosting candidate's agent SIGSTOPped, ``STALLS`` times, each time
    until a standby has taken over (as long as the failover needs: silence,
    then the vote; the stall of a GC or swap pause that outlasts it). Each
    stalled host, continued, steps down, finds the new host and stands by
    again (docs/failover.md), so the next stall still finds a majority: the
    job is back at world 3 after each, as with one endpoint. ``agents``: by
    node (n1, n2, n3)."""
    stalled = []
    for stall in range(1, STALLS + 1):
        term, hosting = max(takeovers(tmp_path))
        agent = agents[hosting - 1]
        old = {s["pid"] for s in j.steps()}

        def taken_over(term: int = term) -> bool:
            return max(takeovers(tmp_path))[0] > term

        agent.kill_group(signal.SIGSTOP)
        try:
            wait_for(taken_over, BOUND, f"a takeover while n{hosting} is stopped ({stall})")
        finally:
            agent.kill_group(signal.SIGCONT)

        def back(old: set[int] = old) -> bool:
            fresh = [s for s in j.steps() if s["pid"] not in old and s["world"] == 3]
            return len(fresh) >= 3 * 2  # every rank of a new world-3 group stepped

        continued = time.monotonic()
        wait_for(back, BOUND, f"training at world 3 after stall {stall} of host n{hosting}")
        took_s = time.monotonic() - continued
        print(f"stall {stall} of n{hosting}: world 3 {took_s:.1f} s after SIGCONT")
        stalled.append(agent)
    for agent in stalled:  # each stepped down, then stood by again
        assert "stands by again" in agent.output(), agent.output()[-3000:]


@pytest.mark.slow
def test_the_job_starts_without_the_first_candidate_which_joins_it_late_then_survives_stalls(
    tmp_path: Path,
) -> None:
    """The first candidate's node is down at start: the two others pass it
    over once it has been unreachable for a while (reported), elect the
    second candidate host of term 1, and train at world 2. The first
    candidate's agent started afterwards finds that host through the list
    and joins the job as a member (its store stands by): world 3, one host.
    Then stalls of whichever candidate hosts (``stall_each_host``) each end
    back at world 3, and the job finishes."""
    port = port_on_every()
    with job(tmp_path) as j:
        b = j.start_agent("n2", flags(port, 2, tmp_path / "ev2.jsonl"))
        c = j.start_agent("n3", flags(port, 3, tmp_path / "ev3.jsonl"))
        wait_for(lambda: any(s["world"] == 2 for s in j.steps()), BOUND, "training at world 2")
        assert f"127.0.0.2:{port} hosts the store from term 1" in b.output(), b.output()[-3000:]
        for n, agent in ((2, b), (3, c)):
            out = agent.output()
            assert f"candidate host 127.0.0.1:{port} has been unreachable" in out, out[-3000:]
            gone = [
                e
                for e in events(tmp_path / f"ev{n}.jsonl")
                if e["kind"] == "store_candidate_unreachable"
            ]
            assert [e["candidate"] for e in gone] == [f"127.0.0.1:{port}"], gone

        mark = len(j.steps())
        a = j.start_agent("n1", flags(port, 1, tmp_path / "ev1.jsonl"))
        wait_for(lambda: steps_after(j, mark, lambda s: s["world"] == 3), BOUND, "world 3 with n1")
        assert "stands by to host the store" in a.output()
        assert "hosts the store" not in a.output().replace("stands by to host the store", "")
        took = [e for n in (1, 2, 3) for e in events(tmp_path / f"ev{n}.jsonl")
                if e["kind"] == "store_takeover"]  # fmt: skip
        assert [(e["candidate"], e["term"]) for e in took] == [(f"127.0.0.2:{port}", 1)], took
        seen = status(port)
        assert seen["store_hosts"]["host"] == f"127.0.0.2:{port}"
        assert seen["store_hosts"]["term"] == 1
        assert f"127.0.0.1:{port}" in seen["store_hosts"]["standbys"], seen

        # The same job, at world 3 with every candidate: its hosts stalled in turn.
        stall_each_host(j, tmp_path, [a, b, c])
        check_finished(j, tmp_path, a, b, c)


def test_a_candidate_restarted_after_voting_does_not_vote_again_in_that_term(
    tmp_path: Path,
) -> None:
    """The second candidate starts alone: the first is down, so it votes for
    itself in term 1 (no majority: the third never comes). It is SIGKILLed
    and started again beside the first candidate. Its vote is kept on disk:
    it may not vote for the first candidate in term 1 as well, so the first
    candidate is elected in term 2 (a second vote in term 1 would have
    elected it there at once)."""
    port = port_on_every()
    with job(tmp_path) as j:
        # It only votes (no round forms without a majority): no warm interpreter.
        b = j.start_agent("n2", [*flags(port, 2, tmp_path / "ev2.jsonl"), "--no-warm"])
        voted = (tmp_path / "ev2.jsonl", f"127.0.0.2:{port}")

        def voted_for_itself() -> bool:
            return any(e["kind"] == "store_vote" and e["term"] == 1 and e["candidate"] == voted[1]
                       for e in events(voted[0]))  # fmt: skip

        wait_for(voted_for_itself, BOUND, "n2 voting for itself in term 1")
        b.kill_group()
        b.proc.wait(30)
        a = j.start_agent("n1", flags(port, 1, tmp_path / "ev1.jsonl"))
        wait_for(lambda: "stands by to host" in a.output(), BOUND, "n1 standing by")
        b2 = j.start_agent("n2-again", flags(port, 2, tmp_path / "ev2b.jsonl"))
        wait_for(lambda: any(s["world"] == 2 for s in j.steps()), BOUND, "training at world 2")
        votes = [(e["term"], e["candidate"]) for e in events(tmp_path / "ev2b.jsonl")
                 if e["kind"] == "store_vote"]  # fmt: skip
        assert votes and all(term >= 2 for term, _ in votes), votes
        took = [e for e in events(tmp_path / "ev1.jsonl") if e["kind"] == "store_takeover"]
        assert [e["term"] for e in took] == [2], took
        check_finished(j, tmp_path, a, b2)


def _fifo(ballot: Path, tmp_path: Path) -> Path | None:
    ballot.parent.mkdir(parents=True, mode=0o700)
    os.mkfifo(ballot)
    return None


def _huge_term(ballot: Path, tmp_path: Path) -> Path | None:
    ballot.parent.mkdir(parents=True, mode=0o700)
    ballot.write_text(json.dumps({"term": 2**53, "candidate": 1}))
    return None


def _linked_failover_in_another_users_cache(ballot: Path, tmp_path: Path) -> Path | None:
    cache = ballot.parents[2]
    target = tmp_path / f"root-only-{ballot.name}"
    target.mkdir(mode=0o700)
    cache.mkdir(mode=0o755)
    (cache / "failover").symlink_to(target)
    os.lchown(cache / "failover", OTHER_UID, OTHER_UID)
    os.chown(cache, OTHER_UID, OTHER_UID)
    return target


def _link_to_a_root_file(ballot: Path, tmp_path: Path) -> Path | None:
    ballot.parent.mkdir(parents=True, mode=0o700)
    secret = tmp_path / f"root-file-{ballot.name}"
    secret.write_text(json.dumps({"term": 7, "candidate": 2}))
    secret.chmod(0o600)
    ballot.symlink_to(secret)
    return None


def _ten_megabytes(ballot: Path, tmp_path: Path) -> Path | None:
    ballot.parent.mkdir(parents=True, mode=0o700)
    ballot.write_bytes(b" " * (10 << 20))
    return None


def _corrupt_json(ballot: Path, tmp_path: Path) -> Path | None:
    ballot.parent.mkdir(parents=True, mode=0o700)
    ballot.write_bytes(b'{"term": 3, "candidate": ')
    return None


def _another_users_failover_folder(ballot: Path, tmp_path: Path) -> Path | None:
    ballot.parents[1].mkdir(parents=True, mode=0o700)
    os.chown(ballot.parents[1], OTHER_UID, OTHER_UID)
    return None


def _linked_run_folder(ballot: Path, tmp_path: Path) -> Path | None:
    ballot.parents[1].mkdir(parents=True, mode=0o700)
    target = tmp_path / f"elsewhere-{ballot.name}"
    target.mkdir(mode=0o700)
    ballot.parent.symlink_to(target)
    return target


OTHER_UID = 65534  # nobody: another user (these tests run as root)
Plant = Any  # (the ballot's path, tmp_path) -> a folder that must stay empty, or None


# Three plants a job (one a candidate). Each plant alone is refused in
# tests/unit/test_failover_ballot.py; here real agents with them fail over.
# ``make test`` runs the first job (the FIFO on the host, the term 2^53 on a
# standby that votes in the failover, the linked folder in another user's
# cache); ``make soak`` the other two as well.
PLANTED = [
    pytest.param((_fifo, _huge_term, _linked_failover_in_another_users_cache), id="a"),
    *soak_or(
        [],
        [
            pytest.param((_link_to_a_root_file, _ten_megabytes, _corrupt_json), id="b"),
            pytest.param(
                (_another_users_failover_folder, _linked_run_folder, _corrupt_json), id="c"
            ),
        ],
    ),
]


# Under root, the survivors' job runs with planted ballots (every plant that
# needs no root is refused the same way in tests/unit/test_failover_ballot.py,
# and the takeovers of the stalls and the vote kept across a restart above
# use ballots on disk); otherwise it runs with none.
SURVIVORS = PLANTED if os.geteuid() == 0 else [pytest.param(None, id="unplanted")]


@pytest.mark.slow
@pytest.mark.parametrize("plants", SURVIVORS)
def test_survivors_train_at_world_2_after_the_store_host_is_killed(
    tmp_path: Path, plants: tuple[Plant, Plant, Plant] | None
) -> None:
    """Three candidates train at world 3; a worker crash spends one restart;
    the store's host is SIGKILLed: the standbys fail over (term 2) and train
    at world 2, the same job, its restart count carried.

    Planted or damaged ballots (as root): each candidate's --warm-cache holds
    one (a FIFO, a record with term 2^53 on a standby that votes in the
    failover, another user's cache whose ``failover`` links to a root-only
    folder; under ``make soak`` also a link to a root file, 10 MB, corrupt
    JSON, another user's ``failover`` folder, a linked run folder). Each
    agent says in one line that it keeps its votes in memory; nothing is
    written through a link; the job forms and fails over all the same."""
    port = port_on_every()
    digest = list_digest(f"127.0.0.1:{port},127.0.0.2:{port},127.0.0.3:{port}")
    untouched = []
    with job(tmp_path) as j:
        agents = []
        for me in (1, 2, 3):
            argv = flags(port, me, tmp_path / f"ev{me}.jsonl")
            if plants is not None:
                cache = tmp_path / f"cache{me}"
                ballot = cache / "failover" / "failover-job" / f"ballot-{digest}-{me - 1}.json"
                untouched.append(plants[me - 1](ballot, tmp_path))
                argv.append(f"--warm-cache={cache}")
            agents.append(j.start_agent(f"n{me}", argv))
        wait_for(lambda: any(s["world"] == 3 for s in j.steps()), BOUND, "training at world 3")
        a, b, c = agents
        assert "hosts the store from term 1" in a.output(), a.output()[-3000:]
        assert "stands by" in b.output() and "stands by" in c.output()

        # One restart spent before the loss: the count the survivors carry.
        crash_and_train_again(j, 3)
        host_pids = {s["pid"] for s in j.steps() if s["group_rank"] == 0 and s["restart"] == 1}
        before = status(port)
        assert before["store_hosts"]["host"] == f"127.0.0.1:{port}"
        assert before["store_hosts"]["term"] == 1
        assert len(before["store_hosts"]["standbys"]) == 2
        step_before = max(s["step"] for s in j.steps())

        mark = len(j.steps())
        a.kill_group()
        wait_for(
            lambda: steps_after(j, mark, lambda s: s["world"] == 2),
            BOUND,
            "training at world 2 after the store's host was killed",
        )
        after = steps_after(j, mark, lambda s: s["world"] == 2)
        # Same job, restart count carried: not reset to 0, the loss not charged.
        assert {s["restart"] for s in after} == {1}, after
        # Resumed from the checkpoint: no step before the one the job had reached.
        assert min(s["step"] for s in after) >= step_before - 1
        assert not any(pid_alive(p) for p in host_pids), "the killed host's workers survived"
        for agent in (b, c):
            out = agent.output()
            assert "lost the store's host 127.0.0.1" in out, out[-3000:]
            assert "the store's host is now 127.0.0.2" in out, out[-3000:]
        took = [e for e in events(tmp_path / "ev2.jsonl") if e["kind"] == "store_takeover"]
        assert took and took[-1]["term"] == 2, took
        run_ids = {e["run_id"] for n in (2, 3) for e in events(tmp_path / f"ev{n}.jsonl")}
        assert run_ids == {"failover-job"}
        after_ = status(port)  # the same command finds the job at its new host
        assert after_["store_hosts"]["host"] == f"127.0.0.2:{port}"
        assert after_["store_hosts"]["term"] == 2
        assert after_["store_hosts"]["others"] == [f"127.0.0.1:{port} (refused)"]
        assert after_["restarts"] == 1 and after_["world_size"] == 2

        j.touch("finish")
        for agent in (b, c):
            assert agent.wait(BOUND) == 0, agent.output()[-3000:]
        assert not any(pid_alive(s["pid"]) for s in j.steps())
        if plants is not None:
            for agent in agents:
                out = agent.output()
                lines = [line for line in out.splitlines() if "kept in memory only" in line]
                assert len(lines) == 1, out[-3000:]
    for folder in untouched:
        assert folder is None or list(folder.iterdir()) == [], folder
