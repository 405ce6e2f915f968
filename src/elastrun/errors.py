"""elastrun's exception tree.

Every error elastrun raises on purpose is an :class:`ElastrunError`. Errors of
third-party code (sockets, the etcd client, JSON decoding) are translated into
this tree at the boundary where they happen, so callers catch one family::

    ElastrunError
    ├── ConfigError                  bad flags or settings (names the flag)
    ├── StoreError                   the coordination store
    │   ├── StoreUnavailable         cannot reach it / connection lost (names addr:port)
    │   │   └── StoreTimeout         a request got no answer before its deadline
    │   ├── AuthenticationError      wrong or missing token / credentials
    │   ├── ProtocolError            malformed frame, unknown version, oversized frame
    │   ├── LeaseNotFound            the lease expired or was revoked
    │   └── RevisionCompacted        a watch asked for history that is no longer kept
    ├── RendezvousError              agreeing on membership
    │   ├── RendezvousTimeout        min nodes never joined before the join timeout
    │   ├── RendezvousClosed         the job finished or was closed
    │   ├── ConfigMismatch           this node's settings differ from the job's (names fields)
    │   └── RestartBudgetExhausted   the job-wide --max-restarts is used up
    └── WorkerError                  starting or stopping worker processes

Each exception's message is written for the person running the job: it says
what went wrong and, where there is one, what to do about it.
"""

from __future__ import annotations

__all__ = [
    "AuthenticationError",
    "ConfigError",
    "ConfigMismatch",
    "ElastrunError",
    "LeaseNotFound",
    "ProtocolError",
    "RendezvousClosed",
    "RendezvousError",
    "RendezvousTimeout",
    "RestartBudgetExhausted",
    "RevisionCompacted",
    "StoreError",
    "StoreTimeout",
    "StoreUnavailable",
    "WorkerError",
]


class ElastrunError(Exception):
    """Base of every error elastrun raises on purpose."""


class ConfigError(ElastrunError):
    """Invalid or contradictory configuration (a flag, a --rdzv-conf key, ...)."""


class StoreError(ElastrunError):
    """Something went wrong talking to the coordination store."""


class StoreUnavailable(StoreError):
    """The store could not be reached, or the connection to it was lost."""


class StoreTimeout(StoreUnavailable):
    """A store request got no answer before its deadline."""


class AuthenticationError(StoreError):
    """The store refused us: wrong or missing token or credentials."""


class ProtocolError(StoreError):
    """A peer sent something that is not valid elastrun wire protocol."""


class LeaseNotFound(StoreError):
    """The lease does not exist (it expired, or was revoked)."""


class RevisionCompacted(StoreError):
    """A watch asked to start at a revision whose history is no longer kept."""


class RendezvousError(ElastrunError):
    """The rendezvous could not complete."""


class RendezvousTimeout(RendezvousError):
    """Fewer than the minimum number of nodes joined before the join timeout."""


class RendezvousClosed(RendezvousError):
    """The job is finished or was closed; there will be no further rounds."""


class ConfigMismatch(RendezvousError):
    """This node's job settings differ from those the job was started with.

    ``fields`` maps each differing field to ``(job_value, this_node_value)``.
    """

    def __init__(self, message: str, fields: dict[str, tuple[object, object]]) -> None:
        super().__init__(message)
        self.fields = fields


class RestartBudgetExhausted(RendezvousError):
    """The job-wide restart budget (--max-restarts) is used up."""


class WorkerError(ElastrunError):
    """Starting, watching or stopping worker processes failed."""
