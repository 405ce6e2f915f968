"""``LaunchConfig``: what a launch needs (torch's ``LaunchConfig``), and the
check of its fields that stay plain numbers and text.

The command line fills it from flags (:mod:`elastrun.launcher.flags`), the
Python API takes it from the caller. Either way it is checked once, by
:func:`elastrun.launcher.plan.resolve`: :meth:`LaunchConfig.check` checks the
numbers against their documented ranges (:mod:`elastrun.launcher.limits`),
the role, the addresses and the stack signal; ``resolve`` parses the other
fields into their value types (``RunId``, ``Backend``, endpoints, the typed
``--rdzv-conf``, ``StartMethod``, ``WarmModules``, ``Std``). Nothing
touches the network or starts a process. Every error is a
:class:`~elastrun.errors.ConfigError` whose message starts with the flag it
is about, e.g. ``--nnodes: minimum 3 is larger than maximum 1``.
"""

from __future__ import annotations

import enum
import signal
from collections.abc import Mapping, Sequence
from dataclasses import field
from typing import Any, TypeVar

from elastrun.agent.spec import DEFAULT_FAULT_LIMIT, MAX_STANDBY_RANKS
from elastrun.errors import ConfigError
from elastrun.frozen import frozen
from elastrun.launcher.flag_grammar import signal_tuple
from elastrun.launcher.limits import (
    FLAG_SECONDS,
    MAX_NODES,
    MAX_NPROC_PER_NODE,
    MAX_REPLACE_STRAGGLERS,
    MAX_RESTARTS,
    check_int,
    check_seconds,
    machine_nproc_limit,
    worker_cost,
)
from elastrun.procs import signal_name
from elastrun.rendezvous.fault_history import MAX_ENTRIES as MAX_FAULT_LIMIT
from elastrun.rendezvous.quarantine import DEFAULT_QUARANTINE
from elastrun.rendezvous.sizes import WorldSizes

__all__ = [
    "DEFAULT_MASTER_PORT",
    "DEFAULT_SIGNALS",
    "DEFAULT_STACK_SIGNAL",
    "LaunchConfig",
    "check_address",
    "parse_choice",
]

DEFAULT_MASTER_PORT = 29500
DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
DEFAULT_STACK_SIGNAL = int(signal.SIGRTMIN) + 5
_BAD_ADDR_CHARS = "/@?#,\\"
MAX_ROLE_LEN = 128
NPROC_WHY = "elastrun's limit per agent"

E = TypeVar("E", bound=enum.Enum)


@frozen
class LaunchConfig:
    """Everything a launch needs except what to run (torch's ``LaunchConfig``).

    Field names follow torch's ``torch.distributed.launcher.api.LaunchConfig``
    where one exists. ``node_rank=None`` means "not given".
    """

    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: int = 1
    # "" (torch's default in its LaunchConfig): a generated id (see plan.resolve).
    run_id: str = "none"
    # torch's LaunchConfig defaults (the CLI's stay torchrun's CLI's: "default", 0).
    role: str = "default_role"
    rdzv_backend: str = "static"  # a plan.Backend, or one of its names
    rdzv_endpoint: str = ""
    rdzv_configs: Mapping[str, Any] = field(default_factory=dict)
    standalone: bool = False
    max_restarts: int = 3
    # --node-unit: world sizes are multiples of it (DLRover's name); the nodes
    # beyond the largest allowed size wait as hot spares.
    node_unit: int = 1
    monitor_interval: float = 0.1
    start_method: str = "spawn"  # an agent.spec.StartMethod, or its name
    node_rank: int | None = None
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    local_addr: str | None = None
    log_dir: str | None = None
    # local_rank -> Std bits (agent.spec.Std); key -1 applies to every local rank.
    redirects: Mapping[int, int] = field(default_factory=dict)
    tee: Mapping[int, int] = field(default_factory=dict)
    local_ranks_filter: frozenset[int] | None = None
    # Signals, or torch's type: one string, "SIGTERM,SIGUSR1".
    signals_to_handle: tuple[signal.Signals, ...] | str = (
        signal.SIGTERM,
        signal.SIGINT,
        signal.SIGHUP,
        signal.SIGQUIT,
    )
    # None (torch's default): TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30.
    shutdown_timeout: float | None = 30.0
    log_template: str | None = None  # None: the agent's default "[{host}:{rank}]"
    # torch's LaunchConfig field: a TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE
    # (${rank}, ${local_rank}, ${role_name}); lines then look as under torchrun.
    # Not used when log_template is given.
    log_line_prefix_template: str | None = None
    events_file: str | None = None
    # --metrics-port: the agent's Prometheus endpoint, "PORT" (loopback) or
    # "HOST[,HOST...]:PORT" (agent/metrics_server.py); None: not served.
    metrics_port: str | None = None
    hang_timeout: float | None = None
    # hang_timeout is the floor of each rank's own calibrated timeout
    # (``--hang-timeout auto[:FLOOR]``; see agent/watchdog.py).
    hang_auto: bool = False
    # The signal that makes a worker write its Python stacks when a hang is
    # declared (agent/stacks.py); None: no stacks are collected.
    stack_signal: int | None = DEFAULT_STACK_SIGNAL
    exit_barrier_timeout: float | None = None  # None: --rdzv-conf or 300 s
    env: Mapping[str, str] = field(default_factory=dict)  # extra worker environment
    # Fork workers from a warm interpreter (agent/warm.py); only for Python
    # commands the launcher builds (a script or -m module).
    warm: bool = True
    # An agent.spec.WarmModules, or its name: "installed" | "all" | "torch".
    warm_modules: str = "installed"
    warm_cache: str | None = None  # None: $ELASTRUN_CACHE_DIR or ~/.cache/elastrun
    warm_join_timeout: float | None = None  # None: 60 s
    # Standby processes per node for in_process scripts (agent/standby.py).
    standby_ranks: int = 1
    # --require-logs: lost worker output fails a job whose workers succeeded.
    require_logs: bool = False
    # torch's fields (launcher/torch_config.py reads them as torch does).
    logs_specs: Any = None  # torch's DefaultLogsSpecs: log_dir, redirects, tee, filter
    rdzv_timeout: int = -1  # the join timeout (torch's legacy field), unless -1
    metrics_cfg: Mapping[str, str] = field(default_factory=dict)  # accepted, not used
    event_log_handler: str = "null"  # accepted, not used: events go to events_file
    numa_options: Any = None  # torch's NumaOptions: its affinity_mode
    # --duplicate-stdout-filters / --duplicate-stderr-filters: lines of --tee'd
    # ranks that hold one of these are also written to filtered_stdout.log /
    # filtered_stderr.log in the attempt's log folder.
    duplicate_stdout_filters: Sequence[str] | None = None
    duplicate_stderr_filters: Sequence[str] | None = None
    # --virtual-local-rank: LOCAL_RANK=0 in every worker, CUDA_VISIBLE_DEVICES
    # its own device.
    virtual_local_rank: bool = False
    # --numa-binding: node | socket | exclusive | core-complex (None: off).
    numa_binding: str | None = None
    # Fault attribution (agent/attribution.py): --fault-limit identical
    # failures make a verdict (0: none); --stop-on-script-fault; a node judged
    # faulty is kept out for --quarantine-time seconds where the job can go
    # on without it (0: it stays).
    fault_limit: int = DEFAULT_FAULT_LIMIT
    stop_on_script_fault: bool = True
    quarantine_time: float = DEFAULT_QUARANTINE
    # Stragglers (agent/stragglers.py, agent/straggler_replacement.py): step
    # times shared every --straggler-interval s; with --replace-stragglers K
    # (0: off) a node named a straggler K intervals in a row is replaced by a
    # waiting spare.
    straggler_interval: float = 5.0
    replace_stragglers: int = 0
    # --health-check CMD (agent/node_health.py): before each round and every
    # --health-check-interval s while training; killed after its timeout.
    # None: --rdzv-conf's health_check* keys, else none.
    health_check: str | None = None
    health_check_timeout: float | None = None
    health_check_interval: float | None = None

    def check(self) -> None:
        """Check the fields that stay plain numbers and text against their
        ranges; raise ConfigError naming the flag. (``plan.resolve`` calls
        it, and parses the other fields.)"""
        check_nnodes(self.min_nodes, self.max_nodes)
        check_nproc(self.nproc_per_node)
        self.check_machine_nproc()
        check_int("--max-restarts", self.max_restarts, 0, MAX_RESTARTS)
        check_int("--fault-limit", self.fault_limit, 0, MAX_FAULT_LIMIT)
        check_int("--replace-stragglers", self.replace_stragglers, 0, MAX_REPLACE_STRAGGLERS)
        check_int("--standby-ranks", self.standby_ranks, 0, MAX_STANDBY_RANKS)
        check_node_unit(self.min_nodes, self.max_nodes, self.node_unit)
        if self.node_rank is not None:
            check_int("--node-rank", self.node_rank, 0, MAX_NODES - 1)
        if self.master_port is not None:
            if isinstance(self.master_port, bool) or not isinstance(self.master_port, int):
                raise ConfigError(f"--master-port: expected an integer, got {self.master_port!r}")
            if not 0 < self.master_port < 65536:
                raise ConfigError(f"--master-port: must be in 1..65535, got {self.master_port}")
        self._check_seconds()
        check_stack_signal(self.stack_signal, signal_tuple(self.signals_to_handle))
        check_role(self.role)
        if self.local_addr is not None:
            check_address("--local-addr", self.local_addr)
        if self.local_ranks_filter is not None:
            for r in self.local_ranks_filter:
                check_int("--local-ranks-filter", r, 0, MAX_NPROC_PER_NODE - 1)

    def _check_seconds(self) -> None:
        for flag, value in (
            ("--monitor-interval", self.monitor_interval),
            ("--shutdown-timeout", self.shutdown_timeout),
            ("--hang-timeout", self.hang_timeout),
            ("--exit-barrier-timeout", self.exit_barrier_timeout),
            ("--warm-join-timeout", self.warm_join_timeout),
            ("--quarantine-time", self.quarantine_time),
            ("--straggler-interval", self.straggler_interval),
            ("--health-check-timeout", self.health_check_timeout),
            ("--health-check-interval", self.health_check_interval),
        ):
            if value is not None:
                check_seconds(flag, value, FLAG_SECONDS[flag])

    def check_machine_nproc(self) -> None:
        """``nproc_per_node`` against what this machine lets one agent hold."""
        files = self.log_dir is not None or any(self.redirects.values()) or any(self.tee.values())
        procs, fds = worker_cost(files, self.warm)
        limit = machine_nproc_limit(procs, fds)
        if limit is not None and self.nproc_per_node > limit[0]:
            raise ConfigError(
                f"--nproc-per-node: {self.nproc_per_node} workers are more than this machine "
                f"allows one agent ({limit[0]}): {limit[1]}"
            )


def check_nnodes(lo: object, hi: object) -> None:
    """``--nnodes``: 1 <= min <= max <= MAX_NODES."""
    for n in (lo, hi):
        if isinstance(n, int) and not isinstance(n, bool) and n < 1:
            raise ConfigError(f"--nnodes: the number of nodes must be at least 1, got {n}")
        check_int("--nnodes", n, 1, MAX_NODES)
    assert isinstance(lo, int) and isinstance(hi, int)
    if lo > hi:
        raise ConfigError(f"--nnodes: minimum {lo} is larger than maximum {hi}")


def check_node_unit(lo: int, hi: int, unit: object) -> None:
    """``--node-unit``: at least 1, and a policy that can be met: some
    multiple of it lies in ``--nnodes`` MIN..MAX (at most MAX_NODES); each
    refusal names both flags."""
    if isinstance(unit, bool) or not isinstance(unit, int):
        raise ConfigError(f"--node-unit: expected an integer, got {unit!r}")
    problem = WorldSizes(lo, hi, unit).problem()
    if problem is not None:
        raise ConfigError(problem)


def check_nproc(n: object) -> None:
    """``--nproc-per-node``: 1..MAX_NPROC_PER_NODE."""
    if isinstance(n, int) and not isinstance(n, bool) and n < 1:
        raise ConfigError(f"--nproc-per-node: must be at least 1, got {n}")
    check_int("--nproc-per-node", n, 1, MAX_NPROC_PER_NODE, NPROC_WHY)


def check_role(role: object) -> str:
    """A role name: 1 to 128 printable characters (it is shown on consoles
    and in ``elastrun status``, and must agree between nodes)."""
    if not isinstance(role, str) or not role:
        raise ConfigError("--role: must not be empty")
    if len(role) > MAX_ROLE_LEN:
        raise ConfigError(f"--role: at most {MAX_ROLE_LEN} characters, got {len(role)}")
    if not role.isprintable():
        raise ConfigError(f"--role: {role!r} contains control characters")
    return role


def check_address(flag: str, addr: object) -> str:
    """A host name or IP address as given (not resolved): no spaces, control
    characters or URL/path punctuation, at most 255 characters."""
    if not isinstance(addr, str) or not addr.strip():
        raise ConfigError(f"{flag}: must not be empty")
    if len(addr) > 255:
        raise ConfigError(f"{flag}: at most 255 characters, got {len(addr)}")
    if not addr.isascii() or any(
        c.isspace() or not c.isprintable() or c in _BAD_ADDR_CHARS for c in addr
    ):
        raise ConfigError(f"{flag}: {addr!r} is not a host name or IP address")
    return addr


def check_stack_signal(signum: object, handled: tuple[signal.Signals, ...]) -> None:
    """The stack signal: a real-time signal, SIGUSR1 or SIGUSR2 that the
    agent does not also forward to the workers (None: off)."""
    if signum is None:
        return
    if isinstance(signum, bool) or not isinstance(signum, int):
        raise ConfigError(f"--stack-signal: expected a signal number or None, got {signum!r}")
    allowed = {int(signal.SIGUSR1), int(signal.SIGUSR2)}
    if signum not in allowed and not int(signal.SIGRTMIN) <= signum <= int(signal.SIGRTMAX):
        raise ConfigError(
            f"--stack-signal: {signal_name(signum)} cannot be used: a real-time signal, "
            "SIGUSR1 or SIGUSR2 only (the others stop, pause or matter to the worker)"
        )
    if signum in {int(s) for s in handled}:
        raise ConfigError(
            f"--stack-signal: {signal_name(signum)} is also in --signals-to-handle (forwarded "
            "to the workers, where it would write stacks instead); choose another"
        )


def parse_choice(kind: type[E], value: object, flag: str) -> E:
    """``value`` (a member of the enum ``kind``, or its value) as a member;
    else ConfigError naming ``flag`` and the choices."""
    if isinstance(value, kind):
        return value
    for member in kind:
        if member.value == value:
            return member
    names = [str(m.value) for m in kind]
    choices = ", ".join(names[:-1]) + f" or {names[-1]}"
    raise ConfigError(f"{flag}: must be {choices}, got {value!r}")
