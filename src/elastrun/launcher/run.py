"""Wiring: a Plan -> store, rendezvous, agent; run them.

The plan holds the agent's and the rendezvous' settings; the run adds what
only it learns: this host's name and the address that routes to the store.
The store is hosted and linked by :mod:`elastrun.launcher.hosting` (one
store, or the embedded store's candidate hosts); the agent's event file is
:mod:`elastrun.launcher.event_log`'s.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
from typing import TYPE_CHECKING

from elastrun.agent.metrics import Metrics
from elastrun.agent.spec import WorkerSpec
from elastrun.endpoint import format_endpoints
from elastrun.event_kinds import AgentExited, AgentStarted
from elastrun.events import EventSink, TeeSink
from elastrun.launcher.event_log import EventLog, events_path
from elastrun.launcher.hosting import in_thread, link_candidates, link_store, route_addr
from elastrun.launcher.plan import Plan
from elastrun.procs import say
from elastrun.rendezvous.api import Rendezvous
from elastrun.store.factory import Backend

if TYPE_CHECKING:
    from elastrun.rendezvous.dynamic import DynamicRendezvous
    from elastrun.rendezvous.rounds import Carry
    from elastrun.store.base import Store

__all__ = ["run_async", "run_plan"]


async def run_agent(
    spec: WorkerSpec, rdzv: Rendezvous, events: EventSink | None, metrics: Metrics | None = None
) -> int:
    from elastrun.agent.agent import Agent
    from elastrun.launcher.error_file import pass_error_file

    agent = Agent(spec, rdzv, events, metrics=metrics)
    code = await agent.run()
    pass_error_file(agent.ended_by)  # to the launcher's TORCHELASTIC_ERROR_FILE, if set
    return code


async def run_async(plan: Plan, *, events: EventSink | None = None) -> int:
    """Run this node's agent for ``plan``; returns the process exit code."""
    hostname = plan.host_name or socket.gethostname()
    settings = plan.rendezvous
    for warning in plan.warnings:
        say(warning)
    if plan.generated_run_id and settings.max_nodes > 1:
        say(
            f"elastrun: warning: no --rdzv-id (run_id) was given: this job's id is "
            f"{plan.run_id}; other nodes can join it only if started with "
            f"--rdzv-id={plan.run_id}"
        )
    flag = "--events-file" if plan.workers.events_file else "--log-dir"
    # The Prometheus registry sees the rendezvous' events and the agent's.
    metrics = Metrics()
    user = metrics if events is None else TeeSink(events, metrics)
    log = EventLog(events_path(plan, hostname), user, flag, run_id=plan.run_id, host=hostname)
    code = 1
    try:
        log.emit(
            "launcher",
            AgentStarted(
                pid=os.getpid(),
                backend=plan.backend,
                endpoint=format_endpoints(plan.endpoints),
                min_nodes=settings.min_nodes,
                max_nodes=settings.max_nodes,
                node_unit=settings.node_unit,
                nproc=plan.workers.nproc,
                max_restarts=settings.max_restarts,
                node_rank=plan.node_rank,
            ),
        )
        code = await _run(plan, hostname, log, metrics)
        return code
    finally:
        log.emit("launcher", AgentExited(exit_code=code))
        log.close()


async def _run(plan: Plan, hostname: str, log: EventLog, metrics: Metrics) -> int:
    spec = dataclasses.replace(plan.workers, host=hostname)
    if log.file is not None:  # written here, with the rendezvous' events: not twice
        spec = dataclasses.replace(spec, events_file=None)
    events = log.sink("agent")

    if plan.backend is Backend.STATIC:
        from elastrun.rendezvous.static import StaticRendezvous

        master_addr, master_port = plan.endpoints[0]
        node_rank = plan.node_rank or 0
        route = None if node_rank == 0 else await in_thread(route_addr, master_addr, master_port)
        addr = plan.local_addr or (master_addr if node_rank == 0 else route or hostname)
        settings = dataclasses.replace(plan.rendezvous, host=hostname, addr=addr)
        rdzv = StaticRendezvous(
            settings, node_rank=node_rank, master_addr=master_addr, master_port=master_port
        )
        return await run_agent(spec, rdzv, events, metrics)

    if plan.failover:
        return await _run_candidates(plan, spec, hostname, log, events, metrics=metrics)

    async with link_store(plan, hostname) as link:
        from elastrun.rendezvous.dynamic import DynamicRendezvous

        settings = dataclasses.replace(plan.rendezvous, host=hostname, addr=link.addr)
        dynamic = DynamicRendezvous(link.store, settings, events=log.sink("rendezvous"))
        log.common["node_id"] = dynamic.node_id
        return await run_agent(spec, dynamic, events, metrics)


async def _run_candidates(
    plan: Plan,
    spec: WorkerSpec,
    hostname: str,
    log: EventLog,
    events: EventSink | None,
    *,
    metrics: Metrics,
) -> int:
    """Run this node's agent over the candidate hosts' store."""
    from elastrun.rendezvous.dynamic import DynamicRendezvous
    from elastrun.rendezvous.failover import FailoverRendezvous

    async with link_candidates(plan, hostname, spec.warm.cache, log) as link:
        settings = dataclasses.replace(plan.rendezvous, host=hostname, addr=link.addr)
        sink = log.sink("rendezvous")

        def make(store: Store, carry: Carry | None, node_id: str | None) -> DynamicRendezvous:
            return DynamicRendezvous(store, settings, events=sink, node_id=node_id, carry=carry)

        rdzv = FailoverRendezvous(link.client, settings, make, events=sink, say=say)
        log.common["node_id"] = rdzv.node_id
        return await run_agent(spec, rdzv, events, metrics)


def run_plan(plan: Plan, *, events: EventSink | None = None) -> int:
    """Blocking: run the agent in a fresh event loop. As torch's launcher,
    the launching process' environment says which signals it handles
    (``TORCHELASTIC_SIGNALS_TO_HANDLE``: code that starts processes with
    torch's own machinery in this process reads it)."""
    spec = plan.workers
    handled = (*spec.signals_to_handle, *spec.signals_to_forward)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = ",".join(s.name for s in handled)
    return asyncio.run(run_async(plan, events=events))
