"""Prometheus metrics (``--metrics-port``): what the agent sees, in the text format.

:class:`Metrics` is the agent's registry: an event sink fed every event of the
rendezvous and of the agent (launcher/run.py tees it in), plus the goodput
accounting's live figures (agent/goodput.py sets ``Metrics.goodput`` and
``Metrics.step_time``). :meth:`Metrics.render` writes the exposition (format
0.0.4) at scrape time from the numbers it keeps; nothing is computed between
scrapes. Served by agent/metrics_server.py (the health check's bounded server
answering ``GET /metrics``).

Why written by hand rather than with ``prometheus_client``: the agent imports
nothing it does not need (it starts in milliseconds, beside workers that
import torch) and its HTTP server must be the bounded one (a fixed number of
connections, a bounded request, a read deadline, one non-blocking send:
``prometheus_client``'s server runs a thread per scrape, with no bound on
connections). The text format is a few lines per metric; the exposition
here is tested against the format's rules.

Label values are bounded: a label's values come from the agent's own small
sets (causes of loss, event reasons), at most ``MAX_LABEL_VALUES`` per metric
(more go to ``other``; the restarts' reasons each twice, ``counted`` or not),
each at most ``MAX_LABEL_CHARS`` characters and escaped;
the store host is one series at a time. A scrape's answer is therefore bounded
(about 8 KiB), and scrapes keep no state.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from elastrun.event_kinds import (
    Event,
    MemoryCheckpointPersisted,
    Restart,
    RoundClosed,
    RoundJoined,
    StoreHostFound,
    StoreTakeover,
    Straggler,
    WorkerExited,
)
from elastrun.goodput import Cause, Goodput

__all__ = ["CONTENT_TYPE", "MAX_LABEL_VALUES", "RECOVERY_BUCKETS", "Metrics"]

MAX_LABEL_VALUES = 16  # per metric; more are counted as "other"
MAX_LABEL_CHARS = 64
RECOVERY_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_WORD = re.compile(r"[a-z][a-z0-9_]*")


def _label(value: str) -> str:
    """A label value, escaped as the format says, and cut."""
    value = value[:MAX_LABEL_CHARS]
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@dataclass
class _ByLabel:
    """A counter by label values: the first label with at most
    ``MAX_LABEL_VALUES`` values (more are counted as "other"), any further
    ones from the agent's own fixed sets (``counted``: "true", "false")."""

    counts: dict[tuple[str, ...], float] = field(default_factory=dict)
    firsts: set[str] = field(default_factory=set)

    def add(self, value: str, *more: str) -> None:
        key = value if _WORD.fullmatch(value) else "other"
        if key not in self.firsts and len(self.firsts) >= MAX_LABEL_VALUES:
            key = "other"
        self.firsts.add(key)
        self.counts[(key, *more)] = self.counts.get((key, *more), 0.0) + 1.0


@dataclass
class _Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def observe(self, value: float) -> None:
        if not self.counts:
            self.counts = [0] * len(self.buckets)
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.n += 1


@dataclass
class Metrics:
    """The agent's registry (an event sink; see the module's docstring)."""

    round: int | None = None
    world_size: int | None = None
    members: int | None = None
    spares: int | None = None
    group_rank: int | None = None
    restarts: _ByLabel = field(default_factory=_ByLabel)
    worker_exits: _ByLabel = field(default_factory=_ByLabel)
    recovery: _Histogram = field(default_factory=lambda: _Histogram(RECOVERY_BUCKETS))
    stragglers: int = 0
    straggler_score: float = 0.0
    store_term: int | None = None
    store_host: str | None = None
    persisted: int = 0
    persisted_bytes: int = 0
    persisted_seconds: float = 0.0
    saves: int = 0  # the workers' memory checkpoint saves (agent/memory.py counts them)
    saves_blocked: float = 0.0
    saves_bytes: int = 0
    scrapes: int = 0
    # Set by the goodput accounting (agent/goodput.py).
    goodput: Callable[[], Goodput] | None = None
    step_time: Callable[[], float | None] | None = None

    def emit(self, event: Event) -> None:
        match event:
            case RoundJoined():
                self.round, self.world_size = event.round, event.world_size
                self.members, self.group_rank = event.members, event.group_rank
                self.stragglers, self.straggler_score = 0, 0.0
            case RoundClosed():
                self.spares = len(event.spares)
            case Restart():  # written once the next round formed, with its charge
                self.restarts.add(event.reason, "true" if event.counted else "false")
            case WorkerExited() if event.cause != "ok":
                self.worker_exits.add(event.cause)
            case Straggler():
                self.stragglers += 1
                if event.median_s:
                    score = event.own_time_s / event.median_s
                    self.straggler_score = max(self.straggler_score, score)
            case StoreTakeover():
                self.store_term, self.store_host = event.term, event.candidate
            case StoreHostFound():
                self.store_term, self.store_host = event.term, event.host
            case MemoryCheckpointPersisted():
                self.persisted += 1
                self.persisted_bytes += event.bytes
                self.persisted_seconds += event.seconds
            case _:
                pass

    def saved(self, saves: int, blocked_s: float, nbytes: int) -> None:
        """The workers made ``saves`` more memory checkpoint saves, which kept
        training waiting ``blocked_s`` and copied ``nbytes`` of state."""
        self.saves += saves
        self.saves_blocked += blocked_s
        self.saves_bytes += nbytes

    def recovered(self, seconds: float) -> None:
        """A restart's recovery: from its cause to the first step after it."""
        self.recovery.observe(seconds)

    # ------------------------------------------------------------ the text
    def render(self) -> bytes:
        """The exposition (format 0.0.4)."""
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            out.append(f"# HELP elastrun_{name} {help_}")
            out.append(f"# TYPE elastrun_{name} {kind}")
            out.extend(f"elastrun_{name}{labels} {value:g}" for labels, value in samples)

        def one(name: str, kind: str, help_: str, value: float | None) -> None:
            if value is not None:
                metric(name, kind, help_, [("", value)])

        one("round", "gauge", "The rendezvous round the node's workers run in.", self.round)
        one("world_size", "gauge", "Workers in the job (the round's world size).", self.world_size)
        one("members", "gauge", "Nodes in the round.", self.members)
        one("spares", "gauge", "Nodes waiting as hot spares when the round closed.", self.spares)
        one("group_rank", "gauge", "This node's group rank.", self.group_rank)
        metric(
            "restarts_total",
            "counter",
            "Rounds ended for a restart or a membership change, by reason and by whether "
            "the rendezvous counted it against --max-restarts.",
            [
                (f'{{reason="{_label(k)}",counted="{c}"}}', v)
                for (k, c), v in sorted(self.restarts.counts.items())
            ],
        )
        metric(
            "worker_failures_total",
            "counter",
            "This node's workers that ended other than ok, by cause.",
            [
                (f'{{cause="{_label(k)}"}}', v)
                for (k,), v in sorted(self.worker_exits.counts.items())
            ],
        )
        h = self.recovery
        counts = h.counts or [0] * len(h.buckets)
        buckets = [
            (f'_bucket{{le="{b:g}"}}', float(c)) for b, c in zip(h.buckets, counts, strict=True)
        ]
        buckets += [('_bucket{le="+Inf"}', float(h.n)), ("_sum", h.total), ("_count", float(h.n))]
        out.append(
            "# HELP elastrun_recovery_seconds From a restart's cause to the first step after it."
        )
        out.append("# TYPE elastrun_recovery_seconds histogram")
        out.extend(f"elastrun_recovery_seconds{suffix} {v:g}" for suffix, v in buckets)
        figures = self.goodput() if self.goodput is not None else None
        if figures is not None:
            one(
                "goodput_ratio",
                "gauge",
                "Training time over the time since training began.",
                figures.ratio,
            )
            metric(
                "goodput_seconds",
                "gauge",
                "This node's wall time by cause (docs/reliability.md, Goodput).",
                [(f'{{cause="{c.value}"}}', figures.of(c)) for c in Cause],
            )
            one(
                "goodput_failures",
                "gauge",
                "Restarts the goodput accounting counted.",
                figures.failures,
            )
            one("steps_redone", "gauge", "Steps done again after restarts.", figures.steps_redone)
        step_time = self.step_time() if self.step_time is not None else None
        if step_time:
            one(
                "step_rate",
                "gauge",
                "Optimizer steps per second (first local rank, median).",
                1.0 / step_time,
            )
        one(
            "stragglers",
            "gauge",
            "This node's ranks flagged straggler in the round.",
            self.stragglers,
        )
        one(
            "straggler_score",
            "gauge",
            "The largest own step time of a flagged rank over the median (0: none).",
            self.straggler_score,
        )
        one("store_term", "gauge", "The store's term (candidate hosts).", self.store_term)
        if self.store_host is not None:
            metric(
                "store_host_info",
                "gauge",
                "The store's host in the current term (one series).",
                [(f'{{host="{_label(self.store_host)}"}}', 1.0)],
            )
        one(
            "memory_checkpoint_saves_total",
            "counter",
            "Memory checkpoint saves of this node's workers (into shared memory).",
            self.saves,
        )
        one(
            "memory_checkpoint_save_blocked_seconds_total",
            "counter",
            "Seconds those saves kept training waiting.",
            self.saves_blocked,
        )
        one(
            "memory_checkpoint_save_bytes_total",
            "counter",
            "Bytes of state those saves copied.",
            self.saves_bytes,
        )
        one(
            "memory_checkpoints_persisted_total",
            "counter",
            "Memory checkpoints written to disk.",
            self.persisted,
        )
        one(
            "memory_checkpoint_persist_bytes_total",
            "counter",
            "Bytes of them.",
            self.persisted_bytes,
        )
        one(
            "memory_checkpoint_persist_seconds_total",
            "counter",
            "Seconds the agent spent writing them (in the background).",
            self.persisted_seconds,
        )
        one("metrics_scrapes_total", "counter", "Scrapes answered.", self.scrapes)
        return ("\n".join(out) + "\n").encode()
