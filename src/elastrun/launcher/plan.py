"""From a LaunchConfig to a Plan: every setting of this node's launch, typed.

:func:`resolve` is the one step between what a user gave (flags, or the
Python API's :class:`~elastrun.launcher.config.LaunchConfig`) and what the
parts receive: it checks each field once, parses the others into their value
types, applies torchrun's defaulting rules (``--standalone``; the default
``static`` backend on a single node becomes a standalone embedded store; an
empty run id becomes a generated one), reads the store's token
(``--rdzv-conf token`` or ``token_file``, else the environment:
:mod:`elastrun.store.token`), checks the cross-flag rules, and builds the
settings the agent (:class:`~elastrun.agent.spec.WorkerSpec`, with each
feature's settings group: the features' environment variables are read here,
once, and nowhere in the agent) and the rendezvous
(:class:`~elastrun.rendezvous.api.RendezvousSettings`) receive.
They are passed on whole: nothing downstream checks them again. Only what
the run learns (this host's name, the address that routes to the store) is
added by :mod:`elastrun.launcher.run`. No sockets, no processes.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
from collections.abc import Mapping

from elastrun.agent import (
    file_timers,
    gpu_release,
    health_check,
    memory,
    metrics_server,
    replica,
)
from elastrun.agent.command import Executable, WorkerCommand
from elastrun.agent.logs import validate_template
from elastrun.agent.modcache import default_cache_dir
from elastrun.agent.spec import (
    DEFAULT_HEALTH_CHECK_TIMEOUT,
    DEFAULT_LOG_TEMPLATE,
    DEFAULT_MEMORY_ROOT,
    AttributionSettings,
    GpuReleaseSettings,
    HangSettings,
    HealthCheckSettings,
    LogSettings,
    MemorySettings,
    MetricsSettings,
    NodeHealthSettings,
    StandbySettings,
    StartMethod,
    Std,
    StragglerSettings,
    WarmModules,
    WarmSettings,
    WorkerSpec,
)
from elastrun.agent.warm_pool import DEBUG_ENV
from elastrun.endpoint import Endpoint, format_endpoints, parse_endpoint_list
from elastrun.errors import ConfigError
from elastrun.frozen import frozen
from elastrun.launcher.config import (
    DEFAULT_MASTER_PORT,
    LaunchConfig,
    parse_choice,
)
from elastrun.launcher.flag_grammar import signal_tuple
from elastrun.launcher.limits import Range, parse_seconds, shown_value
from elastrun.launcher.numa import numa_cpus
from elastrun.launcher.rdzv_conf import RendezvousConf, parse_rdzv_conf
from elastrun.launcher.torch_config import torch_fields
from elastrun.names import RunId
from elastrun.rendezvous.api import RendezvousSettings
from elastrun.rendezvous.quarantine import DEFAULT_QUARANTINE
from elastrun.store.etcd_options import DEFAULT_ETCD_PORT
from elastrun.store.factory import DEFAULT_PORT, Backend
from elastrun.store.term import MAX_CANDIDATES, MIN_FAILOVER_LEASE_TTL
from elastrun.store.token import TOKEN_ENV, store_token
from elastrun.untrusted import ascii_int, printable

__all__ = ["Plan", "resolve"]

DEFAULT_WARM_JOIN_TIMEOUT = 60.0
# The signals that stop the workers; the others handled are forwarded to them.
STOP_SIGNALS = frozenset({"SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"})


@frozen
class Plan:
    """This node's launch, resolved: what :mod:`elastrun.launcher.run` wires up."""

    run_id: RunId
    backend: Backend
    # c10d: one, or the store's candidate hosts (failover); etcd: one or more; static: master
    endpoints: tuple[Endpoint, ...]
    conf: RendezvousConf  # after defaulting (is_host, protocol)
    standalone: bool
    node_rank: int | None
    token: str | None
    # What the agent runs and how: complete but for this host's name (the run's).
    workers: WorkerSpec
    # The rendezvous' settings: complete but for this host's name and address.
    rendezvous: RendezvousSettings
    local_addr: str | None = None  # --local-addr
    # The run id was empty ("" asks for one, as torch's launcher) and was
    # generated here: other nodes cannot know it unless told.
    generated_run_id: bool = False
    token_source: str = "none"  # noqa: S105 - where the token came from, for messages
    # What the launcher says before it starts (a setting it ignores, as torch).
    warnings: tuple[str, ...] = ()
    # ELASTRUN_HOST_NAME: this node's name in the job (events, status, a
    # quarantine) instead of the machine's host name (None: the host name).
    host_name: str | None = None

    @property
    def failover(self) -> bool:
        """The c10d store with candidate hosts (docs/failover.md)."""
        return self.backend is Backend.C10D and len(self.endpoints) > 1

    @property
    def authenticated(self) -> bool:
        """Whether a stranger who reaches the job's store is refused (see
        :func:`refuses_strangers`); the agent has it as
        ``WorkerSpec.warm.store_authenticated``."""
        return self.workers.warm.store_authenticated

    @property
    def is_host(self) -> bool | None:
        """--rdzv-conf is_host (None: decide by address)."""
        return self.conf.is_host


def refuses_strangers(backend: Backend, token: str | None, conf: RendezvousConf) -> bool:
    """Whether a stranger who reaches the job's store is refused: the
    embedded store with a token, or etcd with a user or a client certificate
    (etcd's own authentication). The static backend has no store (False)."""
    if backend is Backend.C10D:
        return bool(token)
    if backend is Backend.ETCD:
        return bool(conf.user or conf.cert)
    return False


def check_writable_dir(flag: str, path: str) -> None:
    """``path`` is, or can be made, a folder this process may write into:
    its nearest existing ancestor must be a writable folder (nothing is
    created here). A full disk is found later, when writing."""
    probe = os.path.abspath(path)
    while not os.path.lexists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise ConfigError(f"{flag}: {probe!r} exists and is not a folder (in {path!r})")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{flag}: cannot write into {probe!r} (in {path!r}): permission or read-only"
        )


@frozen
class _Where:
    """Which backend, where, and this node's rank: resolved from the flags."""

    backend: Backend
    endpoints: tuple[Endpoint, ...]
    conf: RendezvousConf
    standalone: bool
    node_rank: int | None

    @property
    def failover(self) -> bool:
        """The c10d store with candidate hosts (docs/failover.md)."""
        return self.backend is Backend.C10D and len(self.endpoints) > 1


# What a plan runs when none is given (a plan made to check a config).
EMPTY_COMMAND = Executable(())


def resolve(config: LaunchConfig, command: WorkerCommand = EMPTY_COMMAND) -> Plan:
    """Check ``config`` and work out this node's launch of ``command`` (what
    each worker runs). Raises ConfigError naming the flag."""
    config = torch_fields(config)  # torch's LaunchConfig types, read as torch does
    config.check()
    generated = config.run_id == ""
    # As torch's launcher: an empty run id is a generated one. Only this
    # node knows it, so other nodes can join only if started with it (the
    # launcher says so when the job may have more than one node).
    run_id = RunId.generate() if generated else RunId.parse(config.run_id, "--rdzv-id")
    where = _where(config, parse_rdzv_conf(config.rdzv_configs))
    if where.standalone:
        run_id = RunId.generate()
    # The environment's token is the embedded store's (etcd has user/password).
    token = store_token(
        where.conf.token,
        where.conf.token_file,
        None if where.backend is Backend.C10D else {},
    )
    if config.log_dir:
        check_writable_dir("--log-dir", config.log_dir)
    authenticated = refuses_strangers(where.backend, token.token, where.conf)
    spec, warnings = _with_features(
        _worker_spec(config, run_id, command, authenticated), token.token, os.environ
    )
    spec = dataclasses.replace(
        spec,
        node_health=_node_health(config, where.conf),
        metrics=_metrics(config, where.conf),
    )
    return Plan(
        run_id=run_id,
        backend=where.backend,
        endpoints=where.endpoints,
        conf=where.conf,
        standalone=where.standalone,
        node_rank=where.node_rank,
        token=token.token,
        workers=spec,
        rendezvous=_rendezvous_settings(config, run_id, where),
        local_addr=config.local_addr,
        generated_run_id=generated and not where.standalone,
        token_source=token.source,
        warnings=warnings,
        host_name=host_name_from(os.environ),
    )


def _metrics(config: LaunchConfig, conf: RendezvousConf) -> MetricsSettings:
    """``--metrics-port``, else ``--rdzv-conf metrics_port``."""
    if config.metrics_port:
        return metrics_server.settings_from(config.metrics_port)
    return metrics_server.settings_from(conf.metrics_port, "--rdzv-conf metrics_port")


MAX_HEALTH_CHECK = 4096  # characters of a --health-check command


def _node_health(config: LaunchConfig, conf: RendezvousConf) -> NodeHealthSettings:
    """``--health-check*``, else ``--rdzv-conf health_check*``: the command
    split as a shell would (no shell runs it), its timeout and interval."""
    text = config.health_check if config.health_check is not None else conf.health_check
    flag = "--health-check" if config.health_check is not None else "--rdzv-conf health_check"
    command: tuple[str, ...] = ()
    if text:
        if len(text) > MAX_HEALTH_CHECK or "\x00" in text:
            raise ConfigError(f"{flag}: at most {MAX_HEALTH_CHECK} characters, no NUL")
        try:
            command = tuple(shlex.split(text))
        except ValueError as e:
            raise ConfigError(f"{flag}: {e} in {printable(repr(text[:64]))}") from None
    timeout = config.health_check_timeout
    if timeout is None:
        timeout = conf.health_check_timeout
    interval = config.health_check_interval
    if interval is None:
        interval = conf.health_check_interval
    return NodeHealthSettings(
        command=command,
        timeout=DEFAULT_HEALTH_CHECK_TIMEOUT if timeout is None else float(timeout),
        interval=0.0 if interval is None else float(interval),
    )


HOST_NAME_ENV = "ELASTRUN_HOST_NAME"
MAX_HOST_NAME = 253
_HOST_NAME = re.compile(r"[A-Za-z0-9._-]{1,253}\Z")


def host_name_from(environ: Mapping[str, str]) -> str | None:
    """``ELASTRUN_HOST_NAME`` (unset or empty: None, the machine's host
    name): letters, digits, ``.``, ``_`` and ``-``, at most 253; else a
    ConfigError naming the variable."""
    raw = environ.get(HOST_NAME_ENV, "")
    if not raw:
        return None
    if _HOST_NAME.match(raw) is None:
        shown = printable(repr(raw[:64]))
        raise ConfigError(
            f"{HOST_NAME_ENV}={shown}: a node name is 1 to {MAX_HOST_NAME} letters, digits, "
            "'.', '_' or '-'"
        )
    return raw


def _with_features(
    spec: WorkerSpec, token: str | None, environ: Mapping[str, str]
) -> tuple[WorkerSpec, tuple[str, ...]]:
    """``spec`` with the features' settings groups, from the launcher's
    environment (``environ``): the ``ELASTRUN_*`` variables from it alone;
    torch's (the file timers, the health check) as torch reads them, with the
    spec's ``env`` (the Python API's ``LaunchConfig.env``) over it. A bad
    ``ELASTRUN_*`` number is a ConfigError naming the variable; a bad health
    check port is ignored with a warning, as torch does (docs/cli.md)."""
    merged = {**environ, **spec.env}
    port, warning = health_check.port_from(merged.get(health_check.PORT_ENV))
    release = _seconds_env(
        environ,
        gpu_release.TIMEOUT_ENV,
        gpu_release.DEFAULT_TIMEOUT,
        Range(0.0, gpu_release.MAX_TIMEOUT),
    )
    spec = dataclasses.replace(
        spec,
        gpu_release=GpuReleaseSettings(timeout=release),
        memory=MemorySettings(
            root=environ.get(memory.ROOT_ENV) or DEFAULT_MEMORY_ROOT,
            replica_secret=token,
            replica_max_bytes=_positive_env(
                environ, replica.MAX_BYTES_ENV, replica.DEFAULT_MAX_BYTES, "bytes"
            ),
            replica_max_header=_positive_env(
                environ, replica.MAX_HEADER_ENV, replica.DEFAULT_MAX_HEADER, "header bytes"
            ),
        ),
        health_check=HealthCheckSettings(
            port=port, hosts=health_check.hosts_from(merged.get(health_check.HOST_ENV))
        ),
        file_timers=file_timers.settings_from(merged),
        warm=dataclasses.replace(
            spec.warm,
            cache=spec.warm.cache or default_cache_dir(environ),  # --warm-cache first
            debug=bool(environ.get(DEBUG_ENV)),
        ),
    )
    return spec, () if warning is None else (warning,)


def _seconds_env(environ: Mapping[str, str], name: str, default: float, rng: Range) -> float:
    """``name`` (unset or empty: ``default``): ASCII seconds in ``rng``."""
    raw = environ.get(name, "")
    return parse_seconds(name, raw, rng) if raw.strip() else default


def _positive_env(environ: Mapping[str, str], name: str, default: int, unit: str) -> int:
    """``name`` (unset or empty: ``default``): a positive whole number in ASCII
    digits; else ConfigError naming the variable."""
    raw = environ.get(name, "")
    if not raw.strip():
        return default
    value = ascii_int(raw)
    if value is None or value < 1:
        raise ConfigError(
            f"{name}: expected a positive whole number of {unit} (ASCII digits), "
            f"got {shown_value(raw)}"
        )
    return value


def _where(config: LaunchConfig, conf: RendezvousConf) -> _Where:
    """The backend, its endpoints and this node's rank, by torchrun's rules."""
    backend = Backend.parse(config.rdzv_backend)
    endpoint = config.rdzv_endpoint.strip()
    standalone = config.standalone or (
        backend is Backend.STATIC
        and not endpoint
        and config.master_port is None
        and config.max_nodes == 1  # torchrun: a single-node static launch needs no master port
    )
    if standalone:
        if config.max_nodes != 1 or config.min_nodes != 1:
            given = (
                str(config.max_nodes)
                if config.min_nodes == config.max_nodes
                else f"{config.min_nodes}:{config.max_nodes}"
            )
            raise ConfigError(
                f"--standalone: runs a single node, but --nnodes={given} asks for more; "
                "use --rdzv-backend=c10d with --rdzv-endpoint for several nodes"
            )
        if conf.store_bind is not None:
            raise ConfigError(
                "--rdzv-conf store_bind: --standalone keeps the store on 127.0.0.1; "
                "use --rdzv-backend=c10d with --rdzv-endpoint to serve other nodes"
            )
        backend, endpoint, conf = Backend.C10D, "127.0.0.1:0", conf.with_(is_host=True)
    node_rank = config.node_rank
    endpoints: tuple[Endpoint, ...]
    if backend is Backend.STATIC:
        node_rank = _static_node_rank(config)
        endpoints = (_static_master(config, endpoint),)
    elif backend is Backend.C10D:
        # torchrun's default: localhost:29400; a list: the store's candidate hosts
        if "," in endpoint and not standalone:
            endpoints = _candidates(endpoint, conf)
        else:
            store = Endpoint.parse(endpoint or "localhost", DEFAULT_PORT, "--rdzv-endpoint")
            if store.port == 0 and not standalone:
                if config.max_nodes != 1:
                    raise ConfigError(
                        "--rdzv-endpoint: port 0 (pick a free port) only works on a single "
                        "node; other nodes could not find the port"
                    )
                conf = conf.with_(is_host=True)
            endpoints = (store,)
    else:  # etcd; torchrun's default: localhost:2379
        endpoints, https = parse_endpoint_list(
            endpoint or "localhost", DEFAULT_ETCD_PORT, "--rdzv-endpoint"
        )
        if https and conf.protocol is None:
            conf = conf.with_(protocol="https")
    for name in ("store_bind", "store_max_connections_per_peer"):
        if getattr(conf, name) is not None and backend is not Backend.C10D:
            raise ConfigError(
                f"--rdzv-conf {name}: only for the c10d backend's embedded store, not {backend}"
            )
    if backend is not Backend.STATIC and node_rank is not None and node_rank >= config.max_nodes:
        raise ConfigError(
            f"--node-rank: {node_rank} is out of range for --nnodes="
            f"{config.min_nodes}:{config.max_nodes} (expected 0..{config.max_nodes - 1})"
        )
    return _Where(backend, endpoints, conf, standalone, node_rank)


def _candidates(text: str, conf: RendezvousConf) -> tuple[Endpoint, ...]:
    """The c10d backend's candidate hosts for its store (``a:p,b:p,c:p``):
    at most :data:`MAX_CANDIDATES`, each once, each with a fixed port."""
    endpoints = tuple(
        Endpoint.parse(item.strip(), DEFAULT_PORT, "--rdzv-endpoint")
        if item.strip()
        else _empty_entry(text)
        for item in text.split(",")
    )
    if len(endpoints) > MAX_CANDIDATES:
        raise ConfigError(
            f"--rdzv-endpoint: {len(endpoints)} candidate hosts for the store; at most "
            f"{MAX_CANDIDATES} (a majority of them must stay up: 3 or 5 is usual)"
        )
    seen: set[Endpoint] = set()
    for endpoint in endpoints:
        if endpoint in seen:
            raise ConfigError(f"--rdzv-endpoint: {endpoint} is listed twice in {text!r}")
        if endpoint.port == 0:
            raise ConfigError(
                f"--rdzv-endpoint: {endpoint}: a candidate host needs a fixed port, not 0"
            )
        seen.add(endpoint)
    if conf.is_host is not None:
        raise ConfigError(
            "--rdzv-conf is_host: not with a list of candidate hosts in --rdzv-endpoint "
            "(the first live candidate hosts the store)"
        )
    if conf.store_bind is not None:
        raise ConfigError(
            "--rdzv-conf store_bind: not with a list of candidate hosts in --rdzv-endpoint "
            "(each candidate listens on its own entry)"
        )
    return endpoints


def _empty_entry(text: str) -> Endpoint:
    raise ConfigError(f"--rdzv-endpoint: empty entry in {text!r}")


def _static_node_rank(config: LaunchConfig) -> int:
    """The static backend: a fixed number of nodes, each with its rank."""
    if config.min_nodes != config.max_nodes:
        raise ConfigError(
            f"--nnodes: the static backend needs a fixed number of nodes, got "
            f"{config.min_nodes}:{config.max_nodes} (use --rdzv-backend=c10d for a range)"
        )
    node_rank = config.node_rank
    if node_rank is None:
        if config.max_nodes > 1:
            raise ConfigError(
                f"--node-rank: required with --rdzv-backend=static and --nnodes="
                f"{config.max_nodes} (each node needs its own rank 0..{config.max_nodes - 1})"
            )
        node_rank = 0
    if node_rank >= config.max_nodes:
        raise ConfigError(
            f"--node-rank: {node_rank} is out of range for --nnodes={config.max_nodes} "
            f"(expected 0..{config.max_nodes - 1})"
        )
    return node_rank


def _static_master(config: LaunchConfig, endpoint: str) -> Endpoint:
    """The static backend's master: the endpoint (as torchrun), else the master flags."""
    if endpoint:
        master = Endpoint.parse(endpoint, DEFAULT_MASTER_PORT, "--rdzv-endpoint")
    else:
        port = config.master_port or DEFAULT_MASTER_PORT
        master = Endpoint.parse(config.master_addr, port, "--master-addr")
    if master.port == 0:
        raise ConfigError("--master-port: the static backend needs a fixed port, not 0")
    return master


def _std_map(flag: str, given: Mapping[int, int]) -> dict[int, Std]:
    """--redirects / --tee: {local_rank (-1: all): Std bits}."""
    out: dict[int, Std] = {}
    for local_rank, bits in given.items():
        if (
            isinstance(local_rank, bool)
            or not isinstance(local_rank, int)
            or local_rank < -1
            or bits not in (0, 1, 2, 3)
        ):
            raise ConfigError(f"{flag}: bad entry {local_rank}:{bits}")
        out[local_rank] = Std(bits)
    return out


def _worker_spec(
    config: LaunchConfig, run_id: RunId, command: WorkerCommand, authenticated: bool
) -> WorkerSpec:
    """What the agent receives: the LaunchConfig's worker settings, typed."""
    if config.log_template is not None:
        validate_template(config.log_template)
    handled = signal_tuple(config.signals_to_handle)
    return WorkerSpec(
        command=command,
        nproc=config.nproc_per_node,
        run_id=run_id,
        role=config.role,
        env=dict(config.env),
        logs=LogSettings(
            # Absolute once, here: workers get paths under it (error file,
            # heartbeat), and a script may change directory (as Hydra does).
            dir=os.path.abspath(config.log_dir) if config.log_dir else None,
            redirects=_std_map("--redirects", config.redirects),
            tee=_std_map("--tee", config.tee),
            local_ranks_filter=config.local_ranks_filter,
            template=DEFAULT_LOG_TEMPLATE if config.log_template is None else config.log_template,
            torch_template=(
                config.log_line_prefix_template if config.log_template is None else None
            ),
            require=config.require_logs,
            duplicate_stdout_filters=tuple(config.duplicate_stdout_filters or ()),
            duplicate_stderr_filters=tuple(config.duplicate_stderr_filters or ()),
        ),
        shutdown_timeout=float(config.shutdown_timeout or 0.0),
        signals_to_handle=tuple(s for s in handled if s.name in STOP_SIGNALS),
        signals_to_forward=tuple(s for s in handled if s.name not in STOP_SIGNALS),
        monitor_interval=float(config.monitor_interval),
        start_method=parse_choice(StartMethod, config.start_method, "--start-method"),
        hang=HangSettings(
            timeout=config.hang_timeout,
            auto=config.hang_auto and config.hang_timeout is not None,
            stack_signal=config.stack_signal,
        ),
        events_file=os.path.abspath(config.events_file) if config.events_file else None,
        warm=WarmSettings(
            # numactl runs each worker (--numa-binding): not forked from a warm interpreter.
            enabled=config.warm and config.numa_binding is None,
            modules=parse_choice(WarmModules, config.warm_modules, "--warm-modules"),
            cache=config.warm_cache,
            join_timeout=(
                DEFAULT_WARM_JOIN_TIMEOUT
                if config.warm_join_timeout is None
                else config.warm_join_timeout
            ),
            store_authenticated=authenticated,
        ),
        # The token proves the agent to the store; a worker needs no store.
        hidden_env=frozenset((TOKEN_ENV,)),
        virtual_local_rank=config.virtual_local_rank,
        cpu_binding=numa_cpus(config.numa_binding, config.nproc_per_node),
        # numactl runs each worker with its local rank's CPUs (--numa-binding), and
        # --virtual-local-rank gives each its own device: no rank-less standby.
        standby=StandbySettings(
            count=0
            if config.numa_binding is not None or config.virtual_local_rank
            else config.standby_ranks
        ),
        attribution=AttributionSettings(
            limit=config.fault_limit,
            stop_script_faults=config.stop_on_script_fault,
            quarantine=float(config.quarantine_time),
        ),
        stragglers=StragglerSettings(
            interval=float(config.straggler_interval),
            replace_after=config.replace_stragglers,
            hold=float(config.quarantine_time) or DEFAULT_QUARANTINE,
        ),
    )


def _check_failover(where: _Where) -> None:
    """With candidate hosts, the lease TTL must outlast the time after which
    the host holds requests (a minority's writes are never served before it
    steps down: docs/failover.md)."""
    ttl = where.conf.lease_ttl
    if where.failover and ttl is not None and ttl < MIN_FAILOVER_LEASE_TTL:
        raise ConfigError(
            f"--rdzv-conf lease_ttl: {ttl:g} s is too short with candidate hosts in "
            f"--rdzv-endpoint; at least {MIN_FAILOVER_LEASE_TTL:g} s"
        )


def _rendezvous_settings(config: LaunchConfig, run_id: RunId, where: _Where) -> RendezvousSettings:
    """What the rendezvous receives: the job's shape, this node's rank hint,
    the --rdzv-conf timeouts (its own defaults for those not given)."""
    _check_failover(where)
    conf, defaults = where.conf, RendezvousSettings
    exit_barrier = config.exit_barrier_timeout
    if exit_barrier is None:
        exit_barrier = conf.exit_barrier_timeout
    return RendezvousSettings(
        run_id=run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        max_restarts=config.max_restarts,
        node_unit=config.node_unit,
        role=config.role,
        nproc=config.nproc_per_node,
        node_rank_hint=where.node_rank,
        join_timeout=_given(conf.join_timeout, defaults.join_timeout),
        last_call_timeout=_given(conf.last_call_timeout, defaults.last_call_timeout),
        close_timeout=_given(conf.close_timeout, defaults.close_timeout),
        lease_ttl=_given(conf.lease_ttl, defaults.lease_ttl),
        exit_barrier_timeout=_given(exit_barrier, defaults.exit_barrier_timeout),
        candidates=format_endpoints(where.endpoints) if where.failover else "",
    )


def _given(value: float | None, default: float) -> float:
    return default if value is None else float(value)
