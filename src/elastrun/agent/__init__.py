"""The elastic agent: starts, watches, stops and restarts one node's workers.

The launcher builds a :class:`WorkerSpec` and a rendezvous, then::

    exit_code = await Agent(spec, rendezvous, events).run()
"""

from elastrun.agent.agent import Agent
from elastrun.agent.spec import DEFAULT_LOG_TEMPLATE, Std, WorkerSpec

__all__ = ["DEFAULT_LOG_TEMPLATE", "Agent", "Std", "WorkerSpec"]
