"""The launch flags of ``elastrun``, one argparse group each: the rendezvous,
the static (torchrun's legacy multi-node) launch, the workers, the logs, and
fault tolerance with the warm interpreter. What each flag is called (both
spellings), its ``PET_*`` default, its metavar and its help with its default,
as ``elastrun --help`` shows them; :mod:`elastrun.launcher.flags` builds the
parser from these groups and reads the parsed values into a ``LaunchConfig``.
"""

from __future__ import annotations

import argparse

from elastrun.agent.spec import StartMethod, WarmModules
from elastrun.agent.watchdog import DEFAULT_AUTO_FLOOR
from elastrun.launcher.config import DEFAULT_SIGNALS
from elastrun.launcher.flag_parser import (
    EnvDefault,
    EnvFlag,
    EnvSwitch,
    both,
)

__all__ = [
    "add_fault_flags",
    "add_log_flags",
    "add_rendezvous_flags",
    "add_static_flags",
    "add_worker_flags",
]


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
        "$ELASTRUN_STORE_TOKEN_FILE); etcd: cacert, cert, key, user, password, key_prefix, "
        "protocol",
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
        *both("--exit-barrier-timeout"),
        action=EnvDefault,
        default=None,
        metavar="SECONDS",
        help="how long a node whose workers succeeded waits for the rest of the job "
        "(default: 300; same as --rdzv-conf exit_barrier_timeout)",
    )
