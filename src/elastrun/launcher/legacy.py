"""``python -m elastrun.launch``: torch.distributed.launch's command line.

Scripts written for ``python -m torch.distributed.launch`` read their local
rank from an argument (``parser.add_argument("--local_rank")``). This entry
point takes every ``elastrun`` flag (torchrun's, in both spellings) plus
torch.distributed.launch's ``--use-env``/``--use_env`` and, unless
``--use-env`` is given, passes each worker its local rank as an argument
right after the script, as torch.distributed.launch does::

    python -m elastrun.launch --nproc_per_node=2 train.py --lr 0.1
    # worker 1 runs: python -u train.py --local_rank=1 --lr 0.1

Which spelling (``--local-rank-style``, default ``auto``): torch up to 1.x
passed ``--local_rank=N``, torch 2.x passes ``--local-rank=N``, and a script
that declares only one of them refuses the other. ``auto`` reads the script's
source (for ``-m``, the module's file under the working directory): it passes
``--local-rank=N`` when the source names ``--local-rank`` and never
``--local_rank``, else ``--local_rank=N`` (which also serves scripts that
declare both, and argument parsers built from a ``local_rank`` field).
``LOCAL_RANK`` is set in every case, as always.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence

from elastrun.agent.command import PythonModule, PythonScript
from elastrun.agent.spawn import entry_file
from elastrun.agent.spec import LOCAL_RANK_MACRO
from elastrun.errors import ConfigError
from elastrun.launcher.cli import execute, usage_error
from elastrun.launcher.command import Command, worker_command
from elastrun.launcher.flags import LEGACY_USAGE, LocalRankStyle, parse_flags, resolve_flags
from elastrun.launcher.plan import Plan

__all__ = ["STYLES", "local_rank_flag", "main", "parse_legacy"]

STYLES = {LocalRankStyle.UNDERSCORE: "--local_rank", LocalRankStyle.DASH: "--local-rank"}
MAX_SOURCE_BYTES = 4 << 20  # a script larger than this is read only this far


def _source_file(cmd: Command) -> str | None:
    """The Python file the workers run first, when it can be found without
    importing anything."""
    if cmd.run_path:
        return cmd.script
    command = worker_command(cmd)
    return entry_file(command) if isinstance(command, PythonScript | PythonModule) else None


def local_rank_flag(cmd: Command, style: LocalRankStyle = LocalRankStyle.AUTO) -> str:
    """The local rank argument's name for ``cmd`` (see the module doc)."""
    if style in STYLES:
        return STYLES[style]
    path = _source_file(cmd)
    if path is None:
        return STYLES[LocalRankStyle.UNDERSCORE]
    try:
        with open(path, "rb") as fp:
            source = fp.read(MAX_SOURCE_BYTES)
    except OSError:
        return STYLES[LocalRankStyle.UNDERSCORE]
    if b"--local-rank" in source and b"--local_rank" not in source:
        return STYLES[LocalRankStyle.DASH]
    return STYLES[LocalRankStyle.UNDERSCORE]


def parse_legacy(argv: Sequence[str]) -> tuple[Plan, Command, str | None]:
    """Flags -> (Plan, Command with the local rank argument, its name or None
    with --use-env). Raises ConfigError naming the flag."""
    flags = parse_flags(argv, legacy=True)
    cmd, legacy = flags.command, flags.legacy
    assert legacy is not None
    flag: str | None = None
    if not legacy.use_env:
        if cmd.no_python and not cmd.run_path:
            raise ConfigError(
                "--no-python: needs --use-env (as with torch.distributed.launch): a program "
                "reads its local rank from LOCAL_RANK, not from a --local-rank argument"
            )
        flag = local_rank_flag(cmd, legacy.local_rank_style)
        cmd = dataclasses.replace(cmd, args=(f"{flag}={LOCAL_RANK_MACRO}", *cmd.args))
    return resolve_flags(flags, worker_command(cmd)), cmd, flag


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``python -m elastrun.launch [flags] script [args]``; returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        plan, _, flag = parse_legacy(args)
    except ConfigError as exc:
        return usage_error(exc, LEGACY_USAGE)
    except SystemExit as exc:  # --help, --version
        return exc.code if isinstance(exc.code, int) else 0
    if flag is not None:
        sys.stderr.write(
            f"elastrun.launch: each worker gets {flag}=<local rank> (as with "
            "torch.distributed.launch) and LOCAL_RANK; a script that reads LOCAL_RANK runs "
            "under 'elastrun' without it (see docs/migration.md)\n"
        )
        sys.stderr.flush()
    return execute(plan)
