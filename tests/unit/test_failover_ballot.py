"""A candidate's ballot in the store's failover elections (store/ballot.py):
one candidate per term, votes only go up, kept on disk so that a restarted
agent cannot vote twice in one term, and a vote in a new term waits."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from elastrun.clock import FakeClock
from elastrun.store.ballot import MAX_BALLOT_BYTES, Ballot, BallotError, ballot_path

WAIT = 4.0  # the failover's vote_after
LIST = "127.0.0.1:29400,127.0.0.2:29400,127.0.0.3:29400"


def test_a_restarted_voter_does_not_vote_for_another_candidate_in_the_same_term(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    path = ballot_path(str(tmp_path), "job-7", LIST, 1)
    first = Ballot.load(path, 3, clock)
    clock.advance(WAIT)
    assert first.vote(2, 1, WAIT)
    # The agent is killed and started again: the record is read back.
    again = Ballot.load(path, 3, clock)
    assert (again.term, again.candidate) == (2, 1)
    assert not again.vote(2, 2, WAIT)  # another candidate in the term it voted in
    assert again.vote(2, 1, WAIT)  # the same vote again is no second vote
    assert not again.vote(1, 0, WAIT)  # never back to an older term
    # A newer term only one vote_after after the restart: the host it may
    # have been heard by (before it was killed) has fenced by then.
    assert not again.vote(3, 2, WAIT)
    clock.advance(WAIT)
    assert again.vote(3, 2, WAIT)
    assert json.loads(Path(path).read_text()) == {"term": 3, "candidate": 2}


def test_votes_in_a_new_term_wait_after_the_previous_vote_but_the_ordinary_start_does_not(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    ballot = Ballot(str(tmp_path / "b.json"), 3, clock)
    assert ballot.vote(1, 0, WAIT)  # term 1 for the first candidate: at once
    assert not ballot.vote(2, 0, WAIT)
    assert ballot.wait_left(WAIT) == WAIT
    clock.advance(WAIT)
    assert ballot.vote(2, 1, WAIT)
    fresh = Ballot(None, 3, clock)
    assert not fresh.vote(1, 1, WAIT)  # term 1 for another: one vote_after from the start
    clock.advance(WAIT)
    assert fresh.vote(1, 1, WAIT)


def test_the_record_folder_is_private_and_each_candidate_keeps_its_own(tmp_path: Path) -> None:
    cache = tmp_path / "cache"  # missing: created on the way
    paths = {ballot_path(str(cache), "job-7", LIST, i) for i in range(3)}
    assert len(paths) == 3
    assert ballot_path(str(cache), "job-7", "a:1,b:1", 0) not in paths  # another list
    folder = Path(next(iter(paths))).parent
    assert folder == cache / "failover" / "job-7"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700


@pytest.mark.parametrize(
    "content",
    [
        b"not json",
        b'{"term": 2}',
        b'{"term": 2, "candidate": 3}',  # no such candidate in a list of 3
        b'{"term": 0, "candidate": 1}',
        b'{"term": true, "candidate": 1}',
        b'{"term": 2, "candidate": 1, "extra": 1}',
        b" " * (MAX_BALLOT_BYTES + 1),
    ],
    ids=["not-json", "missing", "out-of-list", "term-0", "bool", "extra", "too-large"],
)
def test_a_record_that_is_not_a_ballot_is_refused_naming_the_file(
    tmp_path: Path, content: bytes
) -> None:
    path = tmp_path / "ballot.json"
    path.write_bytes(content)
    with pytest.raises(BallotError) as err:
        Ballot.load(str(path), 3)
    assert str(path) in str(err.value)


def test_a_link_or_a_fifo_at_the_record_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps({"term": 9, "candidate": 0}))
    link = tmp_path / "link.json"
    link.symlink_to(target)
    with pytest.raises(BallotError):
        Ballot.load(str(link), 3)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(BallotError):  # refused at once, never blocked
        Ballot.load(str(fifo), 3)


def test_a_record_that_cannot_be_written_casts_no_vote(tmp_path: Path) -> None:
    clock = FakeClock()
    ballot = Ballot(str(tmp_path / "missing-folder" / "b.json"), 3, clock)
    with pytest.raises(BallotError) as err:
        ballot.vote(1, 0, WAIT)
    assert "cannot be written" in str(err.value)
    assert ballot.term == 0  # not cast


def test_forget_removes_the_record(tmp_path: Path) -> None:
    path = ballot_path(str(tmp_path), "job-7", LIST, 0)
    ballot = Ballot.load(path, 3)
    assert ballot.vote(1, 0, WAIT)
    assert os.path.exists(path)
    ballot.forget()
    assert not os.path.exists(path)
    assert Ballot.load(path, 3).term == 0


OTHER_UID = 65534  # nobody: "another user" (the tests run as root, who can chown)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


@needs_root
def test_a_cache_folder_another_user_created_with_a_linked_failover_folder_is_refused(
    tmp_path: Path,
) -> None:
    """Issue 37 item 2: another user's --warm-cache folder whose ``failover``
    is a link to a root-only folder: nothing is created through the link."""
    target = tmp_path / "root-only"
    target.mkdir(mode=0o700)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "failover").symlink_to(target)
    os.lchown(cache / "failover", OTHER_UID, OTHER_UID)
    os.chown(cache, OTHER_UID, OTHER_UID)
    with pytest.raises(OSError, match="owned by uid 65534"):
        ballot_path(str(cache), "job-7", LIST, 1)
    assert list(target.iterdir()) == []
    os.chown(cache, 0, 0)  # the same link in a folder of ours: refused as a link
    with pytest.raises(OSError, match="link"):
        ballot_path(str(cache), "job-7", LIST, 1)
    assert list(target.iterdir()) == []


@needs_root
def test_a_failover_folder_of_another_user_or_a_linked_run_folder_is_refused(
    tmp_path: Path,
) -> None:
    cache = tmp_path / "cache"
    (cache / "failover").mkdir(parents=True, mode=0o700)
    os.chown(cache / "failover", OTHER_UID, OTHER_UID)
    with pytest.raises(OSError, match="owned by uid 65534"):
        ballot_path(str(cache), "job-7", LIST, 1)
    os.chown(cache / "failover", 0, 0)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (cache / "failover" / "job-7").symlink_to(elsewhere)
    with pytest.raises(OSError, match="link"):
        ballot_path(str(cache), "job-7", LIST, 1)
    assert list(elsewhere.iterdir()) == []


def test_a_record_with_a_term_no_job_reaches_is_refused(tmp_path: Path) -> None:
    """A valid-looking record with term 2^53 would keep
    this voter out of every election: refused, naming the file."""
    path = tmp_path / "ballot.json"
    path.write_text(json.dumps({"term": 2**53, "candidate": 1}))
    with pytest.raises(BallotError) as err:
        Ballot.load(str(path), 3)
    assert str(path) in str(err.value)
    path.write_text(json.dumps({"term": 40, "candidate": 1}))  # a real job's terms
    assert Ballot.load(str(path), 3).term == 40
