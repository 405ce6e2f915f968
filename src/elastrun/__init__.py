"""elastrun: an elastic, fault-tolerant launcher for distributed PyTorch training.

The public namespace is curated here; everything else is an implementation
detail. Importing ``elastrun`` never imports torch.
"""

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
from elastrun.launcher.api import launch
from elastrun.launcher.config import LaunchConfig
from elastrun.worker.record import record

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
