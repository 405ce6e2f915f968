"""Hosting and linking this node's store: one store (the embedded one, or
etcd's members), or the embedded store's candidate hosts (docs/failover.md).

**One store.** Who hosts the embedded (c10d) store: ``is_host=1|0`` in
``--rdzv-conf`` decides; without it a node hosts the store when the
endpoint's host is an address of this machine (loopback counts) and the port
is free. If the port is taken, another agent on this machine is assumed to
host it and this one connects as a client. The hosting agent serves the store
from its own event loop until its agent finishes (after the exit barrier),
listening on the addresses the endpoint names (:mod:`elastrun.launcher.bind`).

**Candidate hosts** (``--rdzv-endpoint a:p,b:p,c:p``). This node is candidate
``i`` when entry ``i``'s host is its ``--local-addr`` (an address of this
machine otherwise) and it can listen there. A candidate serves a store on its
entry for as long as its agent runs, standing by until elected: the first
live candidate hosts term 1. Its votes are kept in the cache folder
(:mod:`elastrun.store.ballot`). Every node then connects to the host of the
highest term.

Either way a hosting node keeps serving, for at most :data:`SERVER_LINGER`,
the peers still connected when its agent is done (:func:`linger`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import os
import socket
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, ParamSpec, TypeVar

from elastrun.agent.modcache import default_cache_dir
from elastrun.clock import SYSTEM_CLOCK
from elastrun.endpoint import Endpoint, format_endpoints
from elastrun.errors import ConfigError, StoreUnavailable
from elastrun.event_kinds import StoreStandby, StoreSteppedDown, StoreTakeover
from elastrun.events import NullSink
from elastrun.frozen import frozen
from elastrun.launcher.bind import describe, listen_on
from elastrun.launcher.event_log import EventLog
from elastrun.launcher.plan import Plan
from elastrun.launcher.rdzv_conf import RendezvousConf
from elastrun.procs import say
from elastrun.store.ballot import Ballot, BallotError, ballot_path
from elastrun.store.factory import Backend, StoreOptions, open_store
from elastrun.store.limits import DEFAULT_LIMITS, StoreLimits
from elastrun.store.term import FailoverTiming, Role, TermState
from elastrun.store.token import TOKEN_ENV, no_token_warning

if TYPE_CHECKING:
    from elastrun.store.base import Store
    from elastrun.store.failover import Candidates, FailoverClient
    from elastrun.store.server import StoreServer

__all__ = [
    "DEFAULT_FAILOVER_TIMEOUT",
    "CandidateLink",
    "StoreLink",
    "hosted_limits",
    "in_thread",
    "is_local_address",
    "link_candidates",
    "link_store",
    "my_candidate",
    "route_addr",
]

P = ParamSpec("P")
T = TypeVar("T")

RESOLVE_TIMEOUT = 30.0
DEFAULT_READ_TIMEOUT = 60.0  # --rdzv-conf read_timeout: each store request after the first
DEFAULT_FAILOVER_TIMEOUT = 60.0  # --rdzv-conf failover_timeout
WAITING_NOTICE_AFTER = 10.0
SERVER_LINGER = 5.0  # how long a hosting agent keeps serving for peers still connected
# How the launcher takes a token, for the warning of a store without one.
TOKEN_HOW = f"{TOKEN_ENV}=..., or --rdzv-conf token_file=PATH"


# ---------------------------------------------------------------- addresses
def _ip_literal(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return None


def is_local_address(host: str) -> bool:
    """True if ``host`` resolves to an address of this machine (loopback counts).

    An address is local when a socket can be bound to it, which is exactly
    the kernel's view of "one of my interface addresses"."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except (socket.gaierror, UnicodeError):
        return False
    for family, _, _, _, sockaddr in infos:
        ip = _ip_literal(str(sockaddr[0]))
        if ip is not None and (ip.is_loopback or ip.is_unspecified):
            return True
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.bind((sockaddr[0], 0, *sockaddr[2:]))
            return True
        except OSError:
            continue
    return False


def route_addr(host: str, port: int) -> str | None:
    """This machine's address on the route to ``host`` (no packet is sent)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except (socket.gaierror, UnicodeError):
        return None
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(sockaddr)
                return str(s.getsockname()[0])
        except OSError:
            continue
    return None


def _addresses(host: str) -> set[str]:
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return set()
    return {str(ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])) for info in infos}


async def in_thread(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Run a blocking resolver call, bounded (DNS can hang)."""
    loop = asyncio.get_running_loop()
    call = functools.partial(fn, *args, **kwargs)
    try:
        return await asyncio.wait_for(loop.run_in_executor(None, call), RESOLVE_TIMEOUT)
    except TimeoutError:
        raise ConfigError(
            f"resolving {args[0] if args else fn!r} took longer than {RESOLVE_TIMEOUT:.0f} s (DNS?)"
        ) from None


# ---------------------------------------------------------------- one store
def hosted_limits(conf: RendezvousConf) -> StoreLimits:
    """The hosted store's limits: the defaults, with ``--rdzv-conf
    store_max_connections_per_peer`` (and at least as many connections in all)."""
    per_peer = conf.store_max_connections_per_peer
    if per_peer is None:
        return DEFAULT_LIMITS
    return DEFAULT_LIMITS.with_(
        max_connections_per_peer=per_peer,
        max_connections=max(per_peer, DEFAULT_LIMITS.max_connections),
    )


def read_timeout(plan: Plan) -> float:
    """Each store request after the first: ``--rdzv-conf read_timeout`` (60 s),
    never longer than the join timeout."""
    given = plan.conf.read_timeout
    return min(DEFAULT_READ_TIMEOUT if given is None else given, plan.rendezvous.join_timeout)


async def _host_store(plan: Plan) -> tuple[StoreServer | None, Endpoint, str]:
    """Decide whether this agent hosts the c10d store; start it if so.

    Returns (server or None, endpoint to connect to, note for error messages)."""
    from elastrun.store.server import StoreServer

    endpoint = plan.endpoints[0]
    host, port = endpoint
    explicit = plan.conf.is_host
    if explicit is False:
        return None, endpoint, "is_host=0: another node hosts the store"
    local = await in_thread(is_local_address, host)
    if explicit is None and not local:
        return None, endpoint, f"{host} is not an address of this machine"
    # Listen on the addresses the endpoint names (or --rdzv-conf store_bind).
    listen = await in_thread(
        listen_on,
        host,
        port,
        store_bind=plan.conf.store_bind,
        multi_node=plan.rendezvous.max_nodes > 1,
    )
    server = StoreServer(listen.hosts, port, token=plan.token, limits=hosted_limits(plan.conf))
    try:
        _, bound_port = await server.start()
    except ConfigError as exc:
        if explicit is None and "in use" in str(exc):
            return (
                None,
                endpoint,
                f"port {port} on this machine is in use; assumed another elastrun agent "
                "here hosts the store",
            )
        raise ConfigError(f"--rdzv-endpoint: this node cannot host the store: {exc}") from None
    if not plan.standalone:
        where = describe(server.addresses)
        say(
            f"elastrun: this node hosts the rendezvous store on {Endpoint(host, bound_port)}"
            + ("" if where == str(Endpoint(host, bound_port)) else f" (listening on {where})")
        )
    else:  # its port and id are generated: say them, so that status can find the job
        store = Endpoint(listen.connect, bound_port)
        say(
            f"elastrun: standalone job {plan.run_id}, store on {store} (elastrun status "
            f"--rdzv-endpoint={store} --rdzv-id={plan.run_id})"
        )
    for warning in listen.warnings:
        say(f"elastrun: warning: {warning}")
    if plan.token is None and not server.loopback_only():
        say(f"elastrun: warning: {no_token_warning(TOKEN_HOW)}")
    return server, Endpoint(listen.connect, bound_port), "this node hosts the store"


async def _open_store(plan: Plan, endpoints: tuple[Endpoint, ...], me: str, note: str) -> Store:
    # The first connection is retried up to join_timeout (agents may start
    # before the store's host); each later request is bounded by read_timeout
    # (never longer than join_timeout), so a store lost mid-job is reported
    # within it (and the lease TTL), not after join_timeout.
    timeout = plan.rendezvous.join_timeout
    task = asyncio.ensure_future(
        open_store(
            plan.backend,
            endpoints,
            StoreOptions(token=plan.token, etcd=plan.conf.etcd_options()),
            timeout=timeout,
            request_timeout=read_timeout(plan),
        )
    )
    where = format_endpoints(endpoints)
    try:
        done, _ = await asyncio.wait({task}, timeout=WAITING_NOTICE_AFTER)
        if not done:
            say(
                f"elastrun: waiting for the rendezvous store at {where} ({note}); "
                f"giving up after {timeout:.0f} s (--rdzv-conf join_timeout)"
            )
        return await task
    except StoreUnavailable as exc:
        raise StoreUnavailable(
            f"node {me} could not reach the rendezvous store at {where} ({note}): {exc}"
        ) from None
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


async def linger(server: StoreServer) -> None:
    """Stop a hosted store once its peers left (their last writes), waiting
    for them at most :data:`SERVER_LINGER`."""
    deadline = SYSTEM_CLOCK.monotonic() + SERVER_LINGER
    while server.connection_count > 0 and SYSTEM_CLOCK.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await server.stop()


@frozen
class StoreLink:
    """This node's connected store, and its address on the route to it."""

    store: Store
    addr: str


@contextlib.asynccontextmanager
async def link_store(plan: Plan, hostname: str) -> AsyncIterator[StoreLink]:
    """Host the store if this node does (c10d), connect to it, and yield
    the link; on exit close it and stop the hosted store (:func:`linger`)."""
    server: StoreServer | None = None
    note = "etcd cluster"
    endpoints = plan.endpoints
    if plan.backend is Backend.C10D:
        server, store_at, note = await _host_store(plan)
        endpoints = (store_at,)
    try:
        addr = plan.local_addr or await in_thread(route_addr, *endpoints[0]) or hostname
        store = await _open_store(plan, endpoints, f"{hostname} ({addr})", note)
        try:
            yield StoreLink(store, addr)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(store.close(), 5.0)
    finally:
        if server is not None:
            await linger(server)


# ---------------------------------------------------------------- candidate hosts
def my_candidate(endpoints: tuple[Endpoint, ...], local_addr: str | None) -> int | None:
    """Which entry this node is: its ``--local-addr`` (by address), else the
    first entry whose host is an address of this machine (blocking: resolves)."""
    if local_addr:
        for i, endpoint in enumerate(endpoints):
            if endpoint.host == local_addr:  # as given: no name resolved
                return i
        mine = _addresses(local_addr) | {local_addr}
        for i, endpoint in enumerate(endpoints):
            if _addresses(endpoint.host) & mine:
                return i
        return None
    for i, endpoint in enumerate(endpoints):
        if is_local_address(endpoint.host):
            return i
    return None


async def _serve(
    plan: Plan, candidates: Candidates, log: EventLog, timing: FailoverTiming
) -> StoreServer | None:
    """Start this candidate's store, standing by: the first host is elected
    (the first live candidate, :meth:`FailoverClient.connect`)."""
    from elastrun.store.server import StoreServer

    me = candidates.me
    if me is None:
        return None
    count = len(candidates.endpoints)
    state = TermState(me, count, role=Role.STANDBY, term=0, timing=timing)
    host, port = candidates.endpoints[me]
    listen = await in_thread(listen_on, host, port, multi_node=True)

    def on_term(kind: str, detail: str) -> None:
        say(f"elastrun: {detail}")
        term_event = {c.KIND: c for c in (StoreTakeover, StoreStandby, StoreSteppedDown)}[kind]
        log.emit(
            "store",
            term_event(term=state.term, candidate=str(candidates.endpoints[me]), detail=detail),
        )

    server = StoreServer(
        listen.hosts,
        port,
        token=plan.token,
        failover=state,
        candidates=[str(e) for e in candidates.endpoints],
        on_term=on_term,
    )
    try:
        await server.start()
    except ConfigError as exc:
        say(
            f"elastrun: this node cannot serve as candidate host {host}:{port} ({exc}); "
            "it joins the job as a node that is no candidate"
        )
        return None
    say(
        f"elastrun: this node is candidate host {me + 1} of {count} ({host}:{port}) "
        "and stands by to host the store"
    )
    if plan.token is None and not server.loopback_only():
        say(f"elastrun: warning: {no_token_warning(TOKEN_HOW)}")
    return server


def _ballot(plan: Plan, cache: str | None, candidates: Candidates) -> Ballot:
    """This candidate's ballot, kept in the cache folder (docs/failover.md,
    *Votes*); in memory only, with a warning, where that cannot be."""
    count = len(candidates.endpoints)
    me = candidates.me
    if me is None:
        return Ballot()
    try:
        path = ballot_path(
            cache or default_cache_dir(os.environ), plan.rendezvous.run_id, str(candidates), me
        )
        return Ballot.load(path, count)
    except (OSError, BallotError) as exc:
        say(
            f"elastrun: warning: this candidate's votes are kept in memory only ({exc}): "
            "restarted while the job runs, it could vote twice in one election"
        )
        return Ballot(count=count)


@frozen
class CandidateLink:
    """This node's link to the candidate hosts' store (the client follows
    the host of the highest term), and its address on the route to them."""

    client: FailoverClient
    addr: str


@contextlib.asynccontextmanager
async def link_candidates(
    plan: Plan, hostname: str, cache: str | None, log: EventLog
) -> AsyncIterator[CandidateLink]:
    """Serve this node's candidate store (if it is one), connect to the
    elected host and yield the link; on exit close it, stop the store
    (:func:`linger`) and forget this node's votes. ``cache``: the folder
    that keeps them (None: the default cache folder)."""
    # Imported here: only candidate hosts run the failover client (and its server).
    from elastrun.store.failover import Candidates, FailoverClient

    endpoints = plan.endpoints
    me = await in_thread(my_candidate, endpoints, plan.local_addr)
    candidates = Candidates(endpoints, me)
    timing = FailoverTiming()
    server = await _serve(plan, candidates, log, timing)
    if server is None:
        candidates = Candidates(endpoints, None)
    ballot = await in_thread(_ballot, plan, cache, candidates)
    failover_timeout = plan.conf.failover_timeout
    client = FailoverClient(
        candidates,
        token=plan.token,
        server=server,
        timing=timing,
        request_timeout=read_timeout(plan),
        failover_timeout=(
            DEFAULT_FAILOVER_TIMEOUT if failover_timeout is None else failover_timeout
        ),
        events=log.sink("store") or NullSink(),
        say=say,
        ballot=ballot,
    )
    try:
        await client.connect(plan.rendezvous.join_timeout)
        addr = plan.local_addr or await in_thread(route_addr, *endpoints[0]) or hostname
        yield CandidateLink(client, addr)
    finally:
        if client.store is not None:
            await asyncio.wait_for(client.store.close(), 5.0)
        if server is not None:
            await linger(server)
        ballot.forget()  # this node's part in the job is over
