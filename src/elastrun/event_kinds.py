"""The event catalogue: one frozen dataclass per kind of event (docs/events.md).

Every event elastrun writes to an event log is one of these: its ``KIND`` is
the line's ``kind``, its fields are the line's event-specific fields (the sink
adds ``v``, ``ts`` and the common fields: ``source``, ``run_id``, ``host``,
``node_id``). A field declared in ``OMITTED`` is left out of the line when it
is None (it is absent in some events of that kind, as docs/events.md says).

Two kinds have two sources with different fields: ``job_finished`` and
``job_failed`` are :class:`JobFinished` / :class:`JobFailed` (the agent's end)
and :class:`JobMarkedFinished` / :class:`JobMarkedFailed` (the rendezvous
marks the job's end in the store). :func:`parse_event` reads a decoded line
back as its event, or None when the line is not one.

Nested values are typed where a type exists: a failure is a
:class:`~elastrun.failure.FailureRecord`, written as its ``to_json()``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar, Union, dataclass_transform

from elastrun.failure import FailureRecord
from elastrun.frozen import frozen

__all__ = ["CATALOGUE", "Event", "event_classes", "parse_event"]

JSONScalar = str | int | float | bool | None
Promotion = dict[str, str | int | None]  # {node, group_rank, replaces}


@frozen
class Event:
    """One event: ``KIND`` and typed fields (subclasses, each an :func:`event_kind`)."""

    KIND: ClassVar[str] = ""
    OMITTED: ClassVar[frozenset[str]] = frozenset()

    def to_json(self) -> dict[str, Any]:
        """The event's fields as JSON values (a FailureRecord as its ``to_json()``)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.name in self.OMITTED:
                continue
            out[f.name] = value.to_json() if isinstance(value, FailureRecord) else value
        return out


_E = TypeVar("_E", bound=Event)


@dataclass_transform(frozen_default=True)
def event_kind(cls: type[_E]) -> type[_E]:
    """A kind of event: ``@frozen`` (elastrun/frozen.py), with a docstring naming
    its kind where it has none (``@dataclass`` would make one from the class's
    signature, a sixth of the cost of building it: every agent start builds
    this catalogue's ~80 classes)."""
    if not cls.__doc__:
        cls.__doc__ = f"The ``{cls.KIND}`` event (docs/events.md)."
    return frozen(cls)


# ------------------------------------------------------------------ launcher
@event_kind
class AgentStarted(Event):
    KIND = "agent_started"
    pid: int
    backend: str
    endpoint: str
    min_nodes: int
    max_nodes: int
    node_unit: int
    nproc: int
    max_restarts: int
    node_rank: int | None


@event_kind
class AgentExited(Event):
    KIND = "agent_exited"
    exit_code: int


# ---------------------------------------------------------------- rendezvous
@event_kind
class RoundOpened(Event):
    KIND = "round_opened"
    OMITTED = frozenset({"detail", "node", "by"})
    round: int
    reason: str
    detail: str | None = None
    node: str | None = None
    by: str | None = None


@event_kind
class NodeJoined(Event):
    KIND = "node_joined"
    round: int
    node: str
    host: str


@event_kind
class NodeWaiting(Event):
    KIND = "node_waiting"
    round: int
    node: str
    host: str
    reason: str
    spare: bool


@event_kind
class RendezvousWaiting(Event):
    KIND = "rendezvous_waiting"
    node: str
    round: int
    state: str
    joined: int
    min: int
    max: int
    deadline: str
    seconds_left: float | None
    live: bool
    detail: str


@event_kind
class RoundJoined(Event):
    KIND = "round_joined"
    round: int
    node: str
    group_rank: int
    previous_group_rank: int | None
    group_world_size: int
    world_size: int
    members: int
    master: str
    restart_count: int


@event_kind
class RoundClosed(Event):
    KIND = "round_closed"
    round: int
    reason: str
    members: list[str]
    ranks: dict[str, int]
    promoted: list[Promotion]
    spares: list[str]


@event_kind
class SparePromoted(Event):
    KIND = "spare_promoted"
    round: int
    node: str
    group_rank: int
    replaces: str | None


@event_kind
class NodeLost(Event):
    KIND = "node_lost"
    round: int
    detail: str
    by: str


@event_kind
class RestartRequested(Event):
    KIND = "restart_requested"
    node: str
    failure: FailureRecord


@event_kind
class RootCauseElsewhere(Event):
    KIND = "root_cause_elsewhere"
    round: int
    attempt: int
    failure: FailureRecord
    node_failure: FailureRecord


@event_kind
class ConfigMismatched(Event):
    KIND = "config_mismatch"
    node: str
    message: str
    fields: list[str]


@event_kind
class JobReset(Event):
    KIND = "job_reset"
    node: str
    reason: str
    previous_round: int | None
    previous_state: str | None
    previous_restarts: int | None
    previous_settings: dict[str, Any] | None
    last_failure: FailureRecord | None


@event_kind
class JobMarkedFinished(Event):
    KIND = "job_finished"
    round: int


@event_kind
class JobMarkedFailed(Event):
    KIND = "job_failed"
    round: int
    reason: str


@event_kind
class NodeLeft(Event):
    KIND = "node_left"
    node: str
    host: str


@event_kind
class LeaseRegained(Event):
    KIND = "lease_regained"
    node: str
    lost: str
    tries: int
    after_s: float


@event_kind
class RecordSkipped(Event):
    KIND = "record_skipped"
    node: str
    key: str
    revision: int
    problem: str


@event_kind
class WatchReread(Event):
    KIND = "watch_reread"
    node: str
    phase: str
    round: int | None
    reason: str


# ------------------------------------------------------------ store failover
@event_kind
class StoreTakeover(Event):
    KIND = "store_takeover"
    term: int
    candidate: str
    detail: str


@event_kind
class StoreSteppedDown(Event):
    KIND = "store_stepped_down"
    term: int
    candidate: str
    detail: str


@event_kind
class StoreStandby(Event):
    KIND = "store_standby"
    term: int
    candidate: str
    detail: str


@event_kind
class StoreCandidateUnreachable(Event):
    KIND = "store_candidate_unreachable"
    candidate: str
    answer: str
    detail: str


@event_kind
class StoreHostLost(Event):
    KIND = "store_host_lost"
    term: int
    host: str
    cause: str


@event_kind
class StoreVote(Event):
    KIND = "store_vote"
    term: int
    candidate: str


@event_kind
class StoreHostFound(Event):
    KIND = "store_host_found"
    term: int
    host: str
    previous_term: int
    previous_host: str


# --------------------------------------------------------------------- agent
@event_kind
class WorkersStarted(Event):
    KIND = "workers_started"
    round: int
    attempt: int
    restart_count: int
    pids: list[int]
    ranks: list[int]
    local_ranks: list[int]
    warm: list[bool]
    world_size: int
    group_rank: int
    master: str


@event_kind
class WorkerExited(Event):
    KIND = "worker_exited"
    round: int
    attempt: int
    rank: int
    local_rank: int
    pid: int
    exitcode: int | None
    signal: str | None
    cause: str
    stopped_by_agent: bool


@event_kind
class WorkersStopping(Event):
    KIND = "workers_stopping"
    signal: str
    pids: list[int]
    grace: float


@event_kind
class WorkersKilled(Event):
    KIND = "workers_killed"
    pids: list[int]
    after_grace: float


@event_kind
class WorkersUnkillable(Event):
    KIND = "workers_unkillable"
    pids: list[int]


@event_kind
class RanksLeft(Event):
    """In-process restarts: the group failed; the ranks whose processes left
    their function in time are kept, the others are replaced."""

    KIND = "ranks_left"
    round: int
    attempt: int
    kept: list[int]  # local ranks whose processes the next round takes over
    kept_pids: list[int]
    replaced: list[int]  # local ranks whose processes end (restarted as new ones)
    waited_s: float


@event_kind
class RanksKept(Event):
    """In-process restarts: a round's workers, some of them kept processes
    (told to enter their function again), the others started."""

    KIND = "ranks_kept"
    round: int
    attempt: int
    kept: list[int]  # ranks (global) of kept processes
    kept_pids: list[int]
    started: list[int]  # ranks (global) started as new processes


@event_kind
class StandbyStarted(Event):
    """A standby process was started (agent/standby.py): it runs the script
    up to its in-process function without a rank, then waits."""

    KIND = "standby_started"
    pid: int
    attempt: int  # the how-manieth standby of this agent (0-based)


@event_kind
class StandbyReady(Event):
    """A standby reached the script's in-process function (its setup done)."""

    KIND = "standby_ready"
    pid: int
    setup_s: float  # s from its start


@event_kind
class StandbyUsed(Event):
    """A rank whose process is gone is served by a ready standby: its process
    takes the rank and enters the function with the round's variables."""

    KIND = "standby_used"
    round: int
    attempt: int
    rank: int
    local_rank: int
    pid: int
    waited_s: float  # s the standby was ready before it was used


@event_kind
class StandbyFailed(Event):
    """A standby ended or was stopped before it served a rank (its setup
    raised, it exited, it was not ready in time); ``retry``: another is
    started (consecutive failures are bounded: agent/standby.py)."""

    KIND = "standby_failed"
    pid: int
    reason: str
    retry: bool


@event_kind
class RankEntered(Event):
    """A worker's process entered its in-process function in ``round``
    (``again``: re-entered, a kept process), as its runner reported."""

    KIND = "rank_entered"
    round: int
    attempt: int
    rank: int
    local_rank: int
    pid: int
    world_size: int
    master: str
    again: bool


@event_kind
class WorkersSucceeded(Event):
    KIND = "workers_succeeded"
    round: int
    attempt: int


@event_kind
class Restart(Event):
    KIND = "restart"
    OMITTED = frozenset({"detail", "failure"})
    round: int
    count: int
    reason: str
    counted: bool
    detail: str | None = None
    failure: FailureRecord | None = None


@event_kind
class WarmStarted(Event):
    KIND = "warm_started"
    pid: int
    modules: int
    local_rank: int | None


@event_kind
class WarmReady(Event):
    KIND = "warm_ready"
    pid: int
    local_rank: int | None
    preload_s: float
    loaded: int
    failed: list[str]
    rss_mb: float
    stopped: str | None


@event_kind
class WarmUsed(Event):
    KIND = "warm_used"
    local_rank: int
    pid: int
    zygote: int
    per_rank: bool
    warm_s: float
    waited_s: float


@event_kind
class WarmDiscarded(Event):
    KIND = "warm_discarded"
    pid: int
    reason: str
    local_rank: int | None


@event_kind
class WarmFailed(Event):
    KIND = "warm_failed"
    OMITTED = frozenset({"local_rank"})
    reason: str
    local_rank: int | None = None


@event_kind
class ModulesRecorded(Event):
    KIND = "modules_recorded"
    modules: int
    new: int
    why: str
    cache: str | None


@event_kind
class ModulesNoteIgnored(Event):
    KIND = "modules_note_ignored"
    reason: str


@event_kind
class WarmJoin(Event):
    KIND = "warm_join"
    waited_s: float
    ready: bool
    timeout: float


@event_kind
class GpuMemoryWait(Event):
    KIND = "gpu_memory_wait"
    pids: list[int]
    mib: int
    waited_s: float
    released: bool
    timeout: float


@event_kind
class SignalForwarded(Event):
    KIND = "signal_forwarded"
    signal: str


@event_kind
class FileTimersStarted(Event):
    KIND = "file_timers_started"
    path: str
    pipes: int


@event_kind
class FileTimersFailed(Event):
    KIND = "file_timers_failed"
    path: str
    error: str


@event_kind
class FileTimerRefused(Event):
    KIND = "file_timer_refused"
    pid: int
    local_rank: int


@event_kind
class FileTimerExpired(Event):
    KIND = "file_timer_expired"
    rank: int
    local_rank: int
    pid: int
    scope: str
    signal: str


@event_kind
class HealthCheckStarted(Event):
    KIND = "health_check_started"
    port: int
    hosts: list[str]


@event_kind
class HealthCheckFailed(Event):
    KIND = "health_check_failed"
    port: int
    error: str


@event_kind
class MetricsStarted(Event):
    KIND = "metrics_started"
    port: int
    hosts: list[str]


@event_kind
class MetricsFailed(Event):
    KIND = "metrics_failed"
    port: int
    error: str


@event_kind
class HangDetected(Event):
    KIND = "hang_detected"
    round: int
    attempt: int
    rank: int
    local_rank: int
    pid: int
    last_step: int | None
    idle_s: float
    hang_timeout: float
    auto: bool
    phase: str | None
    judged_rank: int
    sits_in: dict[int, str]  # rank -> "func (file:line)"; JSON keys are strings


@event_kind
class HangSuspected(Event):
    KIND = "hang_suspected"
    round: int
    rank: int
    idle_s: float
    sits_in: str


@event_kind
class ProgressWriteFailed(Event):
    KIND = "progress_write_failed"
    round: int
    attempt: int
    rank: int
    local_rank: int
    path: str | None
    error: str
    relayed: bool


@event_kind
class ProgressUnknown(Event):
    KIND = "progress_unknown"
    round: int
    attempt: int
    rank: int
    local_rank: int
    why: str


@event_kind
class StacksSkipped(Event):
    KIND = "stacks_skipped"
    round: int
    attempt: int
    rank: int
    local_rank: int
    signal: str
    why: str


@event_kind
class Straggler(Event):
    KIND = "straggler"
    round: int
    rank: int
    own_time_s: float
    median_s: float | None


@event_kind
class LogWriteFailed(Event):
    KIND = "log_write_failed"
    path: str
    error: str
    errno: int | None
    rank: int | None
    local_rank: int | None
    stream: str | None


@event_kind
class LogOutputLost(Event):
    KIND = "log_output_lost"
    path: str
    bytes: int
    error: str
    rank: int | None
    stream: str | None


@event_kind
class MemoryCheckpointPersisted(Event):
    KIND = "memory_checkpoint_persisted"
    local_rank: int
    rank: int
    step: int
    path: str
    bytes: int
    seconds: float


@event_kind
class MemoryCheckpointPersistFailed(Event):
    KIND = "memory_checkpoint_persist_failed"
    local_rank: int
    step: int
    reason: str


@event_kind
class MemoryReplicaSent(Event):
    KIND = "memory_replica_sent"
    local_rank: int
    rank: int
    step: int
    to: str
    bytes: int
    seconds: float


@event_kind
class MemoryReplicaSendFailed(Event):
    KIND = "memory_replica_send_failed"
    local_rank: int
    rank: int
    step: int
    reason: str


@event_kind
class MemoryReplicaReceived(Event):
    KIND = "memory_replica_received"
    rank: int
    step: int
    node: str
    bytes: int
    authenticated: bool


@event_kind
class MemoryReplicaRefused(Event):
    KIND = "memory_replica_refused"
    peer: str
    reason: str


@event_kind
class GoodputAccounted(Event):
    KIND = "goodput"
    seconds: dict[str, float]  # cause -> s (agent/goodput.py)
    failures: int
    hangs: int
    steps_redone: int
    steps_known: bool
    goodput: float | None


@event_kind
class JobFinished(Event):
    KIND = "job_finished"
    exit_code: int
    reason: str


@event_kind
class JobFailed(Event):
    KIND = "job_failed"
    OMITTED = frozenset({"detail", "files", "failure"})
    exit_code: int
    reason: str
    detail: str | None = None
    files: list[str] | None = None
    failure: FailureRecord | None = None


# --------------------------------------------------------- fault attribution
@event_kind
class FaultVerdict(Event):
    """The verdict on the job's failed rounds (agent/attribution.py): a node
    fault or a script fault (a transient failure writes none)."""

    KIND = "fault_verdict"
    OMITTED = frozenset({"rank", "step"})
    round: int
    verdict: str  # node_fault | script_fault
    node: str  # the faulty node (node fault), or where the rank last failed
    failure: str  # "ValueError: bad batch", "killed by SIGBUS"
    rounds: list[int]  # the failed rounds the verdict rests on
    summary: str
    action: str  # stop | quarantine | leaves | stays | none
    rank: int | None = None
    step: int | None = None


@event_kind
class NodeQuarantined(Event):
    """This node was judged faulty and leaves the job, kept out until ``until``."""

    KIND = "node_quarantined"
    quarantined_host: str
    until: float  # wall clock
    reason: str
    recorded: bool  # the record was written (false: the store refused or held too many)


@event_kind
class NodeHealthFailed(Event):
    """This node's ``--health-check`` command failed (agent/node_health.py)."""

    KIND = "node_health_failed"
    command: str
    when: str  # before_round | training
    reason: str  # "exited with code 1", "timed out after 60 s (killed)", "cannot run ..."
    output: str  # its last output (at most 2 KiB, escaped)


@event_kind
class QuarantineRefused(Event):
    """The agent started on a quarantined node: it does not join."""

    KIND = "quarantine_refused"
    quarantined_host: str
    until: float
    reason: str


@event_kind
class StragglerReplacement(Event):
    """Group rank 0's agent judged a node a persistent straggler
    (``--replace-stragglers``): it replaced it with a waiting spare (its
    quarantine record written), or only reported it (``why``)."""

    KIND = "straggler_replacement"
    round: int
    node: str  # the straggler's host
    node_id: str
    ranks: list[int]
    intervals: int  # intervals in a row it was named
    replaced: bool
    why: str  # what was done, or why not
    until: float | None  # wall clock: kept out until (replaced only)


# ------------------------------------------------------------------- reading
CATALOGUE: tuple[type[Event], ...] = tuple(
    cls
    for cls in list(globals().values())
    if isinstance(cls, type) and issubclass(cls, Event) and cls is not Event
)
_BY_KIND: dict[str, list[type[Event]]] = {}
for _cls in CATALOGUE:
    _BY_KIND.setdefault(_cls.KIND, []).append(_cls)


def event_classes(kind: str) -> tuple[type[Event], ...]:
    """The classes of ``kind`` (two for ``job_finished`` and ``job_failed``)."""
    return tuple(_BY_KIND.get(kind, ()))


def parse_event(raw: Mapping[str, object]) -> Event | None:
    """The event a decoded line holds (the fields the sink added ignored), or None:
    an unknown kind, a field missing, or a field of the wrong type."""
    kind = raw.get("kind")
    if not isinstance(kind, str):
        return None
    for cls in _BY_KIND.get(kind, ()):
        event = _build(cls, raw)
        if event is not None:
            return event
    return None


def _build(cls: type[Event], raw: Mapping[str, object]) -> Event | None:
    hints = typing.get_type_hints(cls)
    values: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            if f.default is dataclasses.MISSING:
                return None
            continue
        ok, value = _read(raw[f.name], hints[f.name])
        if not ok:
            return None
        values[f.name] = value
    return cls(**values)


_SCALARS: dict[object, Callable[[object], bool]] = {
    type(None): lambda v: v is None,
    bool: lambda v: isinstance(v, bool),
    int: lambda v: isinstance(v, int) and not isinstance(v, bool),
    float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    str: lambda v: isinstance(v, str),
    Any: lambda v: True,
}


def _read(value: object, tp: object) -> tuple[bool, object]:
    """(whether ``value`` is a ``tp``, the value read as one)."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        for arm in typing.get_args(tp):
            ok, got = _read(value, arm)
            if ok:
                return True, got
        return False, None
    if tp is FailureRecord:
        record = FailureRecord.from_json(value)
        return record is not None, record
    if origin is list:
        return _read_list(value, typing.get_args(tp)[0])
    if origin is dict:
        key_tp, item = typing.get_args(tp)
        return _read_dict(value, key_tp, item)
    fits = _SCALARS.get(tp)
    return (fits is not None and fits(value)), value


def _read_list(value: object, item: object) -> tuple[bool, object]:
    if not isinstance(value, list):
        return False, None
    read = [_read(v, item) for v in value]
    return all(ok for ok, _ in read), [v for _, v in read]


def _read_dict(value: object, key_tp: object, item: object) -> tuple[bool, object]:
    if not isinstance(value, dict):
        return False, None
    out: dict[object, object] = {}
    for k, v in value.items():
        ok, key = _read_key(k, key_tp)
        ok_v, got = _read(v, item)
        if not (ok and ok_v):
            return False, None
        out[key] = got
    return True, out


def _read_key(key: object, tp: object) -> tuple[bool, object]:
    if tp is int and isinstance(key, str):  # JSON object keys are strings
        try:
            return True, int(key)
        except ValueError:
            return False, None
    return _read(key, tp)
