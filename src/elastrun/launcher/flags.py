"""The command line: every flag of ``elastrun`` and ``python -m
elastrun.launch``, parsed into a :class:`~elastrun.launcher.config.LaunchConfig`
and a :class:`~elastrun.launcher.command.Command`, in one place.

Every torchrun flag in both spellings (``--nproc-per-node`` and
``--nproc_per_node``), with torchrun's ``PET_<FLAG>`` environment defaults
(e.g. ``PET_NNODES=2``; a flag on the command line wins), torch's aliases
(``--redirect``, ``-r``, ``-t``, the backends' other names) and, for
``python -m elastrun.launch``, torch.distributed.launch's ``--use-env`` and
the spelling of its local rank argument (:class:`LegacyFlags`). The text of
each value is read by :mod:`elastrun.launcher.flag_grammar`; the values are
checked once, with the Python API's, by :func:`elastrun.launcher.plan.resolve`.

The launch flags come in ``--help`` groups, one argparse group each: the
rendezvous, the static (torchrun's legacy multi-node) launch, the workers,
the logs, and fault tolerance with the warm interpreter (``add_*_flags``:
what each flag is called, both spellings, its ``PET_*`` default, its metavar
and its help with its default, as ``elastrun --help`` shows them); then
torchrun's own flags beyond the launch itself: NUMA binding, virtual local
ranks, duplicated log lines, torch's event handler and logs specs
(:func:`add_torchrun_flags`, read by :func:`torchrun_settings`).
"""

from __future__ import annotations

import argparse
import enum
import os
from collections.abc import Mapping, Sequence
from dataclasses import field
from typing import Any

from elastrun.agent.command import WorkerCommand
from elastrun.agent.spec import DEFAULT_FAULT_LIMIT, StartMethod, WarmModules
from elastrun.agent.watchdog import DEFAULT_AUTO_FLOOR
from elastrun.errors import ConfigError
from elastrun.frozen import frozen
from elastrun.launcher.command import Command, check_command
from elastrun.launcher.config import DEFAULT_SIGNALS, LaunchConfig, parse_choice
from elastrun.launcher.flag_grammar import (
    EnvDefault,
    EnvFlag,
    EnvSwitch,
    LogsSpecs,
    Parser,
    Version,
    both,
    env_sources,
    name_env,
    parse_hang_timeout,
    parse_integer,
    parse_nnodes,
    parse_nproc,
    parse_ranks_filter,
    parse_seconds_text,
    parse_signals,
    parse_stack_signal,
    parse_std,
    unknown_flags_message,
)
from elastrun.launcher.limits import FLAG_SECONDS, parse_seconds
from elastrun.launcher.numa import NUMA_MODES
from elastrun.launcher.plan import Plan, resolve
from elastrun.launcher.rdzv_conf import split_rdzv_conf
from elastrun.names import RunId
from elastrun.rendezvous.quarantine import DEFAULT_QUARANTINE
from elastrun.store.factory import Backend

__all__ = [
    "LEGACY_USAGE",
    "Flags",
    "LegacyFlags",
    "LocalRankStyle",
    "add_fault_flags",
    "add_log_flags",
    "add_rendezvous_flags",
    "add_static_flags",
    "add_torchrun_flags",
    "add_worker_flags",
    "build_parser",
    "config_from_args",
    "parse_flags",
    "resolve_flags",
    "split_filters",
    "torchrun_settings",
]


LEGACY_USAGE = "python -m elastrun.launch [flags] script [script args...]"


class LocalRankStyle(enum.StrEnum):
    """How ``python -m elastrun.launch`` spells each worker's local rank argument."""

    AUTO = "auto"  # from the script's source (launcher/legacy.py)
    UNDERSCORE = "underscore"  # --local_rank=N (torch 1.x)
    DASH = "dash"  # --local-rank=N (torch 2.x)


@frozen
class LegacyFlags:
    """torch.distributed.launch's own flags."""

    use_env: bool = False
    local_rank_style: LocalRankStyle = LocalRankStyle.AUTO


@frozen
class Flags:
    """A parsed command line."""

    config: LaunchConfig
    command: Command
    legacy: LegacyFlags | None = None  # python -m elastrun.launch only
    # {flag: PET_* variable} for the values that came from the environment
    env: Mapping[str, str] = field(default_factory=dict)


def build_parser(*, legacy: bool = False) -> argparse.ArgumentParser:
    """The parser of ``elastrun`` (``legacy``: of ``python -m elastrun.launch``)."""
    p = Parser(
        prog="elastrun",
        usage=(
            "elastrun [flags] script [script args...]\n"
            "       elastrun status | timeline | store serve [options]  (see 'other commands')"
        ),
        description=(
            "Elastic, fault-tolerant launcher for distributed PyTorch: a drop-in for torchrun. "
            "Every value flag can also be set as PET_<FLAG> in the environment "
            "(e.g. PET_NPROC_PER_NODE=2); the command line wins."
        ),
        epilog=(
            "other commands:\n"
            "  elastrun status --rdzv-endpoint HOST:PORT --rdzv-id ID [--watch] [--json]\n"
            "                      a running job's round, members, restarts, last failure\n"
            "  elastrun timeline EVENTS.jsonl... [--out timeline.html]\n"
            "                      a job's history (from --events-file logs) as an HTML page\n"
            "  elastrun store serve [--host H] [--port P] [--token-file F]\n"
            "                      the rendezvous store as its own process\n"
            "  elastrun checkpoint-convert OUT RANK_FILES... [--format dcp|torch]\n"
            "                      the ranks' disk copies of a sharded state put together\n"
            "  (each with --help; torch.distributed.launch users: python -m elastrun.launch)\n"
            "\n"
            "examples:\n"
            "  elastrun --standalone --nproc-per-node=2 train.py --epochs 3\n"
            "  elastrun --nnodes=1:4 --nproc-per-node=gpu --rdzv-backend=c10d \\\n"
            "      --rdzv-endpoint=node0:29400 --rdzv-id=job1 train.py\n"
            "  elastrun --nnodes=2 --node-rank=0 --master-addr=10.0.0.1 --master-port=29500 "
            "train.py"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("--version", action=Version)

    for add in (
        add_rendezvous_flags,
        add_static_flags,
        add_worker_flags,
        add_log_flags,
        add_fault_flags,
    ):
        add(p)

    add_torchrun_flags(p)

    if legacy:
        _add_legacy_flags(p)
    p.add_argument("script", metavar="script", help="the training script (or module, program)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return p


def _add_legacy_flags(p: argparse.ArgumentParser) -> None:
    """torch.distributed.launch's flags, and its usage and description."""
    p.prog = "python -m elastrun.launch"
    p.usage = LEGACY_USAGE
    p.description = (
        "torch.distributed.launch's command line, run by elastrun: every elastrun (torchrun) "
        "flag, and each worker gets its local rank as an argument (--local_rank=N or "
        "--local-rank=N) unless --use-env is given. Scripts that read LOCAL_RANK from the "
        "environment can use the 'elastrun' command instead (see docs/migration.md)."
    )
    p.epilog = (
        "examples:\n"
        "  python -m elastrun.launch --nproc_per_node=2 train.py --epochs 3\n"
        "  python -m elastrun.launch --nnodes=2 --node_rank=0 --nproc_per_node=8 \\\n"
        "      --master_addr=10.0.0.1 --master_port=29500 train.py"
    )
    g = p.add_argument_group("torch.distributed.launch")
    g.add_argument(
        "--use-env",
        "--use_env",
        action="store_true",
        help="pass no local rank argument: workers read LOCAL_RANK (always set)",
    )
    g.add_argument(
        "--local-rank-style",
        "--local_rank_style",
        choices=[m.value for m in LocalRankStyle],
        default="auto",
        help="the argument's spelling: underscore (--local_rank=N, torch 1.x), dash "
        "(--local-rank=N, torch 2.x), or auto: dash when the script's source names "
        "--local-rank and never --local_rank, else underscore (default: auto)",
    )


def config_from_args(ns: argparse.Namespace) -> tuple[LaunchConfig, Command]:
    """Parsed flags -> (LaunchConfig, Command). Raises ConfigError naming the flag."""
    min_nodes, max_nodes = parse_nnodes(ns.nnodes)
    shutdown = parse_seconds_text("--shutdown-timeout", ns.shutdown_timeout)
    if shutdown is None:
        torch_env = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
        if torch_env is not None:  # named in its errors: it is no flag
            shutdown = parse_seconds(
                "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", torch_env, FLAG_SECONDS["--shutdown-timeout"]
            )
    # torch's template, honoured as torchrun does (see agent/logs.py), unless
    # --log-template chose ours.
    torch_template = os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE") or None
    monitor = parse_seconds_text("--monitor-interval", ns.monitor_interval)
    hang_timeout, hang_auto = parse_hang_timeout(ns.hang_timeout)
    max_restarts = parse_integer("--max-restarts", ns.max_restarts)
    node_unit = parse_integer("--node-unit", ns.node_unit)
    fault_limit = parse_integer("--fault-limit", ns.fault_limit)
    quarantine_time = parse_seconds_text("--quarantine-time", ns.quarantine_time)
    replace_stragglers = parse_integer("--replace-stragglers", ns.replace_stragglers)
    straggler_interval = parse_seconds_text("--straggler-interval", ns.straggler_interval)
    standby_ranks = parse_integer("--standby-ranks", ns.standby_ranks)
    config = LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=parse_nproc(ns.nproc_per_node),
        # "" asks for a generated id (plan.resolve)
        run_id=RunId.parse(ns.rdzv_id, "--rdzv-id") if ns.rdzv_id != "" else "",
        role=ns.role,
        rdzv_backend=Backend.parse(ns.rdzv_backend),
        rdzv_endpoint=ns.rdzv_endpoint,
        rdzv_configs=split_rdzv_conf(ns.rdzv_conf),
        standalone=ns.standalone,
        max_restarts=0 if max_restarts is None else max_restarts,
        node_unit=1 if node_unit is None else node_unit,
        monitor_interval=0.1 if monitor is None else monitor,
        # PET_START_METHOD and PET_WARM_MODULES pass no argparse choices
        start_method=parse_choice(StartMethod, ns.start_method, "--start-method"),
        node_rank=parse_integer("--node-rank", ns.node_rank),
        master_addr=ns.master_addr,
        master_port=parse_integer("--master-port", ns.master_port),
        local_addr=ns.local_addr or None,
        log_dir=ns.log_dir or None,
        redirects=parse_std(ns.redirects, "--redirects"),
        tee=parse_std(ns.tee, "--tee"),
        local_ranks_filter=parse_ranks_filter(ns.local_ranks_filter),
        signals_to_handle=parse_signals(ns.signals_to_handle),
        shutdown_timeout=30.0 if shutdown is None else shutdown,
        log_template=ns.log_template,
        log_line_prefix_template=torch_template,
        events_file=ns.events_file or None,
        metrics_port=ns.metrics_port or None,
        hang_timeout=hang_timeout,
        hang_auto=hang_auto,
        stack_signal=parse_stack_signal(ns.stack_signal),
        exit_barrier_timeout=parse_seconds_text("--exit-barrier-timeout", ns.exit_barrier_timeout),
        # Warm interpreters run Python: not for --no-python programs or --run-path's -c.
        warm=ns.warm and not (ns.no_python or ns.run_path),
        warm_modules=parse_choice(WarmModules, ns.warm_modules, "--warm-modules"),
        warm_cache=ns.warm_cache or None,
        warm_join_timeout=parse_seconds_text("--warm-join-timeout", ns.warm_join_timeout),
        standby_ranks=1 if standby_ranks is None else standby_ranks,
        require_logs=ns.require_logs,
        fault_limit=DEFAULT_FAULT_LIMIT if fault_limit is None else fault_limit,
        stop_on_script_fault=ns.stop_on_script_fault,
        quarantine_time=DEFAULT_QUARANTINE if quarantine_time is None else quarantine_time,
        straggler_interval=5.0 if straggler_interval is None else straggler_interval,
        replace_stragglers=replace_stragglers or 0,
        health_check=ns.health_check or None,
        health_check_timeout=parse_seconds_text("--health-check-timeout", ns.health_check_timeout),
        health_check_interval=parse_seconds_text(
            "--health-check-interval", ns.health_check_interval
        ),
        **torchrun_settings(ns),
    )
    cmd = Command(
        script=ns.script,
        args=tuple(ns.script_args),
        module=ns.module,
        no_python=ns.no_python,
        run_path=ns.run_path,
    )
    check_command(cmd)
    return config, cmd


def parse_flags(argv: Sequence[str], *, legacy: bool = False) -> Flags:
    """The command line ``argv`` of ``elastrun`` (``legacy``: of ``python -m
    elastrun.launch``). Raises ConfigError naming the flag; SystemExit for
    --help and --version."""
    parser = build_parser(legacy=legacy)
    ns, extras = parser.parse_known_args(list(argv))
    if extras:
        raise ConfigError(unknown_flags_message(extras, parser))
    env = env_sources(parser, ns)
    try:
        config, command = config_from_args(ns)
        if not legacy:
            return Flags(config, command, env=env)
        style = parse_choice(LocalRankStyle, ns.local_rank_style, "--local-rank-style")
    except ConfigError as exc:
        raise name_env(exc, env) from None
    return Flags(config, command, LegacyFlags(ns.use_env, style), env=env)


def resolve_flags(flags: Flags, command: WorkerCommand) -> Plan:
    """:func:`~elastrun.launcher.plan.resolve` of a parsed command line: an
    error about a flag whose value came from the environment names the
    variable too."""
    try:
        return resolve(flags.config, command)
    except ConfigError as exc:
        raise name_env(exc, flags.env) from None


def add_rendezvous_flags(p: argparse.ArgumentParser) -> None:
    """How nodes find each other: the rendezvous backend, endpoint, id and its settings."""
    g = p.add_argument_group("rendezvous (how nodes find each other)")
    g.add_argument(
        *both("--nnodes"),
        action=EnvDefault,
        default="1:1",
        metavar="N|MIN:MAX",
        help="number of nodes, or the elastic range MIN:MAX (default: 1:1)",
    )
    g.add_argument(
        *both("--node-unit"),
        action=EnvDefault,
        default=None,
        metavar="K",
        help="only world sizes that are multiples of K nodes (between MIN and MAX) are "
        "formed; nodes beyond the largest allowed size wait as hot spares and replace a "
        "lost node (default: 1)",
    )
    g.add_argument(
        *both("--rdzv-backend"),
        action=EnvDefault,
        default="static",
        metavar="NAME",
        help="c10d (our embedded store; also 'tcp'), etcd (etcd v3 API; 'etcd-v2' is served by "
        "the same etcd v3 backend), or static (fixed world from --node-rank/--master-addr). "
        "Default: static; a single-node static launch without --master-port runs as "
        "--standalone, as in torchrun",
    )
    g.add_argument(
        *both("--rdzv-endpoint"),
        action=EnvDefault,
        default="",
        metavar="HOST[:PORT]",
        help="c10d: the store's host[:port] (default port 29400); etcd: host[:port],... "
        "(default port 2379, http(s):// allowed); static: the master's host:port",
    )
    g.add_argument(
        *both("--rdzv-id"),
        action=EnvDefault,
        default="none",
        metavar="ID",
        help="job id: every node of one job uses the same (default: none)",
    )
    g.add_argument(
        *both("--rdzv-conf"),
        action=EnvDefault,
        default="",
        metavar="K=V,...",
        help="rendezvous settings: join_timeout (600), last_call_timeout (30), close_timeout "
        "(30: how long leaving may take), read_timeout (60, at most the join timeout: each "
        "store request), timeout (= join_timeout), lease_ttl (10), "
        "exit_barrier_timeout (300), is_host=1|0 (this node hosts the c10d store; default: "
        "when the endpoint is a local address and its port is free), store_bind (where the "
        "hosted store listens: default the endpoint's addresses; 0.0.0.0, ::, * for every "
        "interface), token or token_file (store auth; default: $ELASTRUN_STORE_TOKEN or "
        "$ELASTRUN_STORE_TOKEN_FILE), metrics_port (as --metrics-port); etcd: cacert, cert, "
        "key, user, password, key_prefix, protocol",
    )
    g.add_argument(
        "--standalone",
        action=EnvFlag,
        help="single node: host the store in-process on 127.0.0.1 with a free port and a "
        "generated --rdzv-id (--rdzv-backend/--rdzv-endpoint/--rdzv-id are ignored)",
    )


def add_static_flags(p: argparse.ArgumentParser) -> None:
    """torchrun's legacy multi-node launch: a node rank and a master address and port."""
    s = p.add_argument_group("static rendezvous (torchrun's legacy multi-node launch)")
    s.add_argument(
        *both("--node-rank"),
        action=EnvDefault,
        default=None,
        metavar="RANK",
        help="this node's rank in 0..nnodes-1; required with --rdzv-backend=static and "
        "--nnodes>1; with c10d/etcd a hint for keeping rank order",
    )
    s.add_argument(
        *both("--master-addr"),
        action=EnvDefault,
        default="127.0.0.1",
        metavar="ADDR",
        help="static: address of node rank 0 (default: 127.0.0.1; IPv6 as [addr])",
    )
    s.add_argument(
        *both("--master-port"),
        action=EnvDefault,
        default=None,
        metavar="PORT",
        help="static: port on node rank 0 for the workers' process group (default: 29500)",
    )


def add_worker_flags(p: argparse.ArgumentParser) -> None:
    """What runs on this node: how many workers, how they are started, their command."""
    w = p.add_argument_group("workers")
    w.add_argument(
        *both("--nproc-per-node"),
        action=EnvDefault,
        default="1",
        metavar="N|auto|cpu|gpu|xpu",
        help="workers on this node: a number, gpu (one per visible NVIDIA GPU), xpu (one per "
        "visible Intel GPU), cpu (one per CPU), or auto (gpu, else xpu, else cpu). Default: 1",
    )
    w.add_argument(
        "--role",
        action=EnvDefault,
        default="default",
        help="role name of the workers (ROLE_NAME; default: default)",
    )
    w.add_argument(
        "-m",
        "--module",
        action=EnvFlag,
        help="run the script as a module, like 'python -m'",
    )
    w.add_argument(
        *both("--no-python"),
        action=EnvFlag,
        help="run the script directly as a program, without 'python'",
    )
    w.add_argument(
        *both("--run-path"),
        action=EnvFlag,
        help="run the script with runpy.run_path (takes precedence over --no-python)",
    )
    w.add_argument(
        *both("--local-addr"),
        action=EnvDefault,
        default=None,
        metavar="ADDR",
        help="address other nodes use to reach this node, used as given (default: the local "
        "address that routes to the rendezvous endpoint)",
    )
    w.add_argument(
        *both("--start-method"),
        action=EnvDefault,
        default="spawn",
        choices=[m.value for m in StartMethod],
        help="accepted for compatibility: Python workers are forked from elastrun's warm "
        "interpreter (--warm, a fresh process of its own that imported torch; never from the "
        "launcher), other commands and --no-warm start as fresh processes (default: spawn)",
    )
    w.add_argument(
        *both("--monitor-interval"),
        action=EnvDefault,
        default="0.1",
        metavar="SECONDS",
        help="accepted for compatibility: worker exits are seen as they happen, not polled",
    )


def add_log_flags(p: argparse.ArgumentParser) -> None:
    """Where the workers' output and the events go, and what the console shows."""
    lg = p.add_argument_group("logs")
    lg.add_argument(
        *both("--log-dir"),
        action=EnvDefault,
        default=None,
        metavar="DIR",
        help="base folder for worker logs (one sub-folder per job, attempt and rank; default: "
        "none: no log files unless --redirects/--tee ask for them, then in a temporary folder)",
    )
    lg.add_argument(
        "-r",
        "--redirects",
        "--redirect",
        action=EnvDefault,
        default="0",
        metavar="STD",
        help="redirect worker output to log files only: 0 none, 1 stdout, 2 stderr, 3 both, "
        "or per local rank like 0:1,1:2 (default: 0)",
    )
    lg.add_argument(
        "-t",
        "--tee",
        action=EnvDefault,
        default="0",
        metavar="STD",
        help="copy worker output to log files and the console (format as --redirects; default: 0)",
    )
    lg.add_argument(
        *both("--local-ranks-filter"),
        action=EnvDefault,
        default="",
        metavar="R,...",
        help="show only these local ranks' output on the console, e.g. 0 or 0,1 (default: "
        "every rank)",
    )
    lg.add_argument(
        *both("--log-template"),
        action=EnvDefault,
        default=None,
        metavar="TEMPLATE",
        help="console prefix of worker lines; fields {host} {rank} {local_rank} {role} "
        "{group_rank} {restart} (default: '[{host}:{rank}]'). Without it, torch's "
        "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE shows lines as torchrun does",
    )
    lg.add_argument(
        *both("--require-logs"),
        action=EnvFlag,
        help="exit 1 when the workers succeeded but some of their output could not be "
        "written to its log file (a full disk); default: a warning and an event only",
    )
    lg.add_argument(
        *both("--metrics-port"),
        action=EnvDefault,
        default=None,
        metavar="[HOST,...:]PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (round, world size, "
        "restarts, recovery times, goodput by cause, step rate, stragglers, store term; "
        "default: not served; loopback unless HOSTs are given; docs/cli.md)",
    )
    lg.add_argument(
        *both("--events-file"),
        action=EnvDefault,
        default=None,
        metavar="PATH",
        help="append rendezvous and worker events as JSON lines to this file (default with "
        "--log-dir: LOG_DIR/RUN_ID/events-HOST.jsonl; see docs/events.md)",
    )


def add_fault_flags(p: argparse.ArgumentParser) -> None:
    """Restarts, hangs and exits, and the warm interpreter that makes restarts fast."""
    f = p.add_argument_group("fault tolerance")
    f.add_argument(
        *both("--max-restarts"),
        action=EnvDefault,
        default="0",
        metavar="N",
        help="restarts of the worker group the whole job may use (job-wide, not per node; "
        "default: 0)",
    )
    f.add_argument(
        *both("--shutdown-timeout"),
        action=EnvDefault,
        default=None,
        metavar="SECONDS",
        help="grace between SIGTERM and SIGKILL when stopping workers (default: "
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT or 30)",
    )
    f.add_argument(
        *both("--signals-to-handle"),
        action=EnvDefault,
        default=DEFAULT_SIGNALS,
        metavar="SIG,...",
        help=f"signals the agent catches and forwards to workers (default: {DEFAULT_SIGNALS}; "
        "add SIGUSR1,SIGUSR2 for SLURM preemption)",
    )
    f.add_argument(
        *both("--hang-timeout"),
        action=EnvDefault,
        default=None,
        metavar="SECONDS|auto[:FLOOR]",
        help="fail the group when a worker that showed progress (optimizer steps, DataLoader "
        "batches, heartbeat()) makes none for this long; 'auto' learns each rank's timeout "
        f"from its own progress, never below FLOOR (default {DEFAULT_AUTO_FLOOR:g} s); every "
        "rank's Python stack is shown (default: off)",
    )
    f.add_argument(
        *both("--stack-signal"),
        action=EnvDefault,
        default="SIGRTMIN+5",
        metavar="SIG|none",
        help="the signal that makes a worker write its Python stacks when a hang is declared "
        "(SIGRTMIN+N, SIGRTMAX-N, SIGUSR1, SIGUSR2, or none; default: SIGRTMIN+5). A rank "
        "whose script no longer catches it is skipped, never signalled",
    )
    # The warm interpreter's flags were first spelled --prewarm*: kept as aliases.
    f.add_argument(
        "--warm",
        "--prewarm",
        action=EnvSwitch,
        default=True,
        help="fork workers from a warm interpreter that imported torch and what the script "
        "imported when it last ran, so starts and restarts skip Python start and those "
        "imports (default: on; PET_WARM=0 turns it off)",
    )
    f.add_argument(
        *both("--warm-modules"),
        *both("--prewarm-modules"),
        action=EnvDefault,
        legacy_env="PET_PREWARM_MODULES",
        default="installed",
        choices=[m.value for m in WarmModules],
        help="what the warm interpreter imports ahead of time: 'installed' (torch and the "
        "standard-library and installed-package modules the script imported last time), "
        "'all' (the script's own modules too, never the script itself), 'torch' (torch "
        "only, no cache) (default: installed)",
    )
    f.add_argument(
        *both("--warm-cache"),
        *both("--prewarm-cache"),
        action=EnvDefault,
        legacy_env="PET_PREWARM_CACHE",
        default=None,
        metavar="DIR",
        help="where the lists of modules scripts imported (and a candidate host's votes) "
        "are kept across runs (default: $ELASTRUN_CACHE_DIR, else $XDG_CACHE_HOME/elastrun or "
        "~/.cache/elastrun)",
    )
    f.add_argument(
        *both("--warm-join-timeout"),
        action=EnvDefault,
        default=None,
        metavar="SECONDS",
        help="a node joining a running job waits up to this long for its warm interpreter "
        "before it enters the round, so the others pause only for the restart (default: "
        "60; 0: do not wait)",
    )
    f.add_argument(
        *both("--standby-ranks"),
        action=EnvDefault,
        default="1",
        metavar="N",
        help="for a script that uses elastrun.train.in_process: standby processes per node "
        "that ran the script up to its in-process function, so that a rank whose process "
        "is gone is served at once by one of them (default: 1; 0: none)",
    )
    f.add_argument(
        *both("--exit-barrier-timeout"),
        action=EnvDefault,
        default=None,
        metavar="SECONDS",
        help="how long a node whose workers succeeded waits for the rest of the job "
        "(default: 300; same as --rdzv-conf exit_barrier_timeout)",
    )

    f.add_argument(
        *both("--fault-limit"),
        action=EnvDefault,
        default=None,
        metavar="N",
        help="identical failures that make a verdict on the job's failures: the same "
        "exception of the same rank at about the same step is a script fault, failures of "
        "one node's own ranks in a row are a node fault (default: 2; 0: no verdicts)",
    )
    f.add_argument(
        "--stop-on-script-fault",
        action=EnvSwitch,
        default=True,
        help="a script fault stops the job: every node exits 1 naming the exception, the "
        "rank and the step, without spending the other restarts (default: on)",
    )
    f.add_argument(
        *both("--quarantine-time"),
        action=EnvDefault,
        default=None,
        metavar="SECONDS",
        help="a node judged faulty leaves the job and is refused for this long (a spare "
        "takes its place, else the job shrinks to an allowed size); `elastrun status "
        "--clear-quarantine HOST` lets it back; only where the job can go on without it "
        "(a spare waits, or the others are at least --nnodes' minimum), else it stays "
        f"(default: {DEFAULT_QUARANTINE:g}; 0: node faults are only reported)",
    )
    f.add_argument(
        *both("--straggler-interval"),
        action=EnvDefault,
        default=None,
        metavar="SECONDS",
        help="how often each node shares its ranks' step times and group rank 0 names "
        "the stragglers (a rank slower than 1.2 times the median for 3 intervals in a "
        "row) (default: 5)",
    )
    f.add_argument(
        *both("--replace-stragglers"),
        action=EnvDefault,
        default=None,
        metavar="K",
        help="a node named a straggler for K intervals in a row leaves the job and a "
        "waiting spare takes its place (only when a spare waits: otherwise it is only "
        "reported); it is kept out for --quarantine-time (default: 0, stragglers are "
        "only reported)",
    )
    f.add_argument(
        *both("--health-check"),
        action=EnvDefault,
        default=None,
        metavar="CMD",
        help="a command (e.g. 'nvidia-smi -L', 'dcgmi diag -r 1') run before the node joins "
        "each round and every --health-check-interval seconds while it trains: a node "
        "whose check fails (non-zero, or past its timeout: killed) does not join, or leaves "
        "at the next round boundary (default: none; also --rdzv-conf health_check)",
    )
    f.add_argument(
        *both("--health-check-timeout"),
        action=EnvDefault,
        default=None,
        metavar="SECONDS",
        help="how long --health-check may run before it is killed and counts as failed "
        "(default: 60)",
    )
    f.add_argument(
        *both("--health-check-interval"),
        action=EnvDefault,
        default=None,
        metavar="SECONDS",
        help="run --health-check this often while the node trains (default: 0, only "
        "before joining)",
    )


def add_torchrun_flags(p: argparse.ArgumentParser) -> None:
    c = p.add_argument_group("torchrun compatibility")
    c.add_argument(
        *both("--numa-binding"),
        action=EnvDefault,
        default=None,
        choices=NUMA_MODES,
        metavar="MODE",
        help="as torchrun: run each worker under numactl, bound to the CPUs near the GPU of "
        "its local rank: node (the GPU's NUMA node), socket (its socket), exclusive (an equal "
        "share of the node's cores for each of its GPUs' workers), core-complex (a group of "
        "CPUs sharing the last-level cache). Needs NVIDIA GPUs and numactl: refused, saying "
        "which is missing, without them (default: off)",
    )
    c.add_argument(
        *both("--virtual-local-rank"),
        action=EnvFlag,
        help="every worker gets LOCAL_RANK=0 and, as CUDA_VISIBLE_DEVICES, only its own GPU "
        "(the local rank's entry of CUDA_VISIBLE_DEVICES, else the local rank), as torchrun "
        "(default: off)",
    )
    for stream in ("stdout", "stderr"):
        c.add_argument(
            *both(f"--duplicate-{stream}-filters"),
            action=EnvDefault,
            default="",
            metavar="TEXT,...",
            help=f"copy the {stream} lines of --tee'd ranks that contain one of these texts "
            f"to filtered_{stream}.log in the attempt's log folder (a double comma is a "
            "comma in a text), as torchrun (default: none)",
        )
    c.add_argument(
        *both("--event-log-handler"),
        action=EnvDefault,
        default="null",
        metavar="NAME",
        help="accepted and not used: elastrun's events go to --events-file (JSON lines)",
    )
    c.add_argument(
        *both("--logs-specs"),
        action=LogsSpecs,
        default=None,
        metavar="NAME",
        help="accepted: 'default' (torch's default logs, which these flags are); plugins are "
        "not loaded",
    )


def split_filters(text: str) -> tuple[str, ...]:
    """torchrun's list: ``a,b`` -> (a, b); ``,,`` is a comma in a text;
    empty texts dropped (they would match every line)."""
    placeholder = "\x00"
    items = text.replace(",,", placeholder).split(",")
    return tuple(i.replace(placeholder, ",") for i in items if i)


def torchrun_settings(ns: argparse.Namespace) -> dict[str, Any]:
    """The LaunchConfig fields these flags set."""
    return {
        "numa_binding": ns.numa_binding or None,
        "virtual_local_rank": ns.virtual_local_rank,
        "duplicate_stdout_filters": split_filters(ns.duplicate_stdout_filters),
        "duplicate_stderr_filters": split_filters(ns.duplicate_stderr_filters),
        "event_log_handler": ns.event_log_handler,
    }
