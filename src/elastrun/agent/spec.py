"""What the agent runs: the worker specification built by the launcher.

The launcher (CLI or Python API) turns flags into a :class:`WorkerSpec` and a
:class:`~elastrun.rendezvous.api.Rendezvous`, then runs::

    exit_code = await Agent(spec, rendezvous, events).run()

The agent never imports torch.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field

__all__ = ["DEFAULT_LOG_TEMPLATE", "Std", "WorkerSpec"]

# Console prefix of each worker line. Fields: host, rank (global), local_rank,
# role, group_rank, restart (attempt number).
DEFAULT_LOG_TEMPLATE = "[{host}:{rank}]"


class Std:
    """Bit flags for --redirects / --tee, as torchrun: 0 none, 1 out, 2 err, 3 both."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3


@dataclass(frozen=True)
class WorkerSpec:
    # What each worker runs: the full argv (e.g. [sys.executable, "-u", "train.py", ...]).
    argv: tuple[str, ...]
    nproc: int
    run_id: str
    role: str = "default"
    host: str = ""
    # Extra environment for every worker (on top of os.environ and the
    # SPEC section 2 variables the agent computes per rank).
    env: dict[str, str] = field(default_factory=dict)
    log_dir: str | None = None  # one folder per attempt and per rank, kept
    # local_rank -> Std flags; a key of -1 applies to every local rank.
    redirects: dict[int, int] = field(default_factory=dict)
    tee: dict[int, int] = field(default_factory=dict)
    local_ranks_filter: frozenset[int] | None = None  # None: show every local rank
    log_template: str = DEFAULT_LOG_TEMPLATE
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
    start_method: str = "spawn"  # accepted for compatibility; workers are always exec'd
    hang_timeout: float | None = None  # progress watchdog (later issue)
    events_file: str | None = None
    # Start workers from warm spare interpreters (agent/spares.py). The launcher
    # sets it for the Python commands it builds (a script or -m module).
    prewarm: bool = False
    # Exit 1 when the workers succeeded but some of their output could not be
    # written to its log file (default: a warning and an event only).
    require_logs: bool = False
