"""The elastic agent: starts, watches, stops and restarts one node's workers.

The launcher builds a :class:`WorkerSpec` (with what each worker runs: a
:class:`PythonScript`, :class:`PythonModule` or :class:`Executable`) and a
rendezvous, then::

    exit_code = await Agent(spec, rendezvous, events).run()
"""

from elastrun.agent.agent import Agent
from elastrun.agent.command import Executable, PythonModule, PythonScript, WorkerCommand
from elastrun.agent.spec import DEFAULT_LOG_TEMPLATE, Std, WorkerSpec

__all__ = [
    "DEFAULT_LOG_TEMPLATE",
    "Agent",
    "Executable",
    "PythonModule",
    "PythonScript",
    "Std",
    "WorkerCommand",
    "WorkerSpec",
]
