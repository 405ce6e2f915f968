"""``elastrun [flags] script [script args...]``: torchrun's command line.

Every torchrun flag in both spellings (``--nproc-per-node`` and
``--nproc_per_node``), with torchrun's ``PET_<FLAG>`` environment defaults
(e.g. ``PET_NNODES=2``; a flag on the command line wins). Programmatic use::

    from elastrun.launcher.cli import main
    exit_code = main(["--standalone", "--nproc-per-node=2", "train.py"])
"""

from __future__ import annotations

import argparse
import difflib
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from elastrun.agent.watchdog import DEFAULT_AUTO_FLOOR
from elastrun.errors import ConfigError, ElastrunError
from elastrun.launcher.config import (
    DEFAULT_SIGNALS,
    LaunchConfig,
    parse_nnodes,
    parse_nproc,
    parse_ranks_filter,
    parse_rdzv_conf,
    parse_signals,
    parse_stack_signal,
    parse_std,
)
from elastrun.launcher.limits import (
    FLAG_SECONDS,
    MAX_NODES,
    MAX_RESTARTS,
    parse_int,
    parse_seconds,
)
from elastrun.launcher.plan import Plan, resolve
from elastrun.worker import _settle

__all__ = [
    "Command",
    "build_parser",
    "config_from_args",
    "execute",
    "main",
    "parse_namespace",
    "usage_error",
    "worker_argv",
]

USAGE = "elastrun [flags] script [script args...]"

# --run-path: run the script with runpy in a fresh interpreter (torchrun's run_script_path),
# inside worker/_settle.py's after_success (loaded by path: any Python 3 interpreter), which
# shuts torch.distributed down before exit when the script succeeded and left it up.
RUN_PATH_CODE = (
    "import runpy, sys\n"
    "sys.argv = sys.argv[1:]\n"
    "try:\n"
    "    from importlib.util import module_from_spec, spec_from_file_location\n"
    f"    _spec = spec_from_file_location('_elastrun_settle', {_settle.__file__!r})\n"
    "    _mod = module_from_spec(_spec)\n"
    "    _spec.loader.exec_module(_mod)\n"
    "    _guard = _mod.after_success()\n"
    "except Exception:\n"
    "    import contextlib\n"
    "    _guard = contextlib.nullcontext()\n"
    "with _guard:\n"
    "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        if "required: script" in message:
            message = "script: missing: name the training script (or -m module) to run"
        raise ConfigError(message)


# Flags of torch.distributed.launch that name a worker argument, not a
# launcher setting: never guessed as an abbreviation of one of ours.
_LEGACY_FLAGS = {
    "--local-rank": (
        "not an elastrun flag: each worker finds its local rank in LOCAL_RANK. A script "
        "that wants it as an argument runs under 'python -m elastrun.launch' (as under "
        "torch.distributed.launch); an argument for the script goes after the script "
        "(see docs/migration.md)"
    ),
    "--use-env": (
        "not an elastrun flag: elastrun always sets LOCAL_RANK, which is what --use-env "
        "asked torch.distributed.launch for; drop the flag (or use 'python -m "
        "elastrun.launch --use-env', see docs/migration.md)"
    ),
}


def unknown_flags_message(extras: Sequence[str], parser: argparse.ArgumentParser) -> str:
    """The error for arguments before the script that are no flag of ours.
    Flags are never abbreviated (a prefix could silently mean another flag,
    e.g. --local-rank for --local-ranks-filter): suggest the full name."""
    first = extras[0]
    name = first.split("=", 1)[0]
    legacy = _LEGACY_FLAGS.get(name.replace("_", "-"))
    if legacy is not None:
        return f"{name}: {legacy}"
    known = sorted(parser._option_string_actions)  # argparse keeps them here
    hint = ""
    if name.startswith("--"):
        # One spelling per flag: the one in the style the user typed.
        style = "_" if "_" in name else "-"
        names: dict[str, str] = {}
        for o in known:
            if o.startswith("--"):
                key = "--" + o[2:].replace("_", "-")
                if key not in names or (style in o[2:] and style not in names[key][2:]):
                    names[key] = o
        spelled = sorted(names.values())
        longer = [o for o in spelled if o.startswith(name) and o != name]
        close = difflib.get_close_matches(name, spelled, n=1, cutoff=0.75)
        if longer:
            hint = f"; did you mean {' or '.join(longer[:3])}? (flags are not abbreviated)"
        elif close:
            hint = f"; did you mean {close[0]}?"
    return f"unrecognized arguments: {' '.join(extras)}{hint}"


def _env_name(dest: str) -> str:
    return f"PET_{dest.upper()}"


class EnvDefault(argparse.Action):
    """A value flag whose default comes from ``PET_<DEST>`` (torchrun's ``env``)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        env = os.environ.get(_env_name(dest))
        if env is not None and env != "":
            kwargs["default"] = env
        super().__init__(option_strings, dest, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)


def _env_bool(dest: str, default: bool) -> bool:
    """``PET_<DEST>`` as 0 or 1 (unset or empty: ``default``)."""
    env = os.environ.get(_env_name(dest), "").strip()
    if not env:
        return default
    try:
        return bool(int(env))
    except ValueError:
        raise ConfigError(f"{_env_name(dest)}: expected 0 or 1, got {env!r}") from None


class EnvFlag(argparse.Action):
    """A boolean flag that ``PET_<DEST>=1`` turns on (torchrun's ``check_env``)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        default = _env_bool(dest, False)
        kwargs.pop("default", None)
        super().__init__(option_strings, dest, nargs=0, const=True, default=default, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, True)


class EnvSwitch(argparse.BooleanOptionalAction):
    """A ``--flag`` / ``--no-flag`` pair whose default ``PET_<DEST>`` (0 or 1)
    sets; the command line wins."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        kwargs["default"] = _env_bool(dest, bool(kwargs.get("default")))
        super().__init__(option_strings, dest, **kwargs)


class LogsSpecs(argparse.Action):
    """torchrun's --logs-specs: ``default`` (torch's own DefaultLogsSpecs: the
    log folders, --redirects, --tee and --local-ranks-filter, which elastrun
    implements) is accepted as the no-op it is; plugins are not loaded."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        if str(values).strip() != "default":
            raise ConfigError(
                f"{option_string}: {values!r}: elastrun loads no torchrun.logs_specs plugins; "
                "only 'default' (what --log-dir, --redirects, --tee and --local-ranks-filter "
                "do) is accepted"
            )
        setattr(namespace, self.dest, "default")


class Unsupported(argparse.Action):
    """A torchrun flag elastrun does not offer: a clear error instead of 'unrecognized'."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        self.reason = kwargs.pop("reason")
        super().__init__(option_strings, dest, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        raise ConfigError(f"{option_string}: not supported by elastrun ({self.reason})")


def _both(name: str) -> list[str]:
    """``--nproc-per-node`` -> [``--nproc-per-node``, ``--nproc_per_node``]."""
    under = name.replace("-", "_").replace("__", "--", 1)
    return [name] if under == name else [name, under]


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("elastrun")
    except Exception:  # pragma: no cover - not installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
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
    p.add_argument("--version", action="version", version=f"elastrun {_version()}")

    g = p.add_argument_group("rendezvous (how nodes find each other)")
    g.add_argument(
        *_both("--nnodes"),
        action=EnvDefault,
        default="1:1",
        metavar="N|MIN:MAX",
        help="number of nodes, or the elastic range MIN:MAX (default: 1:1)",
    )
    g.add_argument(
        *_both("--rdzv-backend"),
        action=EnvDefault,
        default="static",
        metavar="NAME",
        help="c10d (our embedded store; also 'tcp'), etcd (etcd v3 API; 'etcd-v2' is served by "
        "the same etcd v3 backend), or static (fixed world from --node-rank/--master-addr). "
        "Default: static; a single-node static launch without --master-port runs as "
        "--standalone, as in torchrun",
    )
    g.add_argument(
        *_both("--rdzv-endpoint"),
        action=EnvDefault,
        default="",
        metavar="HOST[:PORT]",
        help="c10d: the store's host[:port] (default port 29400); etcd: host[:port],... "
        "(default port 2379, http(s):// allowed); static: the master's host:port",
    )
    g.add_argument(
        *_both("--rdzv-id"),
        action=EnvDefault,
        default="none",
        metavar="ID",
        help="job id: every node of one job uses the same (default: none)",
    )
    g.add_argument(
        *_both("--rdzv-conf"),
        action=EnvDefault,
        default="",
        metavar="K=V,...",
        help="rendezvous settings: join_timeout (600), last_call_timeout (30), close_timeout, "
        "read_timeout (store request timeout), timeout (= join_timeout), lease_ttl (10), "
        "exit_barrier_timeout (300), is_host=1|0 (this node hosts the c10d store; default: "
        "when the endpoint is a local address and its port is free), store_bind (where the "
        "hosted store listens: default the endpoint's addresses; 0.0.0.0, ::, * for every "
        "interface), token or token_file (store auth; default: $ELASTRUN_STORE_TOKEN or "
        "$ELASTRUN_STORE_TOKEN_FILE); etcd: cacert, cert, key, user, password, key_prefix, "
        "protocol",
    )
    g.add_argument(
        "--standalone",
        action=EnvFlag,
        help="single node: host the store in-process on 127.0.0.1 with a free port and a "
        "generated --rdzv-id (--rdzv-backend/--rdzv-endpoint/--rdzv-id are ignored)",
    )

    s = p.add_argument_group("static rendezvous (torchrun's legacy multi-node launch)")
    s.add_argument(
        *_both("--node-rank"),
        action=EnvDefault,
        default=None,
        metavar="RANK",
        help="this node's rank in 0..nnodes-1; required with --rdzv-backend=static and "
        "--nnodes>1; with c10d/etcd a hint for keeping rank order",
    )
    s.add_argument(
        *_both("--master-addr"),
        action=EnvDefault,
        default="127.0.0.1",
        metavar="ADDR",
        help="static: address of node rank 0 (default: 127.0.0.1; IPv6 as [addr])",
    )
    s.add_argument(
        *_both("--master-port"),
        action=EnvDefault,
        default=None,
        metavar="PORT",
        help="static: port on node rank 0 for the workers' process group (default: 29500)",
    )

    w = p.add_argument_group("workers")
    w.add_argument(
        *_both("--nproc-per-node"),
        action=EnvDefault,
        default="1",
        metavar="N|auto|cpu|gpu|xpu",
        help="workers on this node: a number, gpu (one per visible NVIDIA GPU), xpu (one per "
        "visible Intel GPU), cpu (one per CPU), or auto (gpu, else xpu, else cpu). Default: 1",
    )
    w.add_argument("--role", action=EnvDefault, default="default", help="role name of the workers")
    w.add_argument(
        "-m",
        "--module",
        action=EnvFlag,
        help="run the script as a module, like 'python -m'",
    )
    w.add_argument(
        *_both("--no-python"),
        action=EnvFlag,
        help="run the script directly as a program, without 'python'",
    )
    w.add_argument(
        *_both("--run-path"),
        action=EnvFlag,
        help="run the script with runpy.run_path (takes precedence over --no-python)",
    )
    w.add_argument(
        *_both("--local-addr"),
        action=EnvDefault,
        default=None,
        metavar="ADDR",
        help="address other nodes use to reach this node, used as given (default: the local "
        "address that routes to the rendezvous endpoint)",
    )
    w.add_argument(
        *_both("--start-method"),
        action=EnvDefault,
        default="spawn",
        choices=["spawn", "fork", "forkserver"],
        help="accepted for compatibility: workers are always started as fresh processes",
    )
    w.add_argument(
        *_both("--monitor-interval"),
        action=EnvDefault,
        default="0.1",
        metavar="SECONDS",
        help="accepted for compatibility: worker exits are seen as they happen, not polled",
    )

    lg = p.add_argument_group("logs")
    lg.add_argument(
        *_both("--log-dir"),
        action=EnvDefault,
        default=None,
        metavar="DIR",
        help="base folder for worker logs (one sub-folder per job, attempt and rank)",
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
        help="copy worker output to log files and the console (format as --redirects)",
    )
    lg.add_argument(
        *_both("--local-ranks-filter"),
        action=EnvDefault,
        default="",
        metavar="R,...",
        help="show only these local ranks' output on the console, e.g. 0 or 0,1",
    )
    lg.add_argument(
        *_both("--log-template"),
        action=EnvDefault,
        default=None,
        metavar="TEMPLATE",
        help="console prefix of worker lines; fields {host} {rank} {local_rank} {role} "
        "{group_rank} {restart} (default: '[{host}:{rank}]'). Without it, torch's "
        "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE shows lines as torchrun does",
    )
    lg.add_argument(
        *_both("--require-logs"),
        action=EnvFlag,
        help="exit 1 when the workers succeeded but some of their output could not be "
        "written to its log file (a full disk); default: a warning and an event only",
    )
    lg.add_argument(
        *_both("--events-file"),
        action=EnvDefault,
        default=None,
        metavar="PATH",
        help="append rendezvous and worker events as JSON lines to this file (default with "
        "--log-dir: LOG_DIR/RUN_ID/events-HOST.jsonl; see docs/events.md)",
    )

    f = p.add_argument_group("fault tolerance")
    f.add_argument(
        *_both("--max-restarts"),
        action=EnvDefault,
        default="0",
        metavar="N",
        help="restarts of the worker group the whole job may use (job-wide, not per node; "
        "default: 0)",
    )
    f.add_argument(
        *_both("--shutdown-timeout"),
        action=EnvDefault,
        default=None,
        metavar="SECONDS",
        help="grace between SIGTERM and SIGKILL when stopping workers (default: "
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT or 30)",
    )
    f.add_argument(
        *_both("--signals-to-handle"),
        action=EnvDefault,
        default=DEFAULT_SIGNALS,
        metavar="SIG,...",
        help=f"signals the agent catches and forwards to workers (default: {DEFAULT_SIGNALS}; "
        "add SIGUSR1,SIGUSR2 for SLURM preemption)",
    )
    f.add_argument(
        *_both("--hang-timeout"),
        action=EnvDefault,
        default=None,
        metavar="SECONDS|auto[:FLOOR]",
        help="fail the group when a worker that showed progress (optimizer steps, DataLoader "
        "batches, heartbeat()) makes none for this long; 'auto' learns each rank's timeout "
        f"from its own progress, never below FLOOR (default {DEFAULT_AUTO_FLOOR:g} s); every "
        "rank's Python stack is shown (default: off)",
    )
    f.add_argument(
        *_both("--stack-signal"),
        action=EnvDefault,
        default="SIGRTMIN+5",
        metavar="SIG|none",
        help="the signal that makes a worker write its Python stacks when a hang is declared "
        "(SIGRTMIN+N, SIGRTMAX-N, SIGUSR1, SIGUSR2, or none; default: SIGRTMIN+5). A rank "
        "whose script no longer catches it is skipped, never signalled",
    )
    f.add_argument(
        "--prewarm",
        action=EnvSwitch,
        default=True,
        help="fork workers from a warm interpreter that imported torch and what the script "
        "imported when it last ran, so starts and restarts skip Python start and those "
        "imports (default: on; PET_PREWARM=0 turns it off)",
    )
    f.add_argument(
        *_both("--prewarm-modules"),
        action=EnvDefault,
        default="installed",
        choices=("installed", "all", "torch"),
        help="what the warm interpreter imports ahead of time: 'installed' (torch and the "
        "standard-library and installed-package modules the script imported last time), "
        "'all' (the script's own modules too, never the script itself), 'torch' (torch "
        "only, no cache) (default: installed)",
    )
    f.add_argument(
        *_both("--prewarm-cache"),
        action=EnvDefault,
        default=None,
        metavar="DIR",
        help="where the lists of modules scripts imported are kept across runs (default: "
        "$ELASTRUN_CACHE_DIR, else $XDG_CACHE_HOME/elastrun or ~/.cache/elastrun)",
    )
    f.add_argument(
        *_both("--warm-join-timeout"),
        action=EnvDefault,
        default=None,
        metavar="SECONDS",
        help="a node joining a running job waits up to this long for its warm interpreter "
        "before it enters the round, so the others pause only for the restart (default: "
        "60; 0: do not wait)",
    )
    f.add_argument(
        *_both("--exit-barrier-timeout"),
        action=EnvDefault,
        default=None,
        metavar="SECONDS",
        help="how long a node whose workers succeeded waits for the rest of the job "
        "(default: 300; same as --rdzv-conf exit_barrier_timeout)",
    )

    c = p.add_argument_group(
        "torchrun compatibility",
        "--numa-binding, --duplicate-stdout-filters, --duplicate-stderr-filters and "
        "--virtual-local-rank are refused with an explanation",
    )
    c.add_argument(
        *_both("--event-log-handler"),
        action=EnvDefault,
        default="null",
        metavar="NAME",
        help="accepted and ignored: use --events-file",
    )
    c.add_argument(
        *_both("--logs-specs"),
        action=LogsSpecs,
        default=None,
        metavar="NAME",
        help="accepted: 'default' (torch's default logs, which these flags are); plugins are "
        "not loaded",
    )
    for flag, reason in (
        ("--numa-binding", "bind workers with numactl via --no-python instead"),
        ("--duplicate-stdout-filters", "use --tee and grep the log files"),
        ("--duplicate-stderr-filters", "use --tee and grep the log files"),
    ):
        c.add_argument(*_both(flag), action=Unsupported, reason=reason, help=argparse.SUPPRESS)
    c.add_argument(
        *_both("--virtual-local-rank"),
        action=Unsupported,
        nargs=0,
        reason="set CUDA_VISIBLE_DEVICES from LOCAL_RANK in the script",
        help=argparse.SUPPRESS,
    )

    p.add_argument("script", metavar="script", help="the training script (or module, program)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    return p


def _float(flag: str, text: str | None) -> float | None:
    """ASCII seconds in the flag's documented range (limits.FLAG_SECONDS)."""
    if text is None:
        return None
    return parse_seconds(flag, text, FLAG_SECONDS[flag])


def parse_hang_timeout(text: str | None) -> tuple[float | None, bool]:
    """``--hang-timeout``: ``S`` (fixed), ``auto`` or ``auto:FLOOR`` ->
    (seconds or floor, auto)."""
    if text is None:
        return None, False
    raw = str(text).strip()
    if raw == "auto" or raw.startswith("auto:"):
        floor = raw.partition(":")[2]
        if not floor:
            if raw != "auto":
                raise ConfigError("--hang-timeout: 'auto:' needs a floor in seconds, e.g. auto:60")
            return DEFAULT_AUTO_FLOOR, True
        return parse_seconds("--hang-timeout", floor, FLAG_SECONDS["--hang-timeout"]), True
    return _float("--hang-timeout", raw), False


def _int(flag: str, text: str | None, lo: int, hi: int) -> int | None:
    """ASCII digits in ``lo..hi``."""
    if text is None:
        return None
    return parse_int(flag, text, lo, hi)


@dataclass(frozen=True)
class Command:
    """What each worker runs."""

    script: str
    args: tuple[str, ...]
    module: bool = False
    no_python: bool = False
    run_path: bool = False


def worker_argv(cmd: Command) -> tuple[str, ...]:
    """The full argv of a worker, as torchrun builds it."""
    python = os.environ.get("PYTHON_EXEC", sys.executable)
    if cmd.run_path:
        script = os.path.abspath(cmd.script)
        return (python, "-u", "-c", RUN_PATH_CODE, script, *cmd.args)
    if cmd.no_python:
        return (cmd.script, *cmd.args)
    if cmd.module:
        return (python, "-u", "-m", cmd.script, *cmd.args)
    return (python, "-u", cmd.script, *cmd.args)


def _check_command(cmd: Command) -> None:
    if cmd.module and cmd.no_python and not cmd.run_path:
        raise ConfigError("--no-python: cannot be combined with -m/--module")
    if cmd.module and not cmd.run_path:
        return
    if cmd.no_python and not cmd.run_path:
        found = os.path.isfile(cmd.script) if os.sep in cmd.script else shutil.which(cmd.script)
        if not found:
            raise ConfigError(f"script: program {cmd.script!r} not found")
        return
    if not os.path.isfile(cmd.script):
        raise ConfigError(
            f"script: file {cmd.script!r} not found (run a module with -m, a program with "
            "--no-python)"
        )


def config_from_args(ns: argparse.Namespace) -> tuple[LaunchConfig, Command]:
    """Parsed flags -> (LaunchConfig, Command). Raises ConfigError naming the flag."""
    min_nodes, max_nodes = parse_nnodes(ns.nnodes)
    shutdown = _float("--shutdown-timeout", ns.shutdown_timeout)
    if shutdown is None:
        torch_env = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
        if torch_env is not None:
            shutdown = parse_seconds(
                "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", torch_env, FLAG_SECONDS["--shutdown-timeout"]
            )
    # torch's template, honoured as torchrun does (see agent/logs.py), unless
    # --log-template chose ours.
    torch_template = os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE") or None
    monitor = _float("--monitor-interval", ns.monitor_interval)
    hang = parse_hang_timeout(ns.hang_timeout)
    max_restarts = _int("--max-restarts", ns.max_restarts, 0, MAX_RESTARTS)
    config = LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=parse_nproc(ns.nproc_per_node),
        run_id=ns.rdzv_id,
        role=ns.role,
        rdzv_backend=ns.rdzv_backend,
        rdzv_endpoint=ns.rdzv_endpoint,
        rdzv_configs=parse_rdzv_conf(ns.rdzv_conf),
        standalone=ns.standalone,
        max_restarts=0 if max_restarts is None else max_restarts,
        monitor_interval=0.1 if monitor is None else monitor,
        start_method=ns.start_method,
        node_rank=_int("--node-rank", ns.node_rank, 0, MAX_NODES - 1),
        master_addr=ns.master_addr,
        master_port=_int("--master-port", ns.master_port, 1, 65535),
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
        hang_timeout=hang[0],
        hang_auto=hang[1],
        stack_signal=parse_stack_signal(ns.stack_signal),
        exit_barrier_timeout=_float("--exit-barrier-timeout", ns.exit_barrier_timeout),
        # Spares run Python: not for --no-python programs or --run-path's -c.
        prewarm=ns.prewarm and not (ns.no_python or ns.run_path),
        prewarm_modules=ns.prewarm_modules,
        prewarm_cache=ns.prewarm_cache or None,
        warm_join_timeout=_float("--warm-join-timeout", ns.warm_join_timeout),
        require_logs=ns.require_logs,
    )
    cmd = Command(
        script=ns.script,
        args=tuple(ns.script_args),
        module=ns.module,
        no_python=ns.no_python,
        run_path=ns.run_path,
    )
    _check_command(cmd)
    return config, cmd


def parse_namespace(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """``parser.parse_args`` with our message for unknown flags."""
    ns, extras = parser.parse_known_args(list(argv))
    if extras:
        raise ConfigError(unknown_flags_message(extras, parser))
    return ns


def parse(argv: Sequence[str]) -> tuple[Plan, Command]:
    """Flags -> (Plan, Command). Raises ConfigError naming the flag."""
    ns = parse_namespace(build_parser(), argv)
    config, cmd = config_from_args(ns)
    return resolve(config), cmd


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``elastrun [flags] script [args]``; returns the exit code (2: bad flags)."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        plan, cmd = parse(args)
    except ConfigError as exc:
        return usage_error(exc)
    except SystemExit as exc:  # --help, --version
        return exc.code if isinstance(exc.code, int) else 0
    return execute(plan, cmd)


def usage_error(exc: ConfigError, usage: str = USAGE) -> int:
    """Report a bad flag (before anything started); returns 2."""
    sys.stderr.write(f"usage: {usage} (see --help)\n")
    sys.stderr.write(f"elastrun: error: {exc}\n")
    return 2


def execute(plan: Plan, cmd: Command) -> int:
    """Run a parsed launch; returns the exit code."""
    from elastrun.launcher.run import run_plan

    try:
        return run_plan(plan, worker_argv(cmd))
    except ConfigError as exc:
        sys.stderr.write(f"elastrun: error: {exc}\n")
        return 2
    except ElastrunError as exc:
        sys.stderr.write(f"elastrun: error: {exc}\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("elastrun: interrupted\n")
        return 130
