"""The embedded store's TCP server: the :class:`~elastrun.store.engine.Engine`
behind the wire protocol of :mod:`elastrun.store.codec`.

Runs inside an agent's event loop (the agent hosting the store) or on its own
(``elastrun store serve``). Leases expire on a timer (as in etcd), with one
addition, the *grace on disconnect*: each lease remembers the connection that
granted it or last kept it alive (its owner). When that connection ends (end
of file, reset, or closed by the server), the lease's deadline is cut to at
most :data:`DISCONNECT_GRACE` from then. A client process that dies has its
socket closed by the kernel, so its keys vanish within the grace instead of
the whole TTL; a live client that lost its connection reconnects and renews
its leases at once (see :mod:`elastrun.store.client`), well within the grace.
A keepalive from any connection restores the full TTL and makes that
connection the owner. A peer that vanishes without a FIN or reset (network
partition, powered-off host) still loses its leases only at the TTL. Leases
of an engine handed over from a stopped server have no owner (plain TTL)
until they are kept alive again.

Admission (:class:`StoreServer`) bounds what a stranger can make the server
hold (:class:`~elastrun.store.limits.StoreLimits`): connections in all and per
peer address; connections still waiting for their hello, in all and per peer
(a new one past the bound evicts the oldest such one, so a flood cannot lock
out a client that says hello at once); before the hello only one small frame;
the bytes held in incomplete frames and queued for clients that do not read,
each within a budget for all connections together (:mod:`elastrun.store.budgets`).
What one connection may do is in :mod:`elastrun.store.server_conn`;
:meth:`StoreServer.stats` says what the server holds now. Abuse is
logged in bounded volume (:class:`AbuseLog`): a few lines per interval and a
count of the rest, never a traceback per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import resource
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from elastrun.endpoint import Endpoint
from elastrun.errors import ConfigError, StoreError
from elastrun.event_kinds import StoreStandby, StoreSteppedDown, StoreTakeover
from elastrun.frozen import frozen
from elastrun.store.abuse_log import AbuseLog
from elastrun.store.budgets import InputBudget, OutputBudget
from elastrun.store.engine import Engine
from elastrun.store.limits import DEFAULT_LIMITS, MAX_FRAME, MAX_TOKEN, StoreLimits
from elastrun.store.memory import LeaseReaper
from elastrun.store.server_conn import Connection
from elastrun.store.term import Role, TermState, list_digest
from elastrun.store.vouch import Checks, Claims

__all__ = ["DISCONNECT_GRACE", "AbuseLog", "ServerStats", "StoreServer"]

log = logging.getLogger(__name__)

# Seconds a lease outlives the end of its owner's connection (never more than
# its TTL left). Long enough for a live client to notice the lost connection,
# reconnect (its first retries come within 0.05 + 0.1 + 0.2 + 0.4 s) and
# renew; short enough that a killed node is seen gone in about 2 s rather than
# after its lease TTL (10 s by default). See docs/store-protocol.md.
DISCONNECT_GRACE = 2.0
# How often a candidate host checks whether it must hold requests or step down.
FENCE_CHECK = 0.1
# File descriptors kept free for everything else in the process.
_FD_RESERVE = 64


@frozen
class ServerStats:
    """What a :class:`StoreServer` holds now, and what it did to stay within
    its limits since it started."""

    connections: int
    pending_hello: int
    partial_bytes: int  # in incomplete frames (and frames waiting unhandled), all connections
    partial_peak: int
    output_bytes: int  # queued for clients, unread (as last measured)
    output_peak: int
    refused: int  # connections refused or evicted by admission
    closed_partial: int  # closed to keep partial_bytes within max_partial_bytes
    closed_output: int  # closed to keep output_bytes within max_output_bytes
    slow_watches: int  # watches cancelled by slow_watch_bytes

    def summary(self) -> str:
        """One line: what the limits did since the server started."""
        mib = 1024 * 1024
        return (
            f"refused {self.refused} connection(s); closed {self.closed_partial} for "
            f"max_partial_bytes and {self.closed_output} for max_output_bytes; cancelled "
            f"{self.slow_watches} slow watch(es); held at most {self.partial_peak / mib:.1f} "
            f"MiB of incomplete frames and {self.output_peak / mib:.1f} MiB of unread output"
        )


class StoreServer:
    """``server = StoreServer("127.0.0.1", 0, token="s3cret")``;
    ``host, port = await server.start()``; ...; ``await server.stop()``."""

    def __init__(
        self,
        host: str | Sequence[str] = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        engine: Engine | None = None,
        *,
        limits: StoreLimits = DEFAULT_LIMITS,
        hello_timeout: float | None = None,
        max_output_buffer: int | None = None,
        max_frame: int = MAX_FRAME,
        disconnect_grace: float = DISCONNECT_GRACE,
        failover: TermState | None = None,
        candidates: Sequence[str] = (),
        on_term: Callable[[str, str], None] | None = None,
    ) -> None:
        if token is not None and len(token.encode("utf-8", "surrogatepass")) > MAX_TOKEN:
            raise ConfigError(f"the store's token is longer than {MAX_TOKEN} bytes")
        changes: dict[str, object] = {}
        if hello_timeout is not None:
            changes["hello_timeout"] = hello_timeout
        if max_output_buffer is not None:
            changes["max_output_buffer"] = max_output_buffer
            changes["output_high_water"] = min(limits.output_high_water, max_output_buffer // 2)
        self.limits = limits.with_(**changes) if changes else limits
        self.host = host
        self.port = port
        self.token = token or None
        self.engine = engine if engine is not None else Engine(limits=self.limits)
        self.max_frame = max_frame
        self.disconnect_grace = disconnect_grace
        self.abuse = AbuseLog()
        self.max_connections = self.limits.max_connections
        self._server: asyncio.Server | None = None
        self._reaper: LeaseReaper | None = None
        self._connections: set[Connection] = set()
        self._by_peer: dict[str, int] = {}
        # Connections without a hello yet, oldest first (dicts keep order).
        self._pending: dict[Connection, None] = {}
        self._pending_by_peer: dict[str, dict[Connection, None]] = {}
        self.refused = 0  # connections refused or evicted by admission
        self.slow_watches = 0  # watches cancelled by slow_watch_bytes
        self.input: InputBudget[Connection] = InputBudget(
            self.limits.max_partial_bytes, lambda conn, why: conn.fail("busy", why)
        )
        self.output: OutputBudget[Connection] = OutputBudget(
            self.limits.max_output_bytes, lambda conn, why: conn.abort(why)
        )
        self.address: tuple[str, int] | None = None
        self.addresses: list[tuple[str, int]] = []  # every address listened on
        # One of several candidate hosts (docs/failover.md): its role and term,
        # the candidates' addresses (for messages), told of a takeover or a
        # step-down as on_term(event kind, detail).
        self.failover = failover
        self.candidates = tuple(candidates)
        self.on_term = on_term
        self._fence_task: asyncio.Task[None] | None = None
        self._held: set[Connection] = set()  # connections whose requests wait
        self._retired: set[asyncio.Future[None]] = set()  # old reapers stopping
        # Without a token: what this candidate's agent said in its name (the
        # store vouches for it), and the claims of others being checked
        # (store/vouch.py).
        self.claims = Claims()
        self._checks = Checks(self.candidates, self.token)

    @property
    def hello_timeout(self) -> float:
        return self.limits.hello_timeout

    @property
    def max_output_buffer(self) -> int:
        return self.limits.max_output_buffer

    @property
    def connection_count(self) -> int:
        return len(self._connections)

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    def stats(self) -> ServerStats:
        return ServerStats(
            connections=len(self._connections),
            pending_hello=len(self._pending),
            partial_bytes=self.input.total,
            partial_peak=self.input.peak,
            output_bytes=self.output.total,
            output_peak=self.output.peak,
            refused=self.refused,
            closed_partial=self.input.evicted,
            closed_output=self.output.evicted,
            slow_watches=self.slow_watches,
        )

    async def start(self) -> tuple[str, int]:
        """Listen; returns the (host, port) actually bound (port 0: a free one)."""
        if self._server is not None:
            raise RuntimeError("StoreServer already started")
        self.max_connections = _fit_fd_limit(self.limits.max_connections)
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(
                lambda: Connection(self), self.host, self.port, reuse_address=True, backlog=1024
            )
        except socket.gaierror as exc:
            raise ConfigError(f"cannot listen on {self.host!r}: {exc.strerror}") from None
        except OSError as exc:
            hosts = [self.host] if isinstance(self.host, str) else list(self.host)
            where = ", ".join(str(Endpoint(h, self.port)) for h in hosts)
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"cannot listen on {where}: the port is already in use by another "
                    "program (check with `ss -ltnp`); choose another port or use port 0"
                ) from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise ConfigError(
                    f"cannot listen on {where}: not an address of this machine"
                ) from None
            raise StoreError(f"cannot listen on {where}: {exc.strerror or exc}") from None
        self.addresses = [
            (str(name[0]), int(name[1]))
            for name in (sock.getsockname() for sock in self._server.sockets)
        ]
        self.address = self.addresses[0]
        self._reaper = LeaseReaper(self.engine)
        self._reaper.poke()  # an engine handed over from a previous server may hold leases
        log.info("elastrun store listening on %s", Endpoint(*self.address))
        if self.failover is not None and self.failover.count > 1:
            self._fence_task = loop.create_task(self._fence_timer(self.failover))
        return self.address

    def loopback_only(self) -> bool:
        """Whether every address listened on is a loopback address."""
        return all(_is_loopback(host) for host, _ in self.addresses)

    async def stop(self) -> None:
        """Stop listening and drop every connection. The engine (keys, leases,
        history) stays intact: a new server on the same engine continues it.
        Its leases keep their deadlines (no grace: the clients did not go
        away) and lose their owners (this server's connections)."""
        if self._fence_task is not None:
            self._fence_task.cancel()
            self._fence_task = None
        self._checks.cancel()
        if self._server is not None:
            self._server.close()
        for conn in self._connections:
            self.engine.lease_disown(conn)
        self.disconnect_all()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5.0)
            self._server = None
        if self._reaper is not None:
            await self._reaper.stop()
            self._reaper = None
        self.abuse.flush()
        stats = self.stats()
        if stats.refused or stats.closed_partial or stats.closed_output or stats.slow_watches:
            log.warning("elastrun store: stopped; %s", stats.summary())

    def disconnect_all(self) -> None:
        """Drop every client connection (clients reconnect and renew their
        leases within the grace; tests, failover drills)."""
        for conn in list(self._connections):
            conn.abort("server dropped the connection")

    async def __aenter__(self) -> StoreServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    # -- admission (used by connections) ----------------------------------------
    def admit(self, conn: Connection) -> str | None:
        """Count a new connection in; None, or why it is refused (then it is
        counted as refused, not as a connection). May evict the oldest
        connections still without a hello."""
        limits, peer = self.limits, conn.peer_ip
        if len(self._connections) >= self.max_connections:
            self.refused += 1
            return f"the store has {len(self._connections)} connections (max_connections)"
        if self._by_peer.get(peer, 0) >= limits.max_connections_per_peer:
            self.refused += 1
            return (
                f"{self._by_peer[peer]} connections from {peer} already (max_connections_per_peer)"
            )
        self._connections.add(conn)
        self._by_peer[peer] = self._by_peer.get(peer, 0) + 1
        self._pending[conn] = None
        mine = self._pending_by_peer.setdefault(peer, {})
        mine[conn] = None
        if len(mine) > limits.max_pending_hello_per_peer:
            self._evict(next(iter(mine)), "max_pending_hello_per_peer")
        if len(self._pending) > limits.max_pending_hello:
            self._evict(next(iter(self._pending)), "max_pending_hello")
        return None

    def _evict(self, conn: Connection, limit: str) -> None:
        self.refused += 1
        self._unpend(conn)
        conn.refuse(f"evicted: too many connections without a hello ({limit})")

    def hello_done(self, conn: Connection) -> None:
        self._unpend(conn)

    def _unpend(self, conn: Connection) -> None:
        if conn in self._pending:
            del self._pending[conn]
            mine = self._pending_by_peer.get(conn.peer_ip)
            if mine is not None:
                mine.pop(conn, None)
                if not mine:
                    del self._pending_by_peer[conn.peer_ip]

    def gone(self, conn: Connection) -> None:
        """A connection ended (counted in by :meth:`admit` or not)."""
        self._unpend(conn)
        if conn in self._connections:
            self._connections.discard(conn)
            left = self._by_peer.get(conn.peer_ip, 1) - 1
            if left > 0:
                self._by_peer[conn.peer_ip] = left
            else:
                self._by_peer.pop(conn.peer_ip, None)

    def poke_reaper(self) -> None:
        if self._reaper is not None:
            self._reaper.poke()

    # -- failover (used by connections; docs/failover.md) ----------------------
    def serving(self) -> bool:
        """Whether requests are served: always, but for a candidate host that
        stands by or stepped down (checked now: a host that stopped hearing
        from a majority of the candidates steps down before it answers)."""
        state = self.failover
        if state is None:
            return True
        why = state.check_fence()
        if why is not None:
            self._stepped_down(why)
        return state.role is Role.HOST

    def heard(self, candidate: int) -> None:
        if self.failover is not None:
            self.failover.heard_from(candidate)

    def holding(self, conn: Connection) -> bool:
        """Requests wait while the host is suspect (it has not heard from a
        majority of the candidates for a moment): no write of a minority is
        served before it steps down. Released when the majority is heard
        again (at the next check); dropped when it steps down."""
        state = self.failover
        if state is None or not state.suspect():
            return False
        self._held.add(conn)
        return True

    def _release(self) -> None:
        held, self._held = self._held, set()
        for conn in held:
            conn.release()

    def term_hello(self, frame: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
        """The term fields of a hello's answer, and why it is refused: this
        candidate does not serve, or the client knows a newer term."""
        state = self.failover
        if state is None:
            return {}, None
        host = self._candidate(state.host)
        fields: dict[str, Any] = {"term": state.term, "role": state.role.value, "host": host}
        if state.role is Role.STANDBY and state.voted:
            fields["voted"] = state.voted
        if not self.serving():
            return fields, state.refusal(host)
        known = frame.get("term")
        if type(known) is int and known > state.term:
            return fields, f"this host's term {state.term} is older than the client's ({known})"
        return fields, None

    def take_vote(self, frame: Mapping[str, Any], answer: Callable[[dict[str, Any]], None]) -> None:
        """A vote frame from the network: counted at once with a token (the
        token authenticates it); without one, only once the voter's own
        store vouches for it (store/vouch.py). ``answer`` gets the reply."""
        state, term, voter = self.failover, frame.get("term"), frame.get("voter")
        if self.token is not None or state is None or type(voter) is not int:
            answer(self.term_vote(frame))
            return
        claim = {"t": "vote", "term": term, "target": state.index}
        self._checks.vote(
            voter, frame.get("nonce"), claim, lambda ok: answer(self.term_vote(frame, vouched=ok))
        )

    def take_candidate(self, conn: Connection, candidate: int, nonce: object) -> None:
        """A hello that names the client's agent as candidate ``candidate``:
        the connection counts as hearing from it (fencing) at once with a
        token or when it is this candidate's own agent, else once the named
        candidate's store vouches for it (store/vouch.py)."""
        state = self.failover
        if state is None or not 0 <= candidate < state.count:
            return

        def heard() -> None:
            conn.candidate = candidate
            self.heard(candidate)

        if self.token is not None or candidate == state.index:
            heard()
            return
        claim = {"t": "hello", "target": state.index}
        every = state.timing.heartbeat
        self._checks.hello(
            candidate, nonce, claim, every=every, lost=lambda: conn.lost, heard=heard
        )

    def vouch(self, nonce: object) -> dict[str, Any]:
        """The answer to a ``vouch`` frame: what this candidate's agent
        claimed under ``nonce`` (null: nothing)."""
        return {"v": 1, "t": "vouch", "claim": self.claims.get(nonce)}

    def term_vote(self, frame: Mapping[str, Any], *, vouched: bool = True) -> dict[str, Any]:
        """Count a candidate's vote for this one (``term``, ``voter``);
        ``vouched``: the voter is known to have cast it (see take_vote)."""
        state = self.failover
        term, voter = frame.get("term"), frame.get("voter")
        won = False
        # A voter with another candidate list would be counted as whoever
        # holds its index in this one: its vote is not taken.
        same_list = frame.get("list") == list_digest(",".join(self.candidates))
        if state is not None and same_list and vouched and type(term) is int and type(voter) is int:
            won = state.receive_vote(term, voter)
        answer: dict[str, Any] = {"v": 1, "t": "vote", "won": won}
        if state is not None:
            answer |= {"term": state.term, "role": state.role.value}
        if won and state is not None and self.on_term is not None:
            self.on_term(
                StoreTakeover.KIND,
                f"{self._candidate(state.index)} hosts the store from term {state.term}, "
                f"elected by {state.majority} of {state.count} candidate hosts",
            )
        return answer

    def elect_self(self, term: int) -> bool:
        """This candidate's own agent votes for it (as :meth:`term_vote`)."""
        assert self.failover is not None
        digest = list_digest(",".join(self.candidates))
        own = {"term": term, "voter": self.failover.index, "list": digest}
        return bool(self.term_vote(own)["won"])

    def learn(self, term: int, host: int | None) -> None:
        """This candidate's agent follows the host of ``term``: a standby
        follows it; a host that stepped down stands by again, with an empty
        store (a new term's host starts empty: docs/failover.md, *State*)."""
        state = self.failover
        if state is None or not state.learn(term, host):
            return
        self.disconnect_all()
        old, self.engine = self._reaper, Engine(limits=self.limits)
        self._reaper = LeaseReaper(self.engine)
        if old is not None:
            self._retired.add(asyncio.ensure_future(old.stop()))
            self._retired = {t for t in self._retired if not t.done()}
        if self.on_term is not None:
            self.on_term(
                StoreStandby.KIND,
                f"{self._candidate(state.index)} stands by again to host the store "
                f"(the host is {self._candidate(host)}, term {term})",
            )

    def _candidate(self, index: int | None) -> str:
        if index is None or not 0 <= index < len(self.candidates):
            return ""
        return self.candidates[index]

    def _stepped_down(self, why: str) -> None:
        log.warning("elastrun store: %s", why)
        self.disconnect_all()
        if self.on_term is not None:
            self.on_term(StoreSteppedDown.KIND, why)

    async def _fence_timer(self, state: TermState) -> None:
        """Check the fence often, requests or not; release held requests
        once the majority is heard again."""
        while True:  # for the server's life: a host that stepped down may host again
            await asyncio.sleep(FENCE_CHECK)
            if state.role is Role.HOST and self.serving() and self._held and not state.suspect():
                self._release()
            if state.role is not Role.HOST:
                self._held.clear()


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def _fit_fd_limit(wanted: int) -> int:
    """``wanted`` connections, or fewer if the process may not open that many
    files (each connection is one)."""
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return wanted
    if soft == resource.RLIM_INFINITY or soft - _FD_RESERVE >= wanted:
        return wanted
    fitted = max(16, soft - _FD_RESERVE)
    log.info(
        "elastrun store: at most %d connections (the open-file limit is %d; "
        "raise it with `ulimit -n` for more)",
        fitted,
        soft,
    )
    return fitted
