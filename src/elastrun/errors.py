"""elastrun's exception tree.

Every error elastrun raises on purpose is an :class:`ElastrunError`. Errors of
third-party code (sockets, the etcd client, JSON decoding) are translated into
this tree at the boundary where they happen, so callers catch one family::

    ElastrunError
    ├── ConfigError                  bad flags or settings (names the flag)
    ├── StoreError                   the coordination store
    │   ├── StoreUnavailable         cannot reach it / connection lost (names addr:port)
    │   │   ├── StoreTimeout         a request got no answer before its deadline
    │   │   ├── NotHost              a candidate host that does not serve the store (now)
    │   │   └── HostLost             the store's host is gone and no candidate took over
    │   ├── AuthenticationError      wrong or missing token / credentials
    │   ├── ProtocolError            malformed frame, unknown version, oversized frame
    │   ├── LeaseNotFound            the lease expired or was revoked
    │   ├── LimitExceeded            a value, request or answer over a store limit (names it)
    │   ├── WatchCancelled           the store ended a watch (it could not keep up)
    │   └── RevisionCompacted        a watch asked for history that is no longer kept
    │       └── StoreReset           the store restarted without its data and history
    ├── RendezvousError              agreeing on membership
    │   ├── RendezvousTimeout        min nodes never joined before the join timeout
    │   ├── RendezvousClosed         the job finished or was closed
    │   ├── ConfigMismatch           this node's settings differ from the job's (names fields)
    │   ├── RecordDamaged            a record the whole job agrees on does not decode (the key)
    │   └── RestartBudgetExhausted   the job-wide --max-restarts is used up
    ├── WorkerError                  starting or stopping worker processes
    └── NodeUnhealthy                this node failed its --health-check: it does not join

Each exception's message is written for the person running the job: it says
what went wrong and, where there is one, what to do about it.
"""

from __future__ import annotations

__all__ = [
    "AuthenticationError",
    "ConfigError",
    "ConfigMismatch",
    "ElastrunError",
    "HostLost",
    "LeaseNotFound",
    "LimitExceeded",
    "NodeUnhealthy",
    "NotHost",
    "ProtocolError",
    "RecordDamaged",
    "RendezvousClosed",
    "RendezvousError",
    "RendezvousTimeout",
    "RestartBudgetExhausted",
    "RevisionCompacted",
    "StoreError",
    "StoreReset",
    "StoreTimeout",
    "StoreUnavailable",
    "WatchCancelled",
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


class NotHost(StoreUnavailable):
    """A candidate host of the embedded store answered that it does not serve
    the store: it stands by (``role`` "standby") or stepped down ("fenced").
    ``term`` is the newest term it knows, ``host`` the host it knows of ("");
    ``voted``: the highest term in which it holds a vote for itself (0: none)."""

    def __init__(
        self, message: str, role: str = "standby", term: int = 0, host: str = "", voted: int = 0
    ) -> None:
        super().__init__(message)
        self.role = role
        self.term = term
        self.host = host
        self.voted = voted


class HostLost(StoreUnavailable):
    """The embedded store's host was lost and no candidate took over in time."""


class AuthenticationError(StoreError):
    """The store refused us: wrong or missing token or credentials."""


class ProtocolError(StoreError):
    """A peer sent something that is not valid elastrun wire protocol."""


class LeaseNotFound(StoreError):
    """The lease does not exist (it expired, or was revoked)."""


class LimitExceeded(StoreError):
    """A request, value or answer exceeds one of the store's documented limits
    (the message names the limit and its value)."""


class WatchCancelled(StoreError):
    """The store ended a watch, e.g. one whose consumer fell too far behind.
    ``next_revision`` is the first revision it did not deliver (0: unknown):
    read the current state and watch again from there."""

    def __init__(self, message: str, next_revision: int = 0) -> None:
        super().__init__(message)
        self.next_revision = next_revision


class RevisionCompacted(StoreError):
    """A watch asked for history that is no longer kept (etcd's "compacted").

    ``compact_revision`` is the oldest revision a watch may start from now
    (0: unknown). The remedy is to read the current state and watch from the
    revision after that read."""

    def __init__(self, message: str, compact_revision: int = 0) -> None:
        super().__init__(message)
        self.compact_revision = compact_revision


class StoreReset(RevisionCompacted):
    """The store restarted without its data: every key, lease and revision
    of before is gone (not only history). Unlike compaction, re-reading does
    not recover from this: the coordination state is lost."""


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


class RecordDamaged(RendezvousError):
    """A record the whole job agrees on (``config``, ``round``, a round's
    result) holds what is not one: someone other than elastrun wrote it. There
    is no other copy to go by, so the job cannot go on; the message names the
    key and what is wrong."""


class RestartBudgetExhausted(RendezvousError):
    """The job-wide restart budget (--max-restarts) is used up."""


class WorkerError(ElastrunError):
    """Starting, watching or stopping worker processes failed."""


class NodeUnhealthy(ElastrunError):
    """This node failed its ``--health-check`` command: it does not join the
    next round (the message says what failed)."""
