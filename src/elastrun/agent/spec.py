"""What the agent runs: the worker specification built by the launcher.

The launcher (CLI or Python API) turns flags into a :class:`WorkerSpec` and a
:class:`~elastrun.rendezvous.api.Rendezvous`, then runs::

    exit_code = await Agent(spec, rendezvous, events).run()

The agent never imports torch.
"""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass, field

from elastrun.agent.command import LOCAL_RANK_MACRO, WorkerCommand
from elastrun.names import RunId

__all__ = [
    "DEFAULT_LOG_TEMPLATE",
    "LOCAL_RANK_MACRO",
    "StartMethod",
    "Std",
    "WarmModules",
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


@dataclass(frozen=True)
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
    log_dir: str | None = None  # one folder per attempt and per rank, kept
    # local_rank -> Std flags; a key of -1 applies to every local rank.
    redirects: dict[int, Std] = field(default_factory=dict)
    tee: dict[int, Std] = field(default_factory=dict)
    local_ranks_filter: frozenset[int] | None = None  # None: show every local rank
    log_template: str = DEFAULT_LOG_TEMPLATE
    # torch's TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE (``${rank}``, ``${local_rank}``,
    # ``${role_name}``): when set, console lines look as under torchrun (the
    # text verbatim before each line of a --tee'd stream, others raw) and
    # ``log_template`` is not used.
    torch_log_template: str | None = None
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
    # Progress watchdog (agent/watchdog.py): a fixed timeout, or with
    # hang_auto the floor of each rank's calibrated one.
    hang_timeout: float | None = None
    hang_auto: bool = False
    # The signal on which a worker writes its Python stacks when a hang is
    # declared (agent/stacks.py, --stack-signal); None: no stacks.
    stack_signal: int | None = int(signal.SIGRTMIN) + 5
    events_file: str | None = None
    # Fork workers from a warm interpreter (agent/warm.py); only a Python
    # command (a script or -m module) can be.
    warm: bool = False
    # What the warm interpreter imports ahead of time.
    warm_modules: WarmModules = WarmModules.INSTALLED
    # Where the module lists are kept across runs (agent/modcache.py); None:
    # the default folder.
    warm_cache: str | None = None
    # The rendezvous store admits only clients that prove who they are (the
    # embedded store with a token; etcd with a user or a client certificate).
    # Only then does the warm interpreter use the module list another node
    # left in the store (the job's note ``modules``): without it, anyone who
    # reaches the store could name modules for every node to import.
    store_authenticated: bool = False
    # The store's token (None: none), from which the agents derive the key
    # that authenticates their memory checkpoint replicas (agent/replica.py).
    replica_secret: str | None = field(default=None, repr=False)
    # A node joining a running job waits up to this long for its warm
    # interpreter before it enters the round (0: it does not wait).
    warm_join_timeout: float = 60.0
    # Exit 1 when the workers succeeded but some of their output could not be
    # written to its log file (default: a warning and an event only).
    require_logs: bool = False
    # torchrun's --duplicate-stdout-filters / --duplicate-stderr-filters: lines
    # of --tee'd streams holding one of these texts are also written to the
    # attempt's filtered_stdout.log / filtered_stderr.log.
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()
    # torchrun's --virtual-local-rank: LOCAL_RANK=0, CUDA_VISIBLE_DEVICES the
    # local rank's own device.
    virtual_local_rank: bool = False
    # --numa-binding: each local rank's CPUs ("0-15,32-47"), run under
    # numactl --physcpubind (the launcher found them: launcher/numa.py).
    cpu_binding: dict[int, str] = field(default_factory=dict)
