"""A candidate's ballot in the store's failover elections: at most one
candidate per term, kept on disk so that a restarted agent remembers it
(docs/failover.md, *Votes*).

Votes only ever go up: a voter votes in a term above every term it voted in
before, or again for the same candidate in its highest term. So the record is
one pair, the highest term voted in and for whom, written (atomically, synced)
before the vote is sent. It lives in a private folder of this machine's cache
(``<cache>/failover/<run id>/ballot-<list>-<index>.json``, see
:func:`ballot_path`), read back bounded and validated when the agent starts
(a record that is a link, not a regular file, larger than 4 KiB, not
``{"term": N, "candidate": I}``, or with a term above :data:`MAX_TERM` is
refused: the agent says so in one line and keeps its votes in memory).

A vote for a term above the recorded one also waits: ``wait`` (the failover's
``vote_after``) after this process's previous vote, or after the ballot was
made (the agent's start) when it cast none yet. A host that heard from this
voter (its earlier vote, or its earlier life's connection: a restarted agent
does not know when that one ended, only that it was before its start) has
then stopped hearing from it for longer than the host's fence time. The one
vote that never waits is the ordinary start: term 1 for the first candidate.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field

from elastrun.clock import SYSTEM_CLOCK, Clock
from elastrun.names import path_component
from elastrun.safefs import (
    UnsafePath,
    nearest_existing,
    private_dir,
    read_regular,
    write_atomic,
)
from elastrun.store.term import list_digest
from elastrun.untrusted import loads

__all__ = ["MAX_BALLOT_BYTES", "MAX_TERM", "Ballot", "BallotError", "ballot_path"]

MAX_BALLOT_BYTES = 4096  # a larger record is refused (a planted file)
# Terms are small numbers: one more per election, an election at most every
# vote_after (4 s) per voter; 2^31 terms are centuries of elections. A larger
# recorded term is not ours (a planted or damaged record): it is refused, as
# it would keep this voter out of every election the job can reach.
MAX_TERM = 1 << 31


class BallotError(Exception):
    """The ballot could not be read or written: names the file and why."""


def ballot_path(cache_dir: str, run_id: str, candidates: str, index: int) -> str:
    """The record of candidate ``index`` of the list ``candidates`` (as every
    node writes it) in job ``run_id``: one per candidate, so that several
    candidates on one machine (told apart by loopback addresses) keep their
    own. The folders are created private (0700) on the way; the cache folder
    must be this user's (links in its own path are the caller's choice), and
    ``failover`` and the run's folder in it this user's private folders, not
    links: raises UnsafePath naming the first that is not."""
    cache = os.path.abspath(cache_dir)
    if not os.path.lexists(cache):
        private_dir(cache, below=nearest_existing(os.path.dirname(cache)))
    try:
        st = os.stat(cache)
    except OSError as exc:
        raise UnsafePath(cache, f"cannot be read: {exc.strerror or exc}") from None
    if st.st_uid != os.geteuid():
        raise UnsafePath(
            cache,
            f"is owned by uid {st.st_uid}, not by this process (uid {os.geteuid()}); "
            "another user may have created it: the ballots are not kept there",
        )
    folder = os.path.join(cache, "failover", path_component(run_id))
    private_dir(folder, below=cache)
    return os.path.join(folder, f"ballot-{list_digest(candidates)}-{index}.json")


@dataclass
class Ballot:
    """One voter's votes (see the module doc). ``path``: where the record is
    kept (None: memory only)."""

    path: str | None = None
    count: int = 1  # candidates in the list (a recorded candidate must be one of them)
    clock: Clock = SYSTEM_CLOCK
    term: int = 0  # the highest term voted in (0: none)
    candidate: int | None = None  # for whom
    last: float = field(default=-1.0)  # monotonic time of the previous vote, or the start

    def __post_init__(self) -> None:
        if self.last < 0:
            self.last = self.clock.monotonic()

    @classmethod
    def load(cls, path: str, count: int, clock: Clock = SYSTEM_CLOCK) -> Ballot:
        """The ballot recorded at ``path`` (none yet: an empty one). Raises
        BallotError naming the file when it is not a record of ours."""
        ballot = cls(path, count, clock)
        try:
            data = read_regular(path, MAX_BALLOT_BYTES)
        except FileNotFoundError:
            return ballot
        except OSError as exc:  # UnsafePath included: a link, a FIFO, too large
            raise BallotError(f"{path}: cannot be read: {exc}") from None
        term, candidate = _decode(data, count)
        if term is None:
            raise BallotError(
                f'{path}: not a ballot record (expected {{"term": N, "candidate": I}} '
                f"with 0 <= I < {count}); remove it if this job has no running agent"
            )
        ballot.term, ballot.candidate = term, candidate
        return ballot

    def may_vote(self, term: int, candidate: int, wait: float) -> bool:
        """Whether a vote for ``candidate`` in ``term`` is allowed now (see
        the module doc); it does not cast it."""
        if term < self.term or term < 1:
            return False
        if term == self.term:
            return candidate == self.candidate
        if term == 1 and candidate == 0:
            return True
        return self.clock.monotonic() >= self.last + wait

    def wait_left(self, wait: float) -> float:
        """How long until a vote in a new term is allowed."""
        return max(0.0, self.last + wait - self.clock.monotonic())

    def vote(self, term: int, candidate: int, wait: float = 0.0) -> bool:
        """Cast the vote when :meth:`may_vote`, recorded first; whether it was.
        Raises BallotError when the record cannot be written (no vote then)."""
        if not self.may_vote(term, candidate, wait):
            return False
        if term == self.term:
            return True
        if self.path is not None:
            record = json.dumps({"term": term, "candidate": candidate}).encode()
            try:
                write_atomic(self.path, record, sync=True)
            except OSError as exc:
                raise BallotError(f"{self.path}: cannot be written: {exc}") from None
        self.term, self.candidate = term, candidate
        self.last = self.clock.monotonic()
        return True

    def forget(self) -> None:
        """Remove the record (the agent ends: its job is over for this node)."""
        if self.path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)


def _decode(data: bytes, count: int) -> tuple[int | None, int | None]:
    try:
        value = loads(data, max_bytes=MAX_BALLOT_BYTES, max_depth=2)
    except ValueError:
        return None, None
    if not isinstance(value, dict) or set(value) != {"term", "candidate"}:
        return None, None
    term, candidate = value["term"], value["candidate"]
    if type(term) is not int or type(candidate) is not int:
        return None, None
    if not 1 <= term <= MAX_TERM or not 0 <= candidate < count:
        return None, None
    return term, candidate
