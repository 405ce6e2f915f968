"""elastrun: an elastic, fault-tolerant launcher for distributed PyTorch training.

The public namespace is curated here; everything else is an implementation
detail. Importing ``elastrun`` never imports torch, and imports the launcher
(the agent, the rendezvous, the store) only when ``launch`` or
``LaunchConfig`` is first used: a training script that imports
``elastrun.train`` gets the package without them (each restarted worker
would otherwise import about 80 modules it never uses, 0.3-1 s of every
restart on a loaded machine).
"""

from typing import TYPE_CHECKING, Any

from elastrun.errors import (
    AuthenticationError,
    ConfigError,
    ConfigMismatch,
    ElastrunError,
    RendezvousClosed,
    RendezvousError,
    RendezvousTimeout,
    RestartBudgetExhausted,
    StoreError,
    StoreTimeout,
    StoreUnavailable,
    WorkerError,
)
from elastrun.worker.record import record

if TYPE_CHECKING:
    from elastrun.launcher.api import launch
    from elastrun.launcher.config import LaunchConfig

__version__ = "0.1.0"

__all__ = [
    "AuthenticationError",
    "ConfigError",
    "ConfigMismatch",
    "ElastrunError",
    "LaunchConfig",
    "RendezvousClosed",
    "RendezvousError",
    "RendezvousTimeout",
    "RestartBudgetExhausted",
    "StoreError",
    "StoreTimeout",
    "StoreUnavailable",
    "WorkerError",
    "__version__",
    "launch",
    "record",
]

_LAZY = {"launch": "elastrun.launcher.api", "LaunchConfig": "elastrun.launcher.config"}


def __getattr__(name: str) -> Any:
    """``launch`` and ``LaunchConfig``, imported on first use."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'elastrun' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
