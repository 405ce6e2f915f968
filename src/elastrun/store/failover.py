"""A node's side of the embedded store's failover among candidate hosts:
find the host, watch it, and when it is lost, vote and find the next one.

The candidates are the c10d ``--rdzv-endpoint`` list, the same on every node
(docs/failover.md has the design and its safety argument). A node that is a
candidate runs a store server on its entry (:class:`~.server.StoreServer` with
a :class:`~.term.TermState`), standing by until a majority of the candidates
elects it; the first live candidate is elected for term 1.
:class:`FailoverClient` is what every node runs:

* :meth:`FailoverClient.connect` finds the host of the highest term among the
  candidates (retried until a deadline; a candidate that does not answer is
  reported once, not waited on forever) and connects to it. Every hello
  carries the newest term this node knows (a host of an older term is
  refused) and, from a candidate's agent, its index (the host counts whom it
  hears from: fencing). A candidate meanwhile votes for the first host: the
  first candidate in list order that answers, once every one before it has
  been unreachable for ``start_wait`` (reported).
* :meth:`FailoverClient.watch` pings the host every ``heartbeat`` and returns
  why it is lost: its address refuses connections or it says it stepped down
  (proof that it serves nobody), or it has not answered for ``silence``.
* :meth:`FailoverClient.replace` gives the lost host up (the connection is
  reset: nothing more is sent to it), votes if this node is a candidate (for
  the first candidate in list order that answers, the lost host excepted: at
  once on proof, else :attr:`~.term.FailoverTiming.vote_after` after giving
  the host up; again for the next term after as long without a winner), and
  connects to the host of a newer term as soon as one serves, within
  ``failover_timeout``; else :class:`~elastrun.errors.HostLost` names why.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elastrun.clock import SYSTEM_CLOCK, Clock
from elastrun.endpoint import Endpoint, format_endpoints
from elastrun.errors import (
    AuthenticationError,
    HostLost,
    NotHost,
    ProtocolError,
    StoreUnavailable,
)
from elastrun.event_kinds import StoreCandidateUnreachable, StoreHostFound, StoreHostLost, StoreVote
from elastrun.events import EventSink, NullSink
from elastrun.frozen import frozen
from elastrun.store.ballot import Ballot, BallotError
from elastrun.store.client import TcpStore
from elastrun.store.client_conn import close_writer, exchange, open_conn
from elastrun.store.server import StoreServer
from elastrun.store.term import FailoverTiming, Role, list_digest

__all__ = ["Answer", "Candidates", "FailoverClient", "Lost", "Probe", "probe", "send_vote"]

PROBE_TIMEOUT = 0.5  # one candidate's answer to a probe or a vote (looked at again after)
# Between two looks at the candidates while no host serves: from POLL, half
# as long again each time up to MAX_POLL, with jitter (many nodes looking at
# once spread out).
POLL = 0.2
MAX_POLL = 1.0
UNREACHABLE_NOTICE = 10.0  # a candidate silent this long at start is reported
RECHECK = 0.2  # after an unanswered ping or a probe without proof: the next look
AFTER_VOTE = 0.05  # the first wait after a vote (it may have decided the election)
OWN_ROLE_CHECK = 0.05  # a candidate looks at its own store's role this often between looks


@frozen
class Candidates:
    """The store's candidate hosts, and which of them this node is (None: none)."""

    endpoints: tuple[Endpoint, ...]
    me: int | None = None

    def __str__(self) -> str:
        return format_endpoints(self.endpoints)

    @property
    def majority(self) -> int:
        return len(self.endpoints) // 2 + 1


class Answer(enum.Enum):
    HOST = "host"  # serves the store
    STANDBY = "standby"
    FENCED = "fenced"  # stepped down
    REFUSED = "refused"  # nothing listens there: no store is served there
    SILENT = "silent"  # no answer in time (down, cut off, or still starting)


@frozen
class Probe:
    """One candidate's answer: what it is and the newest term it knows."""

    index: int
    answer: Answer
    term: int = 0
    detail: str = ""
    voted: int = 0  # a standby: the highest term in which it holds a vote

    @property
    def proof(self) -> bool:
        """Whether it proves that this candidate serves no term any more."""
        return self.answer in (Answer.REFUSED, Answer.FENCED)


@frozen
class Lost:
    """Why this node gave its host up; ``proof``: the host serves nobody."""

    cause: str
    proof: bool
    fenced: bool = False  # the host said it stepped down (it was cut off, not dead)

    @property
    def kill_workers(self) -> bool:
        """Whether this node's workers must die at once: unless the host is
        proven dead (its address refuses), the host may have been cut off
        with a minority, and a new group forms within the voters' wait."""
        return self.fenced or not self.proof


async def probe(
    candidates: Candidates, index: int, token: str | None, timeout: float = PROBE_TIMEOUT
) -> Probe:
    """Say hello to candidate ``index`` (not counted as hearing from it) and
    close: what it answered within ``timeout``."""
    host, port = candidates.endpoints[index]
    try:
        conn, _ = await open_conn(host, port, token, timeout, {"term": 0})
    except NotHost as exc:
        answer = Answer.FENCED if exc.role == "fenced" else Answer.STANDBY
        return Probe(index, answer, exc.term, str(exc), exc.voted)
    except (AuthenticationError, ProtocolError) as exc:  # a wrong token, or not a store of ours
        return Probe(index, Answer.SILENT, detail=str(exc)[:200])
    except ConnectionRefusedError:
        return Probe(index, Answer.REFUSED, detail="connection refused")
    except (OSError, TimeoutError, StoreUnavailable) as exc:
        return Probe(index, Answer.SILENT, detail=f"{type(exc).__name__}: {exc}"[:200])
    close_writer(conn.writer)
    return Probe(index, Answer.HOST, conn.term)


async def send_vote(
    candidates: Candidates,
    target: int,
    term: int,
    voter: int,
    token: str | None,
    *,
    nonce: str | None = None,
) -> bool:
    """Vote for candidate ``target`` in ``term``; whether it was answered
    (False: not reached, or no answer in time). ``nonce``: the claim the
    voter's own store vouches for (store/vouch.py)."""
    host, port = candidates.endpoints[target]
    frame: dict[str, Any] = {"v": 1, "t": "vote", "token": token, "term": term, "voter": voter}
    frame["list"] = list_digest(str(candidates))
    if nonce is not None:
        frame["nonce"] = nonce
    reply = await exchange(host, port, frame, PROBE_TIMEOUT)
    return reply is not None and reply.get("t") == "vote"


@dataclass
class FailoverClient:
    """One node's view of the store's candidate hosts (see module doc)."""

    candidates: Candidates
    token: str | None = None
    server: StoreServer | None = None  # this node's candidate server, if it is one
    timing: FailoverTiming = field(default_factory=FailoverTiming)
    request_timeout: float = 60.0
    failover_timeout: float = 60.0
    events: EventSink = field(default_factory=NullSink)
    say: Callable[[str], None] | None = None  # one line on the console (procs.say)
    clock: Clock = SYSTEM_CLOCK
    term: int = 0  # the term of the host this node follows
    host: int | None = None  # that host's index
    store: TcpStore | None = None
    ballot: Ballot = field(default_factory=Ballot)

    # -- finding the host ------------------------------------------------------
    def address(self, index: int | None) -> str:
        return "" if index is None else str(self.candidates.endpoints[index])

    async def look(self) -> list[Probe]:
        """Every candidate's answer (asked at once)."""
        count = len(self.candidates.endpoints)
        return list(
            await asyncio.gather(*(probe(self.candidates, i, self.token) for i in range(count)))
        )

    async def connect(self, timeout: float, min_term: int = 1) -> TcpStore:
        """Connect to the host of the highest term (at least ``min_term``),
        looking until ``timeout``; candidates that stay silent are reported
        once. A candidate elects the first host meanwhile (see
        :meth:`_start_vote`). Raises HostLost when none serves in time."""
        deadline = self.clock.monotonic() + timeout
        noticed = self.clock.monotonic() + UNREACHABLE_NOTICE
        seen: list[Probe] = []
        poll = _Poll()
        start = _Start()
        while True:
            seen = await self.look()
            hosts = [p for p in seen if p.answer is Answer.HOST and p.term >= min_term]
            for best in sorted(hosts, key=lambda p: -p.term):
                with contextlib.suppress(StoreUnavailable):
                    return await self._open(best.index, best.term)
            if self.candidates.me is not None and await self._start_vote(seen, start):
                poll = _Poll(AFTER_VOTE)  # a host is expected soon: look often again
            now = self.clock.monotonic()
            if now >= noticed and self.say is not None:
                noticed = deadline
                self.say(
                    f"elastrun: waiting for the store's host among {self.candidates}: "
                    + "; ".join(_line(self, p) for p in seen)
                )
            if now >= deadline:
                raise HostLost(
                    f"no candidate host of the store serves term {min_term} or later "
                    f"after {timeout:.0f} s: " + "; ".join(_line(self, p) for p in seen)
                )
            await self._nap(poll.next())

    async def _start_vote(self, seen: list[Probe], start: _Start) -> bool:
        """At start, with no host serving and no term known to any candidate
        (no job runs yet): vote for the first candidate in list order that
        answers as a standby, once every candidate before it has been
        unreachable (refused or silent) for ``start_wait`` (each reported
        once); again in the next term ``vote_after`` later if no host
        appeared. Whether a vote was cast."""
        if any(p.term > 0 for p in seen):
            return False  # a job runs: its host is found (or reported) as any node's
        now = self.clock.monotonic()
        target = None
        for p in seen:
            if p.answer is Answer.STANDBY:
                start.down.pop(p.index, None)
                target = p.index if target is None else target
            elif p.answer in (Answer.REFUSED, Answer.SILENT):
                start.down.setdefault(p.index, now)
        if target is None or now < start.vote_at:
            return False
        for p in seen[:target]:
            if now - start.down.get(p.index, now) < self.timing.start_wait:
                return False  # the first candidates may still be starting
        for p in seen[:target]:
            self._unreachable(p, now - start.down[p.index], start)
        voted = await self._cast(max(start.term, seen[target].voted), target)
        if voted is None:
            return False
        start.term, start.vote_at = voted + 1, now + self.timing.vote_after
        return True

    def _unreachable(self, p: Probe, since: float, start: _Start) -> None:
        """Report, once, a candidate skipped at start for being unreachable."""
        if p.index in start.reported:
            return
        start.reported.add(p.index)
        where = self.address(p.index)
        detail = _line(self, p)
        self.events.emit(
            StoreCandidateUnreachable(candidate=where, answer=p.answer.value, detail=detail)
        )
        if self.say is not None:
            self.say(
                f"elastrun: candidate host {where} has been unreachable for {since:.0f} s at "
                f"start ({detail}); electing the store's host among the other candidates"
            )

    async def _open(self, index: int, term: int) -> TcpStore:
        host, port = self.candidates.endpoints[index]
        hello: dict[str, Any] = {"term": term}
        if self.candidates.me is not None:
            hello["candidate"] = self.candidates.me
            if self.server is not None:  # its store vouches for it (store/vouch.py)
                hello["nonce"] = self.server.claims.add({"t": "hello", "target": index})
        store = await TcpStore.connect(
            host,
            port,
            token=self.token,
            timeout=PROBE_TIMEOUT,
            request_timeout=self.request_timeout,
            refused_timeout=self.timing.heartbeat,
            hello=hello,
        )
        store.connect_timeout = self.request_timeout
        self.store, self.term, self.host = store, store.term, index
        if self.server is not None:
            self.server.learn(store.term, index)
        return store

    async def _nap(self, seconds: float) -> None:
        """Wait ``seconds`` between two looks, or less: until this node's own
        store is elected host meanwhile (then it is looked at, and connected
        to, at once)."""
        state = self.server.failover if self.server is not None else None
        hosted = state is not None and state.role is Role.HOST
        end = self.clock.monotonic() + seconds
        while (left := end - self.clock.monotonic()) > 0:
            if state is not None and not hosted and state.role is Role.HOST:
                return
            await asyncio.sleep(min(left, OWN_ROLE_CHECK) if state is not None else left)

    # -- watching it -------------------------------------------------------------
    async def watch(self) -> Lost:
        """Ping the host every ``heartbeat``; return why it is lost: at once
        on proof, else once it has not answered for ``silence``."""
        store = self.store
        assert store is not None
        timing = self.timing
        answered = True
        while True:
            if answered:
                # A dropped connection is looked at at once (a killed host's
                # kernel resets it), else the host is pinged every heartbeat.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(store.dropped.wait(), timing.heartbeat)
            # Right after a failure the host is looked at again soon: a host
            # killed a moment ago may still hold its listening socket, and a
            # probe then is reset rather than refused.
            wait = timing.heartbeat if answered else RECHECK
            answered = not store.dropped.is_set() and await _pinged(store, wait)
            if answered:
                continue
            store.dropped.clear()
            left = store.last_heard + timing.silence - self.clock.monotonic()
            lost = await self._probe_host(max(0.05, min(PROBE_TIMEOUT, left)))
            if lost is not None:
                return lost
            silent = self.clock.monotonic() - store.last_heard
            if silent >= timing.silence:
                where = self.address(self.host)
                return Lost(f"its host {where} has not answered for {silent:.1f} s", False)

    async def _probe_host(self, timeout: float) -> Lost | None:
        """Proof that the host of this term is gone, from its address."""
        if self.host is None:
            return None
        seen = await probe(self.candidates, self.host, self.token, timeout)
        where = f"its host {self.address(self.host)}"
        if seen.proof:
            return Lost(f"{where}: {seen.detail}", True, seen.answer is Answer.FENCED)
        # Only one process listens there: a standby, or a host of another
        # term, proves that the host of this term is gone.
        if seen.answer is Answer.STANDBY or (seen.answer is Answer.HOST and seen.term != self.term):
            return Lost(f"{where} no longer hosts term {self.term}", True)
        return None

    # -- replacing it ------------------------------------------------------------
    async def replace(self, lost: Lost) -> TcpStore:
        """Give the lost host up, vote (a candidate), and connect to the host
        of a newer term (see module doc). Raises HostLost naming why."""
        old_term, old_host = self.term, self.host
        if self.store is not None:
            self.store.abort()  # nothing more is sent to the old host
        self.events.emit(
            StoreHostLost(term=old_term, host=self.address(old_host), cause=lost.cause)
        )
        now = self.clock.monotonic()
        deadline = now + self.failover_timeout
        vote_at = now if lost.proof else now + self.timing.vote_after
        term = old_term + 1
        seen: list[Probe] = []
        poll = _Poll()
        while self.clock.monotonic() < deadline:
            seen = await self.look()
            newer = [p for p in seen if p.answer is Answer.HOST and p.term > old_term]
            if not lost.proof and self.ballot.term <= old_term:
                # Given up on silence but voted for no newer term: the old
                # host, still serving its term (this node was cut off), will do.
                newer += [p for p in seen if p.index == old_host and p.answer is Answer.HOST]
            for best in sorted(newer, key=lambda p: -p.term):
                with contextlib.suppress(StoreUnavailable, AuthenticationError, ProtocolError):
                    store = await self._open(best.index, best.term)
                    self.events.emit(
                        StoreHostFound(
                            term=store.term,
                            host=self.address(best.index),
                            previous_term=old_term,
                            previous_host=self.address(old_host),
                        )
                    )
                    return store
            now = self.clock.monotonic()
            voting = self.candidates.me is not None and now >= vote_at
            if voting and (voted := await self._vote(seen, term, old_host)) is not None:
                vote_at = now + self.timing.vote_after
                term = voted + 1
                poll = _Poll(AFTER_VOTE)  # a host is expected soon: look often again
            await self._nap(min(poll.next(), max(0.0, vote_at - self.clock.monotonic())))
        raise HostLost(self._why_lost(lost, seen, old_host))

    async def _vote(self, seen: list[Probe], term: int, old_host: int | None) -> int | None:
        """Vote in ``term`` (or the next term this node may still vote in)
        for the first candidate that answers as a standby, the old host
        excepted; the term voted in, or None."""
        for p in seen:
            if p.index != old_host and p.answer is Answer.STANDBY:
                # Join the highest term it already holds a vote in: voters
                # whose ballots stand at different terms meet there.
                return await self._cast(max(term, p.voted), p.index)
        return None

    async def _cast(self, term: int, target: int) -> int | None:
        """Vote for ``target`` in ``term``, or in the term after this node's
        last vote if it voted in ``term`` or later for another candidate
        (votes only go up); the term voted in, or None (not allowed yet)."""
        me = self.candidates.me
        assert me is not None
        ballot = self.ballot
        if ballot.term > term or (ballot.term == term and ballot.candidate != target):
            term = ballot.term + 1
        try:
            if not ballot.vote(term, target, self.timing.vote_after):
                return None
        except BallotError as exc:
            if self.say is not None:
                self.say(f"elastrun: cannot vote: {exc}")
            return None
        self.events.emit(StoreVote(term=term, candidate=self.address(target)))
        if target == me and self.server is not None:
            self.server.elect_self(term)
        else:
            nonce = None
            if self.server is not None:  # its store vouches for it (store/vouch.py)
                nonce = self.server.claims.add({"t": "vote", "term": term, "target": target})
            await send_vote(self.candidates, target, term, me, self.token, nonce=nonce)
        return term

    def _why_lost(self, lost: Lost, seen: list[Probe], old_host: int | None) -> str:
        answers = "; ".join(_line(self, p) for p in seen)
        return (
            f"lost the store's host {self.address(old_host)} (term {self.term}: "
            f"{lost.cause}) and no candidate took over within {self.failover_timeout:.0f} s "
            f"(--rdzv-conf failover_timeout); a new host needs the votes of a majority "
            f"({self.candidates.majority} of {len(self.candidates.endpoints)}) of the "
            f"candidate hosts: {answers}"
        )


@dataclass
class _Start:
    """The start election as one node sees it (:meth:`FailoverClient._start_vote`)."""

    down: dict[int, float] = field(default_factory=dict)  # candidate -> unreachable since
    reported: set[int] = field(default_factory=set)
    term: int = 1  # the term to vote in next
    vote_at: float = 0.0  # the earliest next vote


class _Poll:
    """The waits between looks (see POLL)."""

    def __init__(self, first: float = POLL) -> None:
        self.delay = first

    def next(self) -> float:
        wait = self.delay * random.uniform(0.75, 1.25)
        self.delay = min(MAX_POLL, self.delay * 1.5)
        return wait


async def _pinged(store: TcpStore, timeout: float) -> bool:
    """Whether the store answered a ping within ``timeout``; False at once
    when the connection drops meanwhile (the ping would retry until then)."""
    ping = asyncio.ensure_future(store.ping(timeout=timeout))
    dropped = asyncio.ensure_future(store.dropped.wait())
    try:
        await asyncio.wait({ping, dropped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (ping, dropped):
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
    return ping.done() and not ping.cancelled() and ping.exception() is None


def _line(client: FailoverClient, p: Probe) -> str:
    where = client.address(p.index)
    if p.answer is Answer.HOST:
        return f"{where} hosts term {p.term}"
    if p.answer is Answer.STANDBY:
        return f"{where} stands by (term {p.term})"
    return f"{where} {p.answer.value}" + (f" ({p.detail})" if p.detail else "")
