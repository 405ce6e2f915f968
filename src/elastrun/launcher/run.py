"""Wiring: a Plan -> store, rendezvous, agent; run them.

The plan holds the agent's and the rendezvous' settings; the run adds what
only it learns: this host's name and the address that routes to the store.

Who hosts the embedded (c10d) store: ``is_host=1|0`` in
``--rdzv-conf`` decides; without it a node hosts the store when the endpoint's
host is an address of this machine (loopback counts) and the port is free. If
the port is taken, another agent on this machine is assumed to host it and
this one connects as a client. The hosting agent serves the store from its own
event loop until its agent finishes (after the exit barrier), listening on the
addresses the endpoint names (:mod:`elastrun.launcher.bind`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import ipaddress
import os
import socket
from typing import TYPE_CHECKING, Any

from elastrun.agent.log_dirs import open_event_log, run_dir
from elastrun.agent.spec import WorkerSpec
from elastrun.clock import SYSTEM_CLOCK
from elastrun.endpoint import Endpoint, format_endpoints
from elastrun.errors import ConfigError, StoreUnavailable
from elastrun.events import EventSink, JsonLinesSink
from elastrun.launcher.bind import describe, listen_on
from elastrun.launcher.plan import Backend, Plan
from elastrun.launcher.rdzv_conf import RendezvousConf
from elastrun.names import path_component
from elastrun.procs import say
from elastrun.rendezvous.api import Rendezvous
from elastrun.store.limits import DEFAULT_LIMITS, StoreLimits
from elastrun.store.token import TOKEN_ENV, no_token_warning

if TYPE_CHECKING:
    from elastrun.store.base import Store
    from elastrun.store.server import StoreServer

__all__ = ["hosted_limits", "is_local_address", "route_addr", "run_async", "run_plan"]

RESOLVE_TIMEOUT = 30.0
DEFAULT_READ_TIMEOUT = 60.0  # --rdzv-conf read_timeout: each store request after the first
WAITING_NOTICE_AFTER = 10.0
SERVER_LINGER = 5.0  # how long a hosting agent keeps serving for peers still connected
# How the launcher takes a token, for the warning of a store without one.
TOKEN_HOW = f"{TOKEN_ENV}=..., or --rdzv-conf token_file=PATH"


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


async def in_thread(fn: Any, *args: Any) -> Any:
    """Run a blocking resolver call, bounded (DNS can hang)."""
    loop = asyncio.get_running_loop()
    try:
        return await asyncio.wait_for(loop.run_in_executor(None, fn, *args), RESOLVE_TIMEOUT)
    except TimeoutError:
        raise ConfigError(
            f"resolving {args[0]!r} took longer than {RESOLVE_TIMEOUT:.0f} s (DNS?)"
        ) from None


async def _host_store(plan: Plan) -> tuple[StoreServer | None, Endpoint, str]:
    """Decide whether this agent hosts the c10d store; start it if so.

    Returns (server or None, endpoint to connect to, note for error messages)."""
    from elastrun.store.server import StoreServer

    endpoint = plan.endpoints[0]
    host, port = endpoint
    explicit = plan.conf.is_host
    if explicit is False:
        return None, endpoint, "is_host=0: another node hosts the store"
    local = bool(await in_thread(is_local_address, host))
    if explicit is None and not local:
        return None, endpoint, f"{host} is not an address of this machine"
    # Listen on the addresses the endpoint names (or --rdzv-conf store_bind).
    listen = await in_thread(
        functools.partial(
            listen_on,
            store_bind=plan.conf.store_bind,
            multi_node=plan.rendezvous.max_nodes > 1,
        ),
        host,
        port,
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
    from elastrun.store.factory import open_store

    # The first connection is retried up to join_timeout (agents may start
    # before the store's host); each later request is bounded by read_timeout
    # (never longer than join_timeout), so a store lost mid-job is reported
    # within it (and the lease TTL), not after join_timeout.
    timeout = plan.rendezvous.join_timeout
    read_timeout = plan.conf.read_timeout
    read_timeout = min(DEFAULT_READ_TIMEOUT if read_timeout is None else read_timeout, timeout)
    task = asyncio.ensure_future(
        open_store(
            plan.backend,
            endpoints,
            token=plan.token,
            conf=plan.conf.etcd_options(),
            timeout=timeout,
            request_timeout=read_timeout,
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


def events_path(plan: Plan, host: str) -> str | None:
    """The agent's event log: ``--events-file``, else
    ``{log_dir}/{run_id}/events-{host}.jsonl`` with ``--log-dir`` (its run
    folder made here, private: see :func:`elastrun.agent.log_dirs.run_dir`; a
    refused one is a ConfigError), else none."""
    spec = plan.workers
    if spec.events_file:
        return spec.events_file
    if spec.log_dir:
        name = path_component(host, "unknown-host")
        try:
            folder = run_dir(spec.log_dir, plan.run_id)
        except OSError as e:
            raise ConfigError(
                f"cannot open the event log in {spec.log_dir}: {e.strerror or e}"
            ) from None
        return os.path.join(folder, f"events-{name}.jsonl")
    return None


class EventLog:
    """One agent's event file (docs/events.md): the rendezvous' and the agent's
    events in one JSON-lines file, each with the common fields (run_id, host,
    node_id once known) and its ``source``. The caller's own sink (the Python
    API's) gets the same events, untouched."""

    def __init__(self, path: str | None, user: EventSink | None, flag: str, **common: Any) -> None:
        self.user = user
        self.common: dict[str, Any] = dict(common)
        self.file: JsonLinesSink | None = None
        if path:
            self.file = open_event_log(path, flag)

    def sink(self, source: str) -> EventSink | None:
        return self.user if self.file is None else _Tagged(self, source)

    def emit(self, source: str, kind: str, **fields: Any) -> None:
        if self.file is not None:
            with contextlib.suppress(OSError, ValueError):
                self.file.emit(kind, **{**self.common, "source": source, **fields})

    def close(self) -> None:
        if self.file is not None:
            with contextlib.suppress(OSError):
                self.file.close()


class _Tagged:
    def __init__(self, log: EventLog, source: str) -> None:
        self.log, self.source = log, source

    def emit(self, kind: str, **fields: Any) -> None:
        if self.log.user is not None:
            self.log.user.emit(kind, **fields)
        self.log.emit(self.source, kind, **fields)


async def run_agent(spec: WorkerSpec, rdzv: Rendezvous, events: EventSink | None) -> int:
    from elastrun.agent.agent import Agent

    return await Agent(spec, rdzv, events).run()


async def run_async(plan: Plan, *, events: EventSink | None = None) -> int:
    """Run this node's agent for ``plan``; returns the process exit code."""
    hostname = socket.gethostname()
    settings = plan.rendezvous
    if plan.generated_run_id and settings.max_nodes > 1:
        say(
            f"elastrun: warning: no --rdzv-id (run_id) was given: this job's id is "
            f"{plan.run_id}; other nodes can join it only if started with "
            f"--rdzv-id={plan.run_id}"
        )
    flag = "--events-file" if plan.workers.events_file else "--log-dir"
    log = EventLog(events_path(plan, hostname), events, flag, run_id=plan.run_id, host=hostname)
    code = 1
    try:
        log.emit(
            "launcher",
            "agent_started",
            pid=os.getpid(),
            backend=plan.backend,
            endpoint=format_endpoints(plan.endpoints),
            min_nodes=settings.min_nodes,
            max_nodes=settings.max_nodes,
            node_unit=settings.node_unit,
            nproc=plan.workers.nproc,
            max_restarts=settings.max_restarts,
            node_rank=plan.node_rank,
        )
        code = await _run(plan, hostname, log)
        return code
    finally:
        log.emit("launcher", "agent_exited", exit_code=code)
        log.close()


async def _run(plan: Plan, hostname: str, log: EventLog) -> int:
    spec = dataclasses.replace(plan.workers, host=hostname)
    if log.file is not None:  # written here, with the rendezvous' events: not twice
        spec = dataclasses.replace(spec, events_file=None)
    events = log.sink("agent")

    if plan.backend is Backend.STATIC:
        from elastrun.rendezvous.static import StaticRendezvous

        master_addr, master_port = plan.endpoints[0]
        node_rank = plan.node_rank or 0
        addr = plan.local_addr or (
            master_addr if node_rank == 0 else await in_thread(route_addr, master_addr, master_port)
        )
        settings = dataclasses.replace(plan.rendezvous, host=hostname, addr=addr)
        rdzv = StaticRendezvous(
            settings, node_rank=node_rank, master_addr=master_addr, master_port=master_port
        )
        return await run_agent(spec, rdzv, events)

    if plan.failover:
        from elastrun.launcher.failover import run_with_candidates

        return await run_with_candidates(plan, spec, hostname, log, events)

    server: StoreServer | None = None
    note = "etcd cluster"
    endpoints = plan.endpoints
    if plan.backend is Backend.C10D:
        server, store_at, note = await _host_store(plan)
        endpoints = (store_at,)
    try:
        addr = plan.local_addr or await in_thread(route_addr, *endpoints[0]) or hostname
        me = f"{hostname} ({addr})"
        settings = dataclasses.replace(plan.rendezvous, host=hostname, addr=addr)
        store = await _open_store(plan, endpoints, me, note)
        try:
            from elastrun.rendezvous.dynamic import DynamicRendezvous

            dynamic = DynamicRendezvous(store, settings, events=log.sink("rendezvous"))
            log.common["node_id"] = dynamic.node_id
            return await run_agent(spec, dynamic, events)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(store.close(), 5.0)
    finally:
        if server is not None:
            # Peers may still be leaving (their last writes): keep serving them, bounded.
            deadline = SYSTEM_CLOCK.monotonic() + SERVER_LINGER
            while server.connection_count > 0 and SYSTEM_CLOCK.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await server.stop()


def run_plan(plan: Plan, *, events: EventSink | None = None) -> int:
    """Blocking: run the agent in a fresh event loop. As torch's launcher,
    the launching process' environment says which signals it handles
    (``TORCHELASTIC_SIGNALS_TO_HANDLE``: code that starts processes with
    torch's own machinery in this process reads it)."""
    spec = plan.workers
    handled = (*spec.signals_to_handle, *spec.signals_to_forward)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = ",".join(s.name for s in handled)
    return asyncio.run(run_async(plan, events=events))


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
