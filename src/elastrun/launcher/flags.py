"""The command line: every flag of ``elastrun`` and ``python -m
elastrun.launch``, parsed into a :class:`~elastrun.launcher.config.LaunchConfig`
and a :class:`~elastrun.launcher.command.Command`, in one place.

Every torchrun flag in both spellings (``--nproc-per-node`` and
``--nproc_per_node``), with torchrun's ``PET_<FLAG>`` environment defaults
(e.g. ``PET_NNODES=2``; a flag on the command line wins), torch's aliases
(``--redirect``, ``-r``, ``-t``, the backends' other names) and, for
``python -m elastrun.launch``, torch.distributed.launch's ``--use-env`` and
the spelling of its local rank argument (:class:`LegacyFlags`). The text of
each value is read by :mod:`elastrun.launcher.flag_values`; the launch flags' groups (names,
``PET_*`` defaults, help) are defined in :mod:`elastrun.launcher.flag_groups`; the values are
checked once, with the Python API's, by :func:`elastrun.launcher.plan.resolve`.
"""

from __future__ import annotations

import argparse
import enum
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from elastrun.agent.command import WorkerCommand
from elastrun.agent.spec import StartMethod, WarmModules
from elastrun.errors import ConfigError
from elastrun.launcher.command import Command, check_command
from elastrun.launcher.config import LaunchConfig, parse_choice
from elastrun.launcher.flag_groups import (
    add_fault_flags,
    add_log_flags,
    add_rendezvous_flags,
    add_static_flags,
    add_worker_flags,
)
from elastrun.launcher.flag_parser import (
    Parser,
    env_sources,
    name_env,
    unknown_flags_message,
    version,
)
from elastrun.launcher.flag_values import (
    parse_hang_timeout,
    parse_integer,
    parse_nnodes,
    parse_nproc,
    parse_ranks_filter,
    parse_seconds_text,
    parse_signals,
    parse_stack_signal,
    parse_std,
)
from elastrun.launcher.flags_torchrun import add_torchrun_flags, torchrun_settings
from elastrun.launcher.limits import FLAG_SECONDS, parse_seconds
from elastrun.launcher.plan import Plan, resolve
from elastrun.launcher.rdzv_conf import split_rdzv_conf
from elastrun.names import RunId
from elastrun.store.factory import Backend

__all__ = [
    "LEGACY_USAGE",
    "Flags",
    "LegacyFlags",
    "LocalRankStyle",
    "build_parser",
    "config_from_args",
    "parse_flags",
    "resolve_flags",
]

LEGACY_USAGE = "python -m elastrun.launch [flags] script [script args...]"


class LocalRankStyle(enum.StrEnum):
    """How ``python -m elastrun.launch`` spells each worker's local rank argument."""

    AUTO = "auto"  # from the script's source (launcher/legacy.py)
    UNDERSCORE = "underscore"  # --local_rank=N (torch 1.x)
    DASH = "dash"  # --local-rank=N (torch 2.x)


@dataclass(frozen=True)
class LegacyFlags:
    """torch.distributed.launch's own flags."""

    use_env: bool = False
    local_rank_style: LocalRankStyle = LocalRankStyle.AUTO


@dataclass(frozen=True)
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
    p.add_argument("--version", action="version", version=f"elastrun {version()}")

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
        hang_timeout=hang_timeout,
        hang_auto=hang_auto,
        stack_signal=parse_stack_signal(ns.stack_signal),
        exit_barrier_timeout=parse_seconds_text("--exit-barrier-timeout", ns.exit_barrier_timeout),
        # Warm interpreters run Python: not for --no-python programs or --run-path's -c.
        warm=ns.warm and not (ns.no_python or ns.run_path),
        warm_modules=parse_choice(WarmModules, ns.warm_modules, "--warm-modules"),
        warm_cache=ns.warm_cache or None,
        warm_join_timeout=parse_seconds_text("--warm-join-timeout", ns.warm_join_timeout),
        require_logs=ns.require_logs,
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
