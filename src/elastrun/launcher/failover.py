"""Wiring a node of a job whose c10d store has candidate hosts
(``--rdzv-endpoint a:p,b:p,c:p``; docs/failover.md).

This node is candidate ``i`` when entry ``i``'s host is its ``--local-addr``
(an address of this machine otherwise) and it can listen there. A candidate
serves a store on its entry for as long as its agent runs, standing by until
elected: the first live candidate hosts term 1. Its votes are kept in the
cache folder (:mod:`elastrun.store.ballot`). Every node then connects to the
host of the highest term, and its agent runs over a
:class:`~elastrun.rendezvous.failover.FailoverRendezvous`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import ipaddress
import socket
from typing import TYPE_CHECKING

from elastrun.agent.modcache import default_cache_dir
from elastrun.agent.spec import WorkerSpec
from elastrun.clock import SYSTEM_CLOCK
from elastrun.endpoint import Endpoint
from elastrun.errors import ConfigError
from elastrun.events import EventSink, NullSink
from elastrun.launcher.bind import listen_on
from elastrun.launcher.plan import Plan
from elastrun.launcher.run import (
    DEFAULT_READ_TIMEOUT,
    SERVER_LINGER,
    TOKEN_HOW,
    EventLog,
    in_thread,
    is_local_address,
    route_addr,
    run_agent,
)
from elastrun.procs import say
from elastrun.store.ballot import Ballot, BallotError, ballot_path
from elastrun.store.failover import Candidates, FailoverClient
from elastrun.store.term import FailoverTiming, Role, TermState
from elastrun.store.token import no_token_warning

if TYPE_CHECKING:
    from elastrun.rendezvous.rounds import Carry
    from elastrun.store.base import Store
    from elastrun.store.server import StoreServer

__all__ = ["DEFAULT_FAILOVER_TIMEOUT", "my_candidate", "run_with_candidates"]

DEFAULT_FAILOVER_TIMEOUT = 60.0  # --rdzv-conf failover_timeout


def _addresses(host: str) -> set[str]:
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return set()
    return {str(ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])) for info in infos}


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
    listen = await in_thread(functools.partial(listen_on, multi_node=True), host, port)

    def on_term(kind: str, detail: str) -> None:
        say(f"elastrun: {detail}")
        log.emit(
            "store", kind, term=state.term, candidate=str(candidates.endpoints[me]), detail=detail
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


def _ballot(plan: Plan, spec: WorkerSpec, candidates: Candidates) -> Ballot:
    """This candidate's ballot, kept in the cache folder (docs/failover.md,
    *Votes*); in memory only, with a warning, where that cannot be."""
    count = len(candidates.endpoints)
    me = candidates.me
    if me is None:
        return Ballot()
    try:
        cache = spec.warm_cache or default_cache_dir()
        path = ballot_path(cache, plan.rendezvous.run_id, str(candidates), me)
        return Ballot.load(path, count)
    except (OSError, BallotError) as exc:
        say(
            f"elastrun: warning: this candidate's votes are kept in memory only ({exc}): "
            "restarted while the job runs, it could vote twice in one election"
        )
        return Ballot(count=count)


async def run_with_candidates(
    plan: Plan, spec: WorkerSpec, hostname: str, log: EventLog, events: EventSink | None
) -> int:
    """Run this node's agent over the candidate hosts' store."""
    from elastrun.rendezvous.dynamic import DynamicRendezvous
    from elastrun.rendezvous.failover import FailoverRendezvous

    endpoints = plan.endpoints
    me = await in_thread(my_candidate, endpoints, plan.local_addr)
    candidates = Candidates(endpoints, me)
    timing = FailoverTiming()
    server = await _serve(plan, candidates, log, timing)
    if server is None:
        candidates = Candidates(endpoints, None)
    ballot = await in_thread(_ballot, plan, spec, candidates)
    read_timeout = plan.conf.read_timeout
    read_timeout = min(
        DEFAULT_READ_TIMEOUT if read_timeout is None else read_timeout,
        plan.rendezvous.join_timeout,
    )
    failover_timeout = plan.conf.failover_timeout
    client = FailoverClient(
        candidates,
        token=plan.token,
        server=server,
        timing=timing,
        request_timeout=read_timeout,
        failover_timeout=(
            DEFAULT_FAILOVER_TIMEOUT if failover_timeout is None else failover_timeout
        ),
        events=log.sink("store") or NullSink(),
        say=say,
        ballot=ballot,
    )
    try:
        await client.connect(plan.rendezvous.join_timeout)
        first = endpoints[0]
        addr = plan.local_addr or await in_thread(route_addr, *first) or hostname
        settings = dataclasses.replace(plan.rendezvous, host=hostname, addr=addr)
        sink = log.sink("rendezvous")

        def make(store: Store, carry: Carry | None, node_id: str | None) -> DynamicRendezvous:
            return DynamicRendezvous(store, settings, events=sink, node_id=node_id, carry=carry)

        rdzv = FailoverRendezvous(client, settings, make, events=sink, say=say)
        log.common["node_id"] = rdzv.node_id
        return await run_agent(spec, rdzv, events)
    finally:
        if client.store is not None:
            await asyncio.wait_for(client.store.close(), 5.0)
        if server is not None:
            deadline = SYSTEM_CLOCK.monotonic() + SERVER_LINGER
            while server.connection_count > 0 and SYSTEM_CLOCK.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await server.stop()
        ballot.forget()  # this node's part in the job is over
