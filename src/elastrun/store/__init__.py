"""The coordination store: an etcd-shaped interface and its implementations.

``open_store(backend, endpoint, ...)`` (in :mod:`elastrun.store.factory`) picks
an implementation from a ``--rdzv-backend`` name.
"""

from elastrun.store.base import (
    NO_LEASE,
    Compare,
    Count,
    Delete,
    Get,
    KeyValue,
    Op,
    Put,
    Store,
    TxnResult,
    Watch,
    WatchEvent,
)
from elastrun.store.memory import MemoryStore

__all__ = [
    "NO_LEASE",
    "Compare",
    "Count",
    "Delete",
    "Get",
    "KeyValue",
    "MemoryStore",
    "Op",
    "Put",
    "Store",
    "TxnResult",
    "Watch",
    "WatchEvent",
]
