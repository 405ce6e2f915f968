"""A candidate host's standing in the store's failover: its role, its term,
the votes it got, and when the host must step down (docs/failover.md).

Pure logic over an injected clock; :class:`~elastrun.store.server.StoreServer`
holds one when it runs as one of several candidate hosts, and its
connections feed it (a hello, a vote, any frame of a candidate's connection).

* Candidates are the entries of the c10d endpoint list, indexed 0..n-1; every
  node has the same list. A *term* is a number; at most one candidate hosts
  the store in a term, and a client follows the host of the highest term it
  knows.
* **Votes.** A candidate's agent votes at most once per term (the voter keeps
  that rule, :class:`~elastrun.store.ballot.Ballot`). A standby that got votes for term ``t`` from a
  majority of the candidates (itself included when its own agent voted for
  it) takes over as host of ``t``. Two majorities of one fixed list share a
  candidate, which voted once (its ballot is kept on disk,
  :mod:`elastrun.store.ballot`): one host per term. Every term has an
  elected host, term 1 included: every candidate starts as a standby.
* **Fencing.** The host counts the candidates it heard from (any frame of a
  connection whose hello named its candidate index) within
  :attr:`FailoverTiming.fence` seconds, itself included. Once a majority was
  heard (the job is up), a count below a majority steps it down
  (:attr:`Role.FENCED`): it never serves its term again, and stands by only
  once it learns a newer term's host (:meth:`TermState.learn`). Without a
  token, a hello names a candidate only once that candidate vouches for it
  (:mod:`elastrun.store.vouch`); so do votes. A voter votes only
  :attr:`FailoverTiming.vote_after` seconds after it last sent anything to the
  host (longer than ``fence``, clock drift and delays allowed for), or at once
  when the host's address refuses connections or the host says it stepped
  down. So when a majority voted for a new term, the old host had stopped
  hearing from a majority and had stepped down, or it was gone.
"""

from __future__ import annotations

import enum
import hashlib

from elastrun.clock import SYSTEM_CLOCK, Clock
from elastrun.frozen import frozen

__all__ = [
    "MAX_CANDIDATES",
    "MIN_FAILOVER_LEASE_TTL",
    "FailoverTiming",
    "Role",
    "TermState",
    "list_digest",
]

# At most this many candidate hosts (a majority of them must stay up).
MAX_CANDIDATES = 7
# The shortest lease TTL with candidate hosts: twice the time after which the
# host holds requests (FailoverTiming.suspect), so that a lease of a node cut
# off with the majority expires at the host only after it holds requests.
MIN_FAILOVER_LEASE_TTL = 3.0


def list_digest(candidates: str) -> str:
    """What a vote carries of the voter's candidate list (``a:p,b:p,...``):
    a vote is taken only by a candidate with the same list."""
    return hashlib.sha256(candidates.encode()).hexdigest()[:16]


class Role(enum.Enum):
    """What a candidate's store does in its term."""

    HOST = "host"  # serves the store
    STANDBY = "standby"  # refuses requests, naming the host; takes votes
    FENCED = "fenced"  # was the host, stepped down: refuses everything until it learns a newer term


@frozen
class FailoverTiming:
    """The failover's clocks, in seconds (each node's own monotonic clock)."""

    heartbeat: float = 1.0  # every node pings the host this often
    silence: float = 2.5  # no answer for this long: the host is lost to this node
    suspect: float = 1.5  # the host holds requests after hearing from < a majority this long
    fence: float = 3.0  # the host steps down after hearing from < a majority this long
    drift: float = 0.01  # clock rate difference allowed between two nodes
    margin: float = 1.0  # frames in flight, timer delays
    # At start, a candidate unreachable (refused or silent) this long is passed
    # over: the first live candidate is elected host. Longer than vote_after.
    start_wait: float = 5.0

    @property
    def vote_after(self) -> float:
        """How long after its last frame to the host a voter waits before it
        votes on silence alone: the host's fence timer, run on a clock up to
        ``drift`` faster or slower, has fired by then."""
        return self.fence * (1 + self.drift) / (1 - self.drift) + self.margin


class TermState:
    """Candidate ``index`` of ``count``: its role and term (see module doc)."""

    def __init__(
        self,
        index: int,
        count: int,
        *,
        role: Role = Role.STANDBY,
        term: int = 0,
        timing: FailoverTiming | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if not 0 <= index < count <= MAX_CANDIDATES:
            raise ValueError(f"candidate {index} of {count}")
        self.index = index
        self.count = count
        self.role = role
        self.term = term
        self.host: int | None = index if role is Role.HOST else None
        self.timing = timing or FailoverTiming()
        self.clock = clock
        self.votes: dict[int, set[int]] = {}  # term -> voters for this candidate
        self.heard: dict[int, float] = {}  # candidate -> when last heard (as host)
        self.armed = False  # a majority was heard in this term: fencing applies
        self.why = ""  # why it stepped down

    @property
    def majority(self) -> int:
        return self.count // 2 + 1

    def learn(self, term: int, host: int | None) -> bool:
        """A newer term's host is known: a standby follows it, and a host that
        stepped down in an older term stands by again (it never serves its
        own term again; it may be elected in a term after ``term``, so that
        a candidate's stall costs the job no candidate for good). Returns
        True when it stood by again."""
        if term <= self.term or self.role is Role.HOST:
            return False
        rejoined = self.role is Role.FENCED
        self.term, self.host = term, host
        self.votes = {t: v for t, v in self.votes.items() if t > term}
        if rejoined:
            self.role, self.why = Role.STANDBY, ""
            self.heard, self.armed = {}, False
        return rejoined

    @property
    def voted(self) -> int:
        """The highest term in which this standby holds a vote (0: none):
        told to the voters, so that voters whose ballots are at different
        terms (a job relaunched over its records) meet in one term."""
        return max((t for t, v in self.votes.items() if v), default=0)

    def heard_from(self, candidate: int) -> None:
        if self.role is Role.HOST and 0 <= candidate < self.count:
            self.heard[candidate] = self.clock.monotonic()

    def live(self, within: float | None = None) -> set[int]:
        """The candidates heard from within ``within`` seconds (default: the
        fence time), this one included."""
        now = self.clock.monotonic()
        window = self.timing.fence if within is None else within
        return {self.index} | {c for c, t in self.heard.items() if now - t <= window}

    def suspect(self) -> bool:
        """As an armed host: fewer than a majority heard within the suspect
        time (requests wait, see the server's ``holding``)."""
        if self.role is not Role.HOST or not self.armed or self.count == 1:
            return False
        return len(self.live(self.timing.suspect)) < self.majority

    def check_fence(self) -> str | None:
        """As host: step down when fewer than a majority were heard lately
        (once a majority had been). Returns why it stepped down, once."""
        if self.role is not Role.HOST or self.count == 1:
            return None
        live = self.live()
        if len(live) >= self.majority:
            self.armed = True
            return None
        if not self.armed:
            return None
        self.role = Role.FENCED
        self.why = (
            f"stepped down as the store's host (term {self.term}): heard from "
            f"{len(live)} of {self.count} candidate hosts in the last "
            f"{self.timing.fence:g} s, fewer than a majority ({self.majority})"
        )
        return self.why

    def receive_vote(self, term: int, voter: int) -> bool:
        """A vote for this candidate in ``term``; True when it won the term
        (it took over as host)."""
        if term <= self.term or self.role is not Role.STANDBY or not 0 <= voter < self.count:
            return False
        voters = self.votes.setdefault(term, set())
        voters.add(voter)
        if len(voters) < self.majority:
            return False
        self.role, self.term, self.host = Role.HOST, term, self.index
        now = self.clock.monotonic()
        # The votes were heard just now: the new host is armed at once.
        self.heard = {v: now for v in voters if v != self.index}
        self.armed = True
        self.votes = {}
        return True

    def refusal(self, host_address: str) -> str:
        """The line a standby or a fenced host answers every request with."""
        if self.role is Role.FENCED:
            return f"this candidate {self.why}; it serves nobody again"
        where = f"the host is {host_address}" if host_address else "no host known"
        return f"this candidate stands by (not the store's host; {where}, term {self.term})"
