"""What the agent runs: the worker specification built by the launcher.

The launcher (CLI or Python API) turns flags into a :class:`WorkerSpec` and a
:class:`~elastrun.rendezvous.api.Rendezvous`, then runs::

    exit_code = await Agent(spec, rendezvous, events).run()

The agent never imports torch.
"""

from __future__ import annotations

import enum
import signal
from dataclasses import field

from elastrun.agent.command import LOCAL_RANK_MACRO, WorkerCommand
from elastrun.frozen import frozen
from elastrun.names import RunId
from elastrun.rendezvous.quarantine import DEFAULT_QUARANTINE

__all__ = [
    "DEFAULT_FAULT_LIMIT",
    "DEFAULT_GPU_RELEASE_TIMEOUT",
    "DEFAULT_HEALTH_CHECK_HOSTS",
    "DEFAULT_HEALTH_CHECK_TIMEOUT",
    "DEFAULT_LOG_TEMPLATE",
    "DEFAULT_MEMORY_ROOT",
    "DEFAULT_REPLICA_MAX_BYTES",
    "DEFAULT_REPLICA_MAX_HEADER",
    "LOCAL_RANK_MACRO",
    "AttributionSettings",
    "FileTimerSettings",
    "GpuReleaseSettings",
    "HangSettings",
    "HealthCheckSettings",
    "LogSettings",
    "MemorySettings",
    "MetricsSettings",
    "NodeHealthSettings",
    "StartMethod",
    "Std",
    "StragglerSettings",
    "WarmModules",
    "WarmSettings",
    "WorkerSpec",
]

# Console prefix of each worker line. Fields: host, rank (global), local_rank,
# role, group_rank, restart (attempt number).
DEFAULT_LOG_TEMPLATE = "[{host}:{rank}]"


class Std(enum.IntFlag):
    """Bit flags for --redirects / --tee, as torchrun: 0 none, 1 out, 2 err, 3 both."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3


class StartMethod(enum.StrEnum):
    """``--start-method``: accepted for compatibility, not used (Python workers
    are forked from the warm interpreter, others exec'd)."""

    SPAWN = "spawn"
    FORK = "fork"
    FORKSERVER = "forkserver"


class WarmModules(enum.StrEnum):
    """``--warm-modules``: what the warm interpreter imports ahead of time."""

    # torch and the standard-library and installed-package modules the script
    # imported when it last ran
    INSTALLED = "installed"
    ALL = "all"  # those and the script's own modules (never the script itself)
    TORCH = "torch"  # torch alone, no cache


DEFAULT_HEALTH_CHECK_TIMEOUT = 60.0  # s a --health-check command may run
DEFAULT_FAULT_LIMIT = 2  # identical failures that make a fault verdict
DEFAULT_GPU_RELEASE_TIMEOUT = 30.0  # s a start waits for the stopped workers' GPU memory
DEFAULT_HEALTH_CHECK_HOSTS = ("127.0.0.1", "::1")
DEFAULT_MEMORY_ROOT = "/dev/shm"
DEFAULT_REPLICA_MAX_BYTES = 64 << 30
# ~13000 real tensors; decoded, the worst 4 MiB (all one-key objects) is ~120 MB.
DEFAULT_REPLICA_MAX_HEADER = 4 << 20


# Each feature's settings, resolved once by the launcher (launcher/plan.py,
# from flags and the launcher's environment: docs/cli.md, *Environment*):
# the features read no environment.


@frozen
class LogSettings:
    """agent/logs.py (and the agent's log folder): the workers' output."""

    dir: str | None = None  # --log-dir: one folder per attempt and per rank, kept
    # local_rank -> Std flags; a key of -1 applies to every local rank.
    redirects: dict[int, Std] = field(default_factory=dict)
    tee: dict[int, Std] = field(default_factory=dict)
    local_ranks_filter: frozenset[int] | None = None  # None: show every local rank
    template: str = DEFAULT_LOG_TEMPLATE
    # torch's TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE (``${rank}``, ``${local_rank}``,
    # ``${role_name}``): when set, console lines look as under torchrun (the
    # text verbatim before each line of a --tee'd stream, others raw) and
    # ``template`` is not used.
    torch_template: str | None = None
    # Exit 1 when the workers succeeded but some of their output could not be
    # written to its log file (default: a warning and an event only).
    require: bool = False
    # torchrun's --duplicate-stdout-filters / --duplicate-stderr-filters: lines
    # of --tee'd streams holding one of these texts are also written to the
    # attempt's filtered_stdout.log / filtered_stderr.log.
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()


@frozen
class WarmSettings:
    """agent/warm.py, warm_pool.py, modlearn.py: warm starts."""

    # Fork workers from a warm interpreter; only a Python command (a script
    # or -m module) can be (--warm).
    enabled: bool = False
    # What the warm interpreter imports ahead of time (--warm-modules).
    modules: WarmModules = WarmModules.INSTALLED
    # Where the module lists are kept across runs (agent/modcache.py): the
    # launcher resolves --warm-cache, else ELASTRUN_CACHE_DIR, else
    # XDG_CACHE_HOME/elastrun, else ~/.cache/elastrun. None: no lists kept.
    cache: str | None = None
    # A node joining a running job waits up to this long for its warm
    # interpreter before it enters the round (0: it does not wait).
    join_timeout: float = 60.0
    # The rendezvous store admits only clients that prove who they are (the
    # embedded store with a token; etcd with a user or a client certificate).
    # Only then does the warm interpreter use the module list another node
    # left in the store (the job's note ``modules``): without it, anyone who
    # reaches the store could name modules for every node to import.
    store_authenticated: bool = False
    # ELASTRUN_DEBUG: the warm interpreter's choices also on the agent's console.
    debug: bool = False


@frozen
class GpuReleaseSettings:
    """agent/gpu_release.py: how long a start waits for the stopped workers'
    GPU memory (``ELASTRUN_GPU_RELEASE_TIMEOUT``; 0: no wait)."""

    timeout: float = DEFAULT_GPU_RELEASE_TIMEOUT


@frozen
class MemorySettings:
    """agent/memory.py and agent/replica.py: memory checkpoints and their replicas."""

    root: str = DEFAULT_MEMORY_ROOT  # ELASTRUN_MEMORY_CHECKPOINT_ROOT
    # The store's token (None: none), from which the agents derive the key
    # that authenticates their memory checkpoint replicas (agent/replica.py).
    replica_secret: str | None = field(default=None, repr=False)
    replica_max_bytes: int = DEFAULT_REPLICA_MAX_BYTES  # ELASTRUN_REPLICA_MAX_BYTES
    replica_max_header: int = DEFAULT_REPLICA_MAX_HEADER  # ELASTRUN_REPLICA_MAX_HEADER


@frozen
class HealthCheckSettings:
    """agent/health_check.py: torch's health check server
    (``TORCHELASTIC_HEALTH_CHECK_PORT``; None: not served) and the addresses
    it listens on (``ELASTRUN_HEALTH_CHECK_HOST``)."""

    port: int | None = None
    hosts: tuple[str, ...] = DEFAULT_HEALTH_CHECK_HOSTS


@frozen
class MetricsSettings:
    """agent/metrics.py: the Prometheus endpoint (``--metrics-port
    [HOST,...:]PORT``; None: not served) and the addresses it listens on
    (loopback unless given)."""

    port: int | None = None
    hosts: tuple[str, ...] = DEFAULT_HEALTH_CHECK_HOSTS


@frozen
class FileTimerSettings:
    """agent/file_timers.py: torch's file timer server
    (``TORCHELASTIC_ENABLE_FILE_TIMER=1`` or ``TORCHELASTIC_TIMER_FILE``)."""

    enabled: bool = False
    path: str = ""  # the pipes' prefix (PATH.{local_rank}); "": a private folder


MAX_STANDBY_RANKS = 8  # standby processes per node, at most (--standby-ranks)


@frozen
class StandbySettings:
    """agent/standby.py: how many standby processes a node keeps ready for a
    script that uses ``elastrun.train.in_process`` (``--standby-ranks``; 0:
    none, a replaced rank starts as a new process)."""

    count: int = 1


@frozen
class HangSettings:
    """agent/hang_group.py: the progress watchdog (agent/watchdog.py,
    ``--hang-timeout``: a fixed timeout, or with ``auto`` the floor of each
    rank's calibrated one; None: off) and the signal on which a worker writes
    its Python stacks when a hang is declared (agent/stacks.py,
    ``--stack-signal``; None: no stacks)."""

    timeout: float | None = None
    auto: bool = False
    stack_signal: int | None = int(signal.SIGRTMIN) + 5


@frozen
class NodeHealthSettings:
    """agent/node_health.py: the node's own health check (``--health-check``,
    or ``--rdzv-conf health_check``): ``command`` (an argv; empty: none) runs
    before the node joins each round, and every ``interval`` s while it
    trains (0: only before joining); one that runs past ``timeout`` s is
    killed and counts as failed."""

    command: tuple[str, ...] = ()
    timeout: float = DEFAULT_HEALTH_CHECK_TIMEOUT
    interval: float = 0.0


@frozen
class AttributionSettings:
    """agent/attribution.py: fault attribution across restarts. ``limit``
    (``--fault-limit``): identical failures that make a verdict (0: none is
    made); ``stop_script_faults`` (``--stop-on-script-fault``): a script
    fault stops the job; ``quarantine`` (``--quarantine-time``): seconds a
    node judged faulty is kept out of the job, where the job can go on
    without it (0: it is not excluded)."""

    limit: int = DEFAULT_FAULT_LIMIT
    stop_script_faults: bool = True
    quarantine: float = DEFAULT_QUARANTINE


@frozen
class StragglerSettings:
    """agent/stragglers.py and agent/straggler_replacement.py: ``interval``
    (``--straggler-interval``): seconds between two shares of the ranks' step
    times (and group rank 0's verdicts); ``replace_after``
    (``--replace-stragglers K``): a node named a straggler for K intervals in
    a row is replaced by a waiting spare (0: stragglers are only reported);
    ``hold``: seconds the replaced node is then kept out (its quarantine
    record: ``--quarantine-time``, else the default)."""

    interval: float = 5.0
    replace_after: int = 0
    hold: float = DEFAULT_QUARANTINE


@frozen
class WorkerSpec:
    # What each worker runs (agent/command.py): a Python script or module
    # (through the worker runner), or a program run as given.
    command: WorkerCommand
    nproc: int
    run_id: RunId
    role: str = "default"
    host: str = ""
    # Extra environment for every worker (on top of os.environ and the
    # torchrun variables the agent computes per rank: RANK, WORLD_SIZE, ...).
    env: dict[str, str] = field(default_factory=dict)
    # Variables of the agent's own environment that workers do not inherit
    # (secrets meant for the agent: the store token); ``env`` may still set them.
    hidden_env: frozenset[str] = frozenset()
    # The workers' output: log folder, redirects, console lines (agent/logs.py).
    logs: LogSettings = field(default_factory=LogSettings)
    shutdown_timeout: float = 30.0  # SIGTERM -> SIGKILL grace
    signals_to_handle: tuple[signal.Signals, ...] = (
        signal.SIGINT,
        signal.SIGTERM,
        signal.SIGHUP,
        signal.SIGQUIT,
    )
    # Signals the agent passes on to every worker's process group without
    # stopping anything (e.g. SIGUSR1 for a "checkpoint now" before preemption).
    signals_to_forward: tuple[signal.Signals, ...] = ()
    monitor_interval: float = 0.1  # accepted for compatibility; exits are event-driven
    start_method: StartMethod = StartMethod.SPAWN  # accepted for compatibility
    hang: HangSettings = HangSettings()
    events_file: str | None = None
    warm: WarmSettings = WarmSettings()
    # torchrun's --virtual-local-rank: LOCAL_RANK=0, CUDA_VISIBLE_DEVICES the
    # local rank's own device.
    virtual_local_rank: bool = False
    # --numa-binding: each local rank's CPUs ("0-15,32-47"), run under
    # numactl --physcpubind (the launcher found them: launcher/numa.py).
    cpu_binding: dict[int, str] = field(default_factory=dict)
    # The features' settings groups.
    gpu_release: GpuReleaseSettings = GpuReleaseSettings()
    memory: MemorySettings = MemorySettings()
    health_check: HealthCheckSettings = HealthCheckSettings()
    file_timers: FileTimerSettings = FileTimerSettings()
    attribution: AttributionSettings = AttributionSettings()
    node_health: NodeHealthSettings = NodeHealthSettings()
    stragglers: StragglerSettings = StragglerSettings()
    metrics: MetricsSettings = MetricsSettings()
    standby: StandbySettings = StandbySettings()
